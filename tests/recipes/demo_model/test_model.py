"""Training-side math of the demo model: chained MTP attention and the shared-prefix path."""

from __future__ import annotations

import torch

from engine.model.layers import apply_rope, rope_cos_sin
from recipes.demo_model.model import chained_attention


def _qkv(att, x, cos, sin):
    B, T, _ = x.shape
    H, Hkv, D = att.n_head, att.n_head_kv, att.head_dim
    qg = att.attn_q(x).reshape(B, T, H, 2 * D)
    q = apply_rope(att.attn_q_norm(qg[..., :D]), cos, sin)
    k = apply_rope(att.attn_k_norm(att.attn_k(x).reshape(B, T, Hkv, D)), cos, sin)
    return q, k, att.attn_v(x).reshape(B, T, Hkv, D), qg[..., D:].reshape(B, T, H * D)


def test_chained_pass_sees_committed_rows_then_its_own_chain(tiny_model):
    """Draft step 3 at position i attends to pass-1 rows <= i-2, pass 2 at i-1 and itself (spec §2)."""
    att = tiny_model.net.blk[tiny_model.cfg.n_layer].mixer
    T = 7
    cos, sin = rope_cos_sin(torch.arange(T)[None], tiny_model.cfg.rope_dim, tiny_model.cfg.rope_theta)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, T, tiny_model.cfg.n_embd, generator=g) for _ in range(3)]
    with torch.no_grad():
        kvs, outs = [], []
        for x in xs:
            o, kv = chained_attention(att, x, cos, sin, kvs)
            kvs.append(kv)
            outs.append(o)
        parts = [_qkv(att, x, cos, sin) for x in xs]
        rep = att.n_head // att.n_head_kv
        for i in range(2, T):
            src = [(0, j) for j in range(i - 1)] + [(1, i - 1), (2, i)]
            K = torch.stack([parts[p][1][0, j] for p, j in src], 1).repeat_interleave(rep, 0)
            V = torch.stack([parts[p][2][0, j] for p, j in src], 1).repeat_interleave(rep, 0)
            q = parts[2][0][0, i]
            w = torch.softmax((q[:, None] * K).sum(-1) * att.scale, -1)
            o = (w[..., None] * V).sum(1).reshape(-1)
            ref = att.attn_output(o * torch.sigmoid(parts[2][3][0, i]))
            torch.testing.assert_close(outs[2][0, i], ref, atol=1e-5, rtol=1e-5)
        # pass 1 is plain causal attention: the engine module's own forward
        torch.testing.assert_close(outs[0], att(xs[0], cos, sin, None), atol=1e-6, rtol=1e-6)


def test_shared_prefix_gives_the_losses_of_the_full_rows(tiny_model):
    g = torch.Generator().manual_seed(7)
    P, T, B = 11, 17, 3
    pre = torch.randint(0, 400, (1, P), generator=g)
    suf = torch.randint(0, 400, (B, T), generator=g)
    w = (torch.rand(B, T, generator=g) > 0.3).float()
    full = torch.cat([pre.expand(B, P), suf], 1)
    wf = torch.cat([torch.zeros(B, P), w], 1)
    with torch.no_grad():
        a = tiny_model.losses(full, wf, n_pass=1)
        b = tiny_model.losses(suf, w, n_pass=1, prefix_tokens=pre)
    for key in ("main", "mtp1"):
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5)


def test_losses_backpropagate_into_every_parameter(tiny_model):
    x = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    m = tiny_model
    m.zero_grad()
    loss = sum(m.losses(x, torch.ones(2, 12), n_pass=3).values())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    m.zero_grad()
    assert not missing
