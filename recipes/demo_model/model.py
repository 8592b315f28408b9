"""The demo model for training: the engine's own Qwen3.5 modules (engine/model) stacked as in the GGUF,
with the MTP (nextn) block, and the joint loss of issue 6.

Parameters are named so that `gguf_tensors()` maps them 1:1 onto the converter's tensor names
(spec/qwen35-gguf.md §3). Norm weights are trained as the stored value (1 + w_HF), `ssm_a` through
`-exp(A_log)`. Training runs the full-sequence path only (no caches); inference belongs to the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from engine.config import ATTN, GDN, ModelConfig
from engine.model import Qwen35Model, gguf_name, shift_hidden
from engine.model.attention import GatedAttention, KVView
from engine.model.layers import apply_rope, rope_cos_sin


@dataclass(frozen=True)
class DemoDims:
    """The shipped model's shape: fewer, wider blocks (per-step cost is per block on CPU)."""
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    rope_dim: int = 16
    ssm_k_heads: int = 2
    ssm_v_heads: int = 4
    ssm_head_dim: int = 64
    n_vocab: int = 2048
    layer_kinds: tuple[str, ...] = (GDN, GDN, GDN, ATTN)
    context_length: int = 4096
    rope_theta: float = 1e7
    rms_eps: float = 1e-6

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            arch="qwen35", n_embd=self.n_embd, n_block=len(self.layer_kinds) + 1, n_nextn=1,
            layer_kinds=self.layer_kinds, n_head=self.n_head, n_head_kv=self.n_head_kv,
            head_dim=self.head_dim, rope_dim=self.rope_dim, rope_theta=self.rope_theta,
            rope_sections=(3, 3, 2, 0), rms_eps=self.rms_eps, n_ff=self.n_ff, n_vocab=self.n_vocab,
            context_length=self.context_length, ssm_conv_kernel=4, ssm_d_state=self.ssm_head_dim,
            ssm_n_group=self.ssm_k_heads, ssm_dt_rank=self.ssm_v_heads,
            ssm_d_inner=self.ssm_v_heads * self.ssm_head_dim)


class _NegExp(nn.Module):
    """ssm_a = -exp(A_log): keeps the decay rate negative while training (spec §4.8 item 2)."""

    def forward(self, a_log: torch.Tensor) -> torch.Tensor:
        return -torch.exp(a_log)

    def right_inverse(self, ssm_a: torch.Tensor) -> torch.Tensor:
        return torch.log(-ssm_a)


def chained_attention(att: GatedAttention, a: torch.Tensor, cos, sin, prev_kv: list[tuple],
                      prefix_kv: tuple | None = None) -> tuple:
    """Gated attention of a chained MTP pass under teacher forcing (spec/mtp-speculation.md §2, §1.3).

    Pass p (p = len(prev_kv) + 1) row i is draft step p at position P+i (P = prefix length): it sees
    the committed entries (pass 1, prefix included) at positions <= P+i-p+1, the temporary entries of
    the earlier steps of its own chain (pass p-d at position P+i-d, d = 1..p-2) and itself.
    prev_kv[q] = (k, v) of pass q+1 [B, T, Hkv, D]; prefix_kv = pass-1 (k, v) of a shared prefix
    [B, P, Hkv, D] or None. Returns (out [B, T, E], (k, v) of this pass)."""
    B, T, _ = a.shape
    H, Hkv, D = att.n_head, att.n_head_kv, att.head_dim
    qg = att.attn_q(a).reshape(B, T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(B, T, H * D)
    q = apply_rope(att.attn_q_norm(q), cos, sin)
    k = apply_rope(att.attn_k_norm(att.attn_k(a).reshape(B, T, Hkv, D)), cos, sin)
    v = att.attn_v(a).reshape(B, T, Hkv, D)
    passes = prev_kv + [(k, v)]
    p = len(passes)
    P = 0 if prefix_kv is None else prefix_kv[0].shape[1]
    # Keys side by side, [B, Hkv, P + p*T, D]; block 0 = pass 1 over prefix + rows, row i sees
    # j <= P+i-p+1 there; block 1+d = pass p-d, row i sees only its position i-d (d = 0: itself).
    keys, vals = [passes[0][0]], [passes[0][1]]
    if prefix_kv is not None:
        keys, vals = [prefix_kv[0], passes[0][0]], [prefix_kv[1], passes[0][1]]
    idx = torch.arange(T)
    blocks = [torch.arange(P + T)[None, :] <= (P + idx[:, None] - (p - 1))]
    for d in range(p - 1):
        keys.append(passes[p - 1 - d][0])
        vals.append(passes[p - 1 - d][1])
        blocks.append(idx[None, :] == idx[:, None] - d)
    kc = torch.cat(keys, dim=1).transpose(1, 2)
    vc = torch.cat(vals, dim=1).transpose(1, 2)
    mask = torch.cat(blocks, dim=1)                                         # [T, P + p*T]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=mask, scale=att.scale,
                                       enable_gqa=Hkv != H)
    o = o.transpose(1, 2).reshape(B, T, H * D)
    return att.attn_output(o * torch.sigmoid(gate)), (k, v)


class PrefixState:
    """What the rows of a batch continue from when they share a prompt prefix (the tools block):
    per main block the GDN (conv, ssm) state or the attention (k, v) [1, P, Hkv, D], the last post-norm
    hidden row and the MTP block's pass-1 (k, v). Computed once per batch, with autograd."""

    def __init__(self, length: int):
        self.length = length
        self.gdn: dict[int, tuple] = {}
        self.kv: dict[int, tuple] = {}
        self.last_hidden: torch.Tensor | None = None
        self.mtp_kv: tuple | None = None

    def expand(self, t: torch.Tensor, B: int) -> torch.Tensor:
        return t.expand(B, *t.shape[1:])


class DemoModel(nn.Module):
    """The engine's `Qwen35Model` (main blocks + nextn block) plus the training losses."""

    def __init__(self, dims: DemoDims):
        super().__init__()
        self.dims = dims
        self.cfg = dims.model_config()
        self.net = Qwen35Model(self.cfg)

    @classmethod
    def wrap(cls, net: Qwen35Model) -> DemoModel:
        """Around an already built (e.g. GGUF-loaded) engine model, to run the teacher-forced passes."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.net, self.cfg = net, net.cfg
        return self

    # ------------------------------------------------------------------ init
    def init_weights(self, generator: torch.Generator) -> None:
        """transformers-like: normal(0.02) matrices, residual outputs scaled down, norms 1 (= HF's zero
        plus the converter's +1), A ~ U(1, 16) so ssm_a = -A, dt_bias 1, conv like nn.Conv1d's default."""
        n_res = 2 * (self.cfg.n_block)
        for name, p in self.net.named_parameters():
            with torch.no_grad():
                if p.dim() == 1:
                    p.fill_(1.0)
                elif name.endswith("ssm_conv1d.weight"):
                    bound = 1 / math.sqrt(p.shape[1])
                    p.copy_(torch.rand(p.shape, generator=generator) * 2 * bound - bound)
                else:
                    std = 0.02
                    if name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight")):
                        std = 0.02 / math.sqrt(n_res)
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
        for blk in self.net.blk:
            if blk.kind != GDN:
                continue
            with torch.no_grad():
                blk.mixer.ssm_a.copy_(-(1.0 + 15.0 * torch.rand(blk.mixer.ssm_a.shape, generator=generator)))
            parametrize.register_parametrization(blk.mixer, "ssm_a", _NegExp())

    # ------------------------------------------------------------------ forward
    def trunk(self, tokens: torch.Tensor, prefix: PrefixState | None = None, record: PrefixState | None = None
              ) -> torch.Tensor:
        """The main blocks over tokens [B, T] at positions P..P+T-1 continuing `prefix` (or fresh at 0).
        With `record`, the final states go there (to serve as a prefix). Returns post-norm hidden."""
        net, cfg = self.net, self.cfg
        B, T = tokens.shape
        P = 0 if prefix is None else prefix.length
        positions = (P + torch.arange(T))[None].expand(B, T)
        cos, sin = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta)
        h = net.embed(tokens)
        for i in range(cfg.n_layer):
            blk = net.blk[i]
            a = blk.attn_norm(h)
            if blk.kind == ATTN:
                if prefix is None and record is None:
                    h = h + blk.mixer(a, cos, sin, None)
                else:
                    kbuf = a.new_zeros(B, T, cfg.n_head_kv, cfg.head_dim)
                    vbuf = a.new_zeros(B, T, cfg.n_head_kv, cfg.head_dim)
                    if prefix is not None:
                        pk, pv = prefix.kv[i]
                        kbuf = torch.cat([prefix.expand(pk, B), kbuf], dim=1)
                        vbuf = torch.cat([prefix.expand(pv, B), vbuf], dim=1)
                    kv = KVView(kbuf, vbuf, torch.arange(B), positions, P + T)
                    h = h + blk.mixer(a, cos, sin, kv)     # writes this call's k/v into the buffers
                    if record is not None:
                        record.kv[i] = (kv.k, kv.v)
            else:
                conv0 = ssm0 = None
                if prefix is not None:
                    conv0, ssm0 = (prefix.expand(x, B) for x in prefix.gdn[i])
                out, conv, ssm, _ = blk.mixer(a, conv0, ssm0)
                h = h + out
                if record is not None:
                    record.gdn[i] = (conv, ssm)
            h = blk.feed_forward(h)
        return net.output_norm(h)

    def mtp_passes(self, tokens: torch.Tensor, h_final: torch.Tensor, n_pass: int,
                   prefix: PrefixState | None = None, record: PrefixState | None = None) -> list[torch.Tensor]:
        """MTP outputs hm (after shared_head_norm) of draft steps 1..n_pass under teacher forcing.

        Pass 1 row i = (emb(x_i), h_{i-1}) with h_{-1} = 0 or the prefix's last row
        (spec/mtp-speculation.md §1.1). Pass p row i = (emb(x_i), hm of pass p-1 at row i-1): draft
        step p of a round whose s0 sits at i-p+1."""
        net, cfg = self.net, self.cfg
        B, T = tokens.shape
        P = 0 if prefix is None else prefix.length
        blk = net.blk[cfg.nextn_blocks[0]]
        pos = (P + torch.arange(T))[None].expand(B, T)
        cos, sin = rope_cos_sin(pos, cfg.rope_dim, cfg.rope_theta)
        emb = net.embed(tokens)
        prev = None if prefix is None else prefix.expand(prefix.last_hidden, B)
        hidden = shift_hidden(h_final, prev)
        prefix_kv = None if prefix is None else tuple(prefix.expand(x, B) for x in prefix.mtp_kv)
        kvs: list[tuple] = []
        outs = []
        for _ in range(n_pass):
            u = blk.nextn.combine(emb, hidden)
            m, kv = chained_attention(blk.mixer, blk.attn_norm(u), cos, sin, kvs, prefix_kv)
            kvs.append(kv)
            hm = blk.nextn.shared_head_norm(blk.feed_forward(u + m))
            outs.append(hm)
            hidden = shift_hidden(hm)
        if record is not None:
            record.mtp_kv = kvs[0]
            record.last_hidden = h_final[:, -1]
        return outs

    def encode_prefix(self, prefix_tokens: torch.Tensor) -> PrefixState:
        """Run a shared prefix [1, P] once (no loss on it): the state the batch rows continue from."""
        st = PrefixState(prefix_tokens.shape[1])
        h = self.trunk(prefix_tokens, record=st)
        self.mtp_passes(prefix_tokens, h, 1, record=st)
        return st

    def losses(self, tokens: torch.Tensor, weights: torch.Tensor, n_pass: int = 3,
               prefix_tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """tokens [B, T]; weights [B, T]: weight of predicting tokens[:, t+1] from row t (0: not
        trained, e.g. padding and prompt text); prefix_tokens [1, P]: a prompt every row starts with
        (not part of `tokens`). Returns the main next-token CE and the CE of MTP passes 1..n_pass (row
        i of every pass predicts x_{i+1}; pass p only from row p-1 on)."""
        prefix = None if prefix_tokens is None else self.encode_prefix(prefix_tokens)
        h = self.trunk(tokens, prefix)
        target = tokens[:, 1:]
        w = weights[:, :-1]

        def ce(hid: torch.Tensor, shift: int) -> torch.Tensor:
            ww = w[:, shift:]
            sel = ww > 0                                  # the head only on trained rows
            logits = self.net.head(hid[:, shift:-1][sel])
            nll = F.cross_entropy(logits, target[:, shift:][sel], reduction="none")
            return (nll * ww[sel]).sum() / ww.sum().clamp_min(1.0)

        out = {"main": ce(h, 0)}
        for p, hm in enumerate(self.mtp_passes(tokens, h, n_pass, prefix), start=1):
            out[f"mtp{p}"] = ce(hm, p - 1)
        return out

    # ------------------------------------------------------------------ GGUF names
    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF tensor name -> float32 tensor (PyTorch order), values as the file stores them."""
        out = {}
        for name, p in self.net.named_parameters():
            if ".parametrizations." in name:
                continue
            out[gguf_name(name)] = p
        for i, blk in enumerate(self.net.blk):
            if blk.kind == GDN:
                out[f"blk.{i}.ssm_a"] = blk.mixer.ssm_a          # = -exp(A_log) through the parametrization
        return {k: v.detach().float().contiguous().clone() for k, v in out.items()}
