"""Gated DeltaNet (linear attention) of Qwen3.5 (spec/qwen35-gguf.md §4.4): the causal conv, the
delta rule in its one-token recurrent and chunked forms, and the mixer module.

The math is written as functions of tensors; state lives in the cache (engine/model/cache.py), never
in the module. No function here modifies its inputs (the training path runs under autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import Linear, rms_norm


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over the qkv channels (spec §4.4.2).

    x [B, T, C] raw qkv; weight [C, Kc]; conv_state [B, C, Kc-1] (the last Kc-1 raw inputs, oldest
    first) or None for zeros. Returns u [B, T, C] = silu(conv) and xpad [B, C, Kc-1+T] float32,
    whose columns j+1 .. j+Kc-1 are the conv state after token j."""
    B, T, C = x.shape
    kc = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(B, C, kc - 1, dtype=torch.float32)
    # time-major [B, Kc-1+T, C]: u comes out [B, T, C] with channels contiguous, as the delta rule
    # reads q, k and v (a channel-major u made a compiled verification gather them element by element)
    xpad = torch.cat([conv_state.float().transpose(1, 2), x.float()], dim=1)
    # y[b, t, c] = sum_j w[c, j] * xpad[b, t + j, c]; an unfolded product is far cheaper than a
    # depthwise conv call at decode sizes
    y = (xpad.unfold(1, kc, 1) * weight.float()).sum(-1)                # [B, T, C]
    return F.silu(y), xpad.transpose(1, 2)


def conv_states_per_step(xpad: torch.Tensor, kc: int) -> torch.Tensor:
    """xpad [B, C, Kc-1+T] -> [B, T+1, C, Kc-1]: the conv state after 0, 1, ..., T tokens (views)."""
    return xpad.unfold(2, kc - 1, 1).transpose(1, 2)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The transformers/FLA form x * rsqrt(sum x^2 + eps) (spec §4.4.3, CLARIFICATIONS Issue 4)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, state, all_states: bool = False):
    """Token-by-token gated delta rule (spec §4.4.5); the reference form and the T = 1 decode path.

    q, k [B, T, H, Dk] (unit k, scaled q, already broadcast to the value heads); v [B, T, H, Dv];
    g, beta [B, T, H]; state [B, H, Dk, Dv] float32. Returns o [B, T, H, Dv] and the final state;
    with all_states also the states after 1..T-1 tokens [B, T-1, H, Dk, Dv] (`intermediate_states`)."""
    T = q.shape[1]
    outs, states = [], []
    s = state
    # the two state-vector products are written as a product and a sum over Dk: inductor compiles them
    # into reductions vectorised along the contiguous Dv, fused with the state update (an einsum became a
    # batched product it ran 2-3.5x slower per token; docs/benchmarks.md, fourteenth session)
    for t in range(T):
        s = s * g[:, t].exp()[..., None, None]
        kt = k[:, t, :, :, None]                                            # [B, H, Dk, 1]
        delta = beta[:, t, :, None] * (v[:, t] - (kt * s).sum(-2))
        s = s + kt * delta[:, :, None, :]
        outs.append((q[:, t, :, :, None] * s).sum(-2))
        if all_states and t < T - 1:
            states.append(s)
    o = torch.stack(outs, dim=1)
    if not all_states:
        return o, s
    return o, s, intermediate_states(states, state)


def intermediate_states(states: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[B, ...] states after tokens 1..T-1 -> [B, T-1, ...]. A verification keeps only these: the state
    before the call is the pending token's, which a round always keeps, and the state after all T
    tokens goes to the cache (so a round neither copies the first nor writes the last twice)."""
    if not states:
        return like.new_empty(like.shape[0], 0, *like.shape[1:])
    return torch.stack(states, dim=1)


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64, all_states: bool = False):
    """The chunked (WY/UT) form of the same recurrence (spec §4.4.5 "Chunked form"): same arguments
    and results as `delta_rule_recurrent`, one triangular solve and one state update per chunk.
    Memory is O(chunk^2) per head beyond the inputs; with all_states O(T * Dk * Dv) per head."""
    B, T, H, dk = k.shape
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))   # [B, H, T, d]
    gh, bh = g.transpose(1, 2), beta.transpose(1, 2)      # [B, H, T]
    outs, states = [], []
    s = state
    for c0 in range(0, T, chunk):
        Q, K, V = qh[:, :, c0:c0 + chunk], kh[:, :, c0:c0 + chunk], vh[:, :, c0:c0 + chunk]
        G, Bt = gh[:, :, c0:c0 + chunk], bh[:, :, c0:c0 + chunk]
        c = K.shape[2]
        gam = G.cumsum(-1)                                             # [B, H, c] cumulative log decay
        lower = torch.ones(c, c, dtype=torch.bool, device=K.device).tril()
        dec = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [B,H,c,c]
        a = (Bt[..., :, None] * (K @ K.transpose(-1, -2)) * dec).tril(-1)
        eg = gam.exp()
        rhs = Bt[..., None] * (V - eg[..., None] * (K @ s))              # [B, H, c, Dv]
        delta = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        outs.append(eg[..., None] * (Q @ s) + ((Q @ K.transpose(-1, -2)) * dec) @ delta)
        if all_states:
            steps = eg[..., None, None] * s[:, :, None] + torch.einsum("bhjs,bhsk,bhsv->bhjkv", dec, K, delta)
            states.append(steps)
            s = steps[:, :, -1]
        else:
            last = gam[..., -1:]
            s = last.exp()[..., None] * s + K.transpose(-1, -2) @ ((last - gam).exp()[..., None] * delta)
    o = torch.cat(outs, dim=2).transpose(1, 2)
    if all_states:
        return o, s, torch.cat(states, dim=2)[:, :, :-1].transpose(1, 2)
    return o, s


# Calls of up to this many tokens (decode steps, MTP verification of k+1 <= 9 rows) use the per-token
# form: fewer operations than one chunk, and the same recurrence as one-token decoding, so a verified
# prefix leaves the state plain decoding would (spec/mtp-speculation.md §3.5, reliability-matrix F2).
RECURRENT_MAX_T = 9


class _Weight(nn.Module):
    def __init__(self, *shape: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device))


class _Bias(nn.Module):
    def __init__(self, n: int, device=None):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n, dtype=torch.float32, device=device))


class GatedDeltaNet(nn.Module):
    """The GDN mixer of one block. Parameter names are the GGUF tensor names (spec §3.3)."""

    def __init__(self, cfg, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        E, C, Cv, Hv = cfg.n_embd, cfg.conv_channels, cfg.ssm_d_inner, cfg.ssm_dt_rank
        self.n_k_heads, self.n_v_heads = cfg.ssm_n_group, Hv
        self.d_k, self.d_v, self.kc = cfg.ssm_d_state, cfg.ssm_head_v_dim, cfg.ssm_conv_kernel
        self.eps = cfg.rms_eps
        self.attn_qkv = Linear(E, C, dtype, device)
        self.attn_gate = Linear(E, Cv, dtype, device)
        self.ssm_beta = Linear(E, Hv, dtype, device)
        self.ssm_alpha = Linear(E, Hv, dtype, device)
        self.ssm_out = Linear(Cv, E, dtype, device)
        self.ssm_conv1d = _Weight(C, self.kc, device=device)       # [C, Kc], never quantized
        self.ssm_dt = _Bias(Hv, device=device)
        self.ssm_a = nn.Parameter(torch.zeros(Hv, dtype=torch.float32, device=device))  # -exp(A_log)
        self.ssm_norm = _Weight(self.d_v, device=device)            # used as is, no +1

    def forward(self, a: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                *, chunk: int = 64, all_states: bool = False):
        """a [B, T, E] (normed block input); conv_state [B, C, Kc-1] / ssm_state [B, Hv, Dk, Dv] float32
        or None for a fresh sequence. Returns (out [B, T, E], conv, ssm, steps): the new states, and with
        all_states steps = the states after 1..T-1 tokens, ([B, T-1, C, Kc-1], [B, T-1, Hv, Dk, Dv])
        (else None). Calls of up to RECURRENT_MAX_T tokens use the per-token form, longer ones the
        chunked form."""
        B, T, _ = a.shape
        hk, hv, dk, dv = self.n_k_heads, self.n_v_heads, self.d_k, self.d_v
        u, xpad = causal_conv1d(self.attn_qkv(a), self.ssm_conv1d.weight, conv_state)
        q = u[..., :hk * dk].reshape(B, T, hk, dk)
        k = u[..., hk * dk:2 * hk * dk].reshape(B, T, hk, dk)
        v = u[..., 2 * hk * dk:].reshape(B, T, hv, dv)
        q = l2norm(q) * dk ** -0.5
        k = l2norm(k)
        if hv != hk:   # tiled order: value head j uses key head j mod Hk (spec §4.4.6)
            q, k = q.repeat(1, 1, hv // hk, 1), k.repeat(1, 1, hv // hk, 1)
        beta = torch.sigmoid(self.ssm_beta(a))
        g = self.ssm_a * F.softplus(self.ssm_alpha(a) + self.ssm_dt.bias)
        if ssm_state is None:
            ssm_state = a.new_zeros(B, hv, dk, dv, dtype=torch.float32)
        rule = delta_rule_recurrent if T <= RECURRENT_MAX_T else delta_rule_chunked
        kw = {} if T <= RECURRENT_MAX_T else {"chunk": chunk}
        o, s, *ssm_steps = rule(q, k, v, g, beta, ssm_state, all_states=all_states, **kw)
        z = self.attn_gate(a).reshape(B, T, hv, dv)
        y = rms_norm(o, self.ssm_norm.weight, self.eps) * F.silu(z)
        out = self.ssm_out(y.reshape(B, T, hv * dv))
        steps = (conv_states_per_step(xpad, self.kc)[:, 1:T], ssm_steps[0]) if all_states else None
        return out, xpad[:, :, T:], s, steps
