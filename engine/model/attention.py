"""Gated full attention of Qwen3.5 (spec/qwen35-gguf.md §4.3): interleaved query/gate in `attn_q`,
per-head q/k RMSNorm, partial NeoX RoPE, GQA, causal softmax, sigmoid output gate.

The KV cache is passed in (engine/model/cache.py); the module holds weights only and never modifies
its inputs (the full-sequence training path runs under autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fused
from engine.model.layers import Linear, RMSNorm, apply_rope, in_row_products_graph, matmul_weight


class KVView:
    """Where one attention block reads and writes its cache for one forward call.

    k, v: the block's buffers [n_slots, n_ctx, Hkv, D]; slot_idx [B] long; positions [B, T] long
    (absolute position of every new token). Keys at cache rows <= a query's position are visible.

    local: a draft chain's scratch rows (two lists of [B, 1, Hkv, D]). When given, a one-row step does
    not write its key and value into the cache: it appends them to `local` and attends to the cache's
    first n_keys rows plus every local row. The chain's steps 2..k are dropped after the round anyway,
    and inside one compiled graph k successive writes into the same buffer were not done in place:
    the chain rewrote the whole buffer (n_ctx rows) once per round.

    stored: the rows' keys and values are in the cache already (`GatedAttention.write_kv` wrote them with
    rows before them): the block only attends. A second write into the buffer of one compiled graph is a
    copy of the whole buffer (see `Qwen35Model._mtp`'s `queued`)."""

    __slots__ = ("k", "v", "slot_idx", "positions", "n_keys", "single", "local", "stored")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slot_idx: torch.Tensor, positions: torch.Tensor,
                 n_keys: int, single: tuple[int, int] | None = None,
                 local: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None, stored: bool = False):
        self.k, self.v, self.slot_idx, self.positions, self.n_keys = k, v, slot_idx, positions, n_keys
        self.single = single    # (slot, first position) when B == 1: plain slices instead of gathers
        self.local = local
        self.stored = stored


class GatedAttention(nn.Module):
    """The attention mixer of one block. Parameter names are the GGUF tensor names (spec §3.4)."""

    # a draft copy's attn_q, attn_k and attn_v rows as one weight (Qwen35Model.set_draft_weights('int8_dots')),
    # for a draft chain's steps after the first, whose keys and values are scratch rows (`KVView.local`):
    # one operator call instead of three; None in the model itself and where rows enter the cache
    draft_qkv = None

    def __init__(self, cfg, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.n_head, self.n_head_kv, self.head_dim = H, Hkv, D
        self.scale = cfg.attention_scale if cfg.attention_scale else D ** -0.5
        self.attn_q = Linear(E, 2 * H * D, dtype, device)
        self.attn_k = Linear(E, Hkv * D, dtype, device)
        self.attn_v = Linear(E, Hkv * D, dtype, device)
        self.attn_output = Linear(H * D, E, dtype, device)
        self.attn_q_norm = RMSNorm(D, cfg.rms_eps, device)
        self.attn_k_norm = RMSNorm(D, cfg.rms_eps, device)

    def forward(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None) -> torch.Tensor:
        """a [B, T, E]; cos/sin [B, T, R/2] for the tokens' positions; kv None = a fresh sequence at
        positions 0..T-1 with no cache (the training path). Returns [B, T, E] float32."""
        B, T, _ = a.shape
        H, Hkv, D = self.n_head, self.n_head_kv, self.head_dim
        stored = kv is not None and kv.stored
        if self.draft_qkv is not None and kv is not None and kv.local is not None:
            qg, k, v = matmul_weight(a, self.draft_qkv).split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
            k = apply_rope(self.attn_k_norm(k.reshape(B, T, Hkv, D)), cos, sin)
            v = v.reshape(B, T, Hkv, D)
        else:
            qg = self.attn_q(a)
            k, v = (None, None) if stored else self._key_value(a, cos, sin)
        qg = qg.reshape(B, T, H, 2 * D)                  # per head: D query dims, then D gate dims
        q, gate = qg[..., :D], qg[..., D:].reshape(B, T, H * D)
        q = apply_rope(self.attn_q_norm(q), cos, sin)
        cdt = self.attn_q.weight.dtype
        if kv is None:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2).to(cdt), k.transpose(1, 2).to(cdt), v.transpose(1, 2).to(cdt),
                is_causal=True, scale=self.scale, enable_gqa=Hkv != H)
        elif kv.local is not None:
            o = self._attend_local(q.to(cdt), k, v, kv)
        else:
            if not stored:
                self._store(k, v, kv)
            if kv.single is not None:                          # one row: views, no gather
                s = kv.single[0]
                keys, vals = kv.k[s:s + 1, :kv.n_keys], kv.v[s:s + 1, :kv.n_keys]
            else:
                keys = kv.k[kv.slot_idx, :kv.n_keys]           # [B, L, Hkv, D]
                vals = kv.v[kv.slot_idx, :kv.n_keys]
            if kv.single is not None and T == 1:
                mask = None                                    # one query sees every cached key
            else:
                mask = (torch.arange(kv.n_keys, device=a.device)[None, None, :]
                        <= kv.positions[:, :, None])[:, None]
            if in_row_products_graph():
                o = self._attend(q, keys, vals, mask)
            else:
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2).to(cdt), keys.transpose(1, 2).to(cdt), vals.transpose(1, 2).to(cdt),
                    attn_mask=mask, scale=self.scale, enable_gqa=Hkv != H)
        o = o.transpose(1, 2).reshape(B, T, H * D).float()
        return self.attn_output(o * torch.sigmoid(gate))

    def write_kv(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView) -> None:
        """Only the cache rows of a [B, T, E]: the keys and values `forward` would write at kv.positions,
        the same operations on the same inputs, without the queries, the attention or the output
        projection (an MTP cache commit needs nothing else: spec §5.3, the seed's no-logits update)."""
        self._store(*self._key_value(a, cos, sin), kv)

    def _key_value(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = a.shape
        Hkv, D = self.n_head_kv, self.head_dim
        k = apply_rope(self.attn_k_norm(self.attn_k(a).reshape(B, T, Hkv, D)), cos, sin)
        return k, self.attn_v(a).reshape(B, T, Hkv, D)

    @staticmethod
    def _store(k: torch.Tensor, v: torch.Tensor, kv: KVView) -> None:
        """Write k, v [B, T, Hkv, D] (k after norm + RoPE, as the cache stores it) at kv.positions."""
        if kv.single is not None:                              # one row: views, no gather
            # slices, not an index: an int index (the slot) made dynamo specialise the graph on it, one
            # graph per slot, each traced in the decoding thread when its slot first came
            s, p0 = kv.single
            T = k.shape[1]
            kv.k[s:s + 1, p0:p0 + T] = k
            kv.v[s:s + 1, p0:p0 + T] = v
        else:
            rows = kv.slot_idx[:, None]
            kv.k[rows, kv.positions] = k.to(kv.k.dtype)
            kv.v[rows, kv.positions] = v.to(kv.v.dtype)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None
                ) -> torch.Tensor:
        """`scaled_dot_product_attention` of q [B, T, H, D] over keys, vals [B, L, Hkv, D] (GQA; mask
        [B, 1, T, L] True where a key is visible, or None) as reductions a compiled CPU step fuses into its
        own loops: the library's flash-attention kernel, called from the graph, took 35 us for one query row
        over 100 keys on the demo model where these loops take 10 (65 against 120 at 1,500 keys).
        Returns [B, H, T, D] (as that does)."""
        B, T, H, D = q.shape
        s = _scores(q, keys, self.scale)                                            # [B, Hkv, g, T, L]
        if mask is not None:
            s = s.masked_fill(~mask[:, :, None], float("-inf"))
        e = _exp_scores(s)
        return (_weighted(e, vals) / e.sum(-1, keepdim=True)).reshape(B, H, T, D)

    def _attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVView) -> torch.Tensor:
        """One query row per sequence (q [B, 1, H, D]) over the cache's first n_keys rows and the chain's
        local rows, this step's (k, v [B, 1, Hkv, D]) appended to them; softmax over both parts at once,
        GQA as in `scaled_dot_product_attention(enable_gqa=True)`. Returns [B, H, 1, D] (as that does)."""
        B, T, H, D = q.shape
        if T != 1:
            raise ValueError(f"local (scratch) attention takes one row per sequence, got {T}")
        Hkv = self.n_head_kv
        g = H // Hkv
        kv.local[0].append(k.to(kv.k.dtype))
        kv.local[1].append(v.to(kv.v.dtype))
        kl, vl = torch.cat(kv.local[0], dim=1), torch.cat(kv.local[1], dim=1)      # [B, J, Hkv, D]
        if kv.single is not None:
            s = kv.single[0]
            kc, vc = kv.k[s:s + 1, :kv.n_keys], kv.v[s:s + 1, :kv.n_keys]          # [1, L, Hkv, D]
            masked = None
        else:
            kc, vc = kv.k[kv.slot_idx, :kv.n_keys], kv.v[kv.slot_idx, :kv.n_keys]
            # a slot's cached rows end where its local rows begin (its positions are the last J)
            masked = (torch.arange(kv.n_keys, device=q.device)[None, :]
                      > kv.positions[:, -1:] - kl.shape[1])                       # [B, L]
        cdt = q.dtype
        if in_row_products_graph():
            # the products as reductions over D and over the keys, which inductor fuses into the step's
            # loops: four library matrix products were a call each from the compiled graph (~10 us apiece
            # on the demo model, more than their arithmetic)
            sc = _scores(q, kc, self.scale)                                         # [B, Hkv, g, 1, L]
            sl = _scores(q, kl, self.scale)                                         # [B, Hkv, g, 1, J]
            if masked is not None:
                sc = sc.masked_fill(masked[:, None, None, None, :], float("-inf"))
            e = _exp_scores(torch.cat([sc, sl], dim=-1))
            L = kc.shape[1]
            o = (_weighted(e[..., :L], vc) + _weighted(e[..., L:], vl)) / e.sum(-1, keepdim=True)  # [B, Hkv, g, 1, D]
            return o.reshape(B, H, 1, D)
        qh = q.reshape(B, Hkv, g, D)                                                # T == 1
        sc = torch.matmul(qh, kc.to(cdt).permute(0, 2, 3, 1)) * self.scale         # [B, Hkv, g, L]
        sl = torch.matmul(qh, kl.to(cdt).permute(0, 2, 3, 1)) * self.scale         # [B, Hkv, g, J]
        if masked is not None:
            sc = sc.masked_fill(masked[:, None, None, :], float("-inf"))
        p = torch.softmax(torch.cat([sc, sl], dim=-1).float(), dim=-1).to(cdt)
        L = kc.shape[1]
        o = torch.matmul(p[..., :L], vc.to(cdt).transpose(1, 2)) + torch.matmul(p[..., L:], vl.to(cdt).transpose(1, 2))
        return o.reshape(B, H, 1, D)                                                # head h = kv head * g + i


def _scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, H, D], keys [B, L, Hkv, D] -> q·k * scale [B, Hkv, g, T, L] (g = H / Hkv query heads per key
    head, in the order of `scaled_dot_product_attention(enable_gqa=True)`), as one reduction over D per query
    row (a query head at one position): inductor runs the g·T reductions of a key head in one loop over the
    keys, each key loaded once for all of them, with an accumulator apiece."""
    B, T, H, D = q.shape
    Hkv = keys.shape[2]
    g = H // Hkv
    qh = q.float().reshape(B, T, Hkv, g, D)
    kk = keys.float().permute(0, 2, 1, 3)                                                # [B, Hkv, L, D]
    rows = [(qh[:, t, :, i, None, :] * kk).sum(-1) for i in range(g) for t in range(T)]  # g·T of [B, Hkv, L]
    return torch.stack(rows, dim=2).reshape(B, Hkv, g, T, -1) * scale


def _exp_scores(s: torch.Tensor) -> torch.Tensor:
    """exp(s - max s) over the last dim (softmax's numerators), written once: the weighted sum of the values
    then divides by their sum once per row, not every term of it (a compiled graph inlined softmax's
    division into the loop over the keys, one scalar division per key and 8 values)."""
    return fused.realized((s - s.amax(-1, keepdim=True)).exp())


def _weighted(p: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """p [B, Hkv, g, T, L], vals [B, L, Hkv, D] -> sum over L of p·v [B, Hkv, g, T, D], one reduction over the
    keys per query row, so a compiled graph loads each value vector once for all g·T rows and keeps g·T
    independent sums (one sum's chain of dependent adds over every key was the loop's bound)."""
    B, Hkv, g, T, L = p.shape
    vv = vals.float().permute(0, 2, 1, 3)                                                # [B, Hkv, L, D]
    pr = p.reshape(B, Hkv, g * T, L)
    rows = [(pr[:, :, r, :, None] * vv).sum(-2) for r in range(g * T)]                   # g·T of [B, Hkv, D]
    return torch.stack(rows, dim=2).reshape(B, Hkv, g, T, -1)
