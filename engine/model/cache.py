"""Per-sequence state of the Qwen3.5 model for N sequences (slots): attention KV (main blocks and the
MTP block, each its own), Gated DeltaNet conv and recurrent state, and per-slot lengths.

Everything is preallocated at construction (spec/qwen35-gguf.md §7); snapshots and rollback for
speculative decoding are methods here, never of the model (STYLE.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass
class GDNSnapshot:
    """The GDN state of one slot: block index -> conv [C, Kc-1] and ssm [Hv, Dk, Dv] (float32 copies)."""

    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]


@dataclass
class GDNSteps:
    """GDN states inside one forward call over B rows of T tokens: block index -> conv [B, T-1, C, Kc-1]
    and ssm [B, T-1, Hv, Dk, Dv]; index j-1 = the state after j of the T tokens, 1 <= j < T. The state
    after all T tokens is in the cache, the one before the call is not kept (a speculative round always
    keeps its first row, the pending token). Returned by `Qwen35Model.forward(..., gdn_steps=True)`."""

    slots: list[int]
    n_tokens: int
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]


class ModelCache:
    """KV and recurrent state for `n_slots` sequences of up to `n_ctx` tokens each.

    Layout (one entry per block index, so every RYS copy has its own state):
      k[b], v[b]         [n_slots, n_ctx, Hkv, D]   kv_dtype   main attention blocks (K after norm+RoPE)
      mtp_k[b], mtp_v[b] [n_slots, n_ctx, Hkv, D]   kv_dtype   nextn blocks, when `mtp`
      conv[b]            [n_slots, C, Kc-1]         float32    GDN blocks: last Kc-1 raw qkv inputs
      ssm[b]             [n_slots, Hv, Dk, Dv]      float32    GDN blocks: delta-rule state
      lengths[s], mtp_lengths[s]: tokens held by slot s in the main model / the MTP block.
    KV rows at or past a slot's length are stale and never read (attention masks by position).
    """

    def __init__(self, cfg: ModelConfig, n_slots: int, n_ctx: int, *, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype = torch.float32, mtp: bool | None = None):
        if n_slots <= 0 or n_ctx <= 0:
            raise ValueError(f"n_slots {n_slots} and n_ctx {n_ctx} must be positive")
        self.cfg, self.n_slots, self.n_ctx = cfg, n_slots, n_ctx
        self.device, self.kv_dtype = torch.device(device), kv_dtype
        self.has_mtp = cfg.has_mtp if mtp is None else (mtp and cfg.has_mtp)
        kv_shape = (n_slots, n_ctx, cfg.n_head_kv, cfg.head_dim)

        def kv() -> torch.Tensor:
            return torch.zeros(kv_shape, dtype=kv_dtype, device=self.device)

        self.k = {b: kv() for b in cfg.attn_layers}
        self.v = {b: kv() for b in cfg.attn_layers}
        mtp_blocks = cfg.nextn_blocks if self.has_mtp else ()
        self.mtp_k = {b: kv() for b in mtp_blocks}
        self.mtp_v = {b: kv() for b in mtp_blocks}
        self.conv = {b: torch.zeros(n_slots, cfg.conv_channels, cfg.ssm_conv_kernel - 1,
                                    dtype=torch.float32, device=self.device) for b in cfg.gdn_layers}
        self.ssm = {b: torch.zeros(n_slots, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_head_v_dim,
                                   dtype=torch.float32, device=self.device) for b in cfg.gdn_layers}
        self.lengths = [0] * n_slots
        self.mtp_lengths = [0] * n_slots
        # slot -> its conv then ssm states as views (rollback's destinations; made on first use)
        self._gdn_views: dict[int, list[torch.Tensor]] = {}

    # -- sizes -----------------------------------------------------------------------------------
    def buffers(self) -> list[torch.Tensor]:
        return [*self.k.values(), *self.v.values(), *self.mtp_k.values(), *self.mtp_v.values(),
                *self.conv.values(), *self.ssm.values()]

    def nbytes(self) -> int:
        """Bytes actually allocated by this cache (all slots)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def nbytes_per_slot(self) -> dict[str, int]:
        """Bytes per sequence: 'kv' (main + MTP attention), 'state' (GDN conv + ssm), 'total'."""
        kv = sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values(),
                                                        *self.mtp_k.values(), *self.mtp_v.values()))
        st = sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.ssm.values()))
        return {"kv": kv // self.n_slots, "state": st // self.n_slots, "total": (kv + st) // self.n_slots}

    # -- whole-slot operations -------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Forget slot `slot`: lengths 0, GDN state zero (as a fresh cache)."""
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].zero_()

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens of the slot's main attention KV. The GDN state cannot be
        truncated: restore it with `restore_gdn` or `rollback`."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate: length {length} not in 0..{self.lengths[slot]}")
        self.lengths[slot] = length

    def truncate_mtp(self, slot: int, length: int) -> None:
        """Keep the first `length` rows of the slot's MTP KV cache."""
        if not 0 <= length <= self.mtp_lengths[slot]:
            raise ValueError(f"truncate_mtp: length {length} not in 0..{self.mtp_lengths[slot]}")
        self.mtp_lengths[slot] = length

    def snapshot_gdn(self, slot: int) -> GDNSnapshot:
        return GDNSnapshot({b: t[slot].clone() for b, t in self.conv.items()},
                           {b: t[slot].clone() for b, t in self.ssm.items()})

    def restore_gdn(self, slot: int, snap: GDNSnapshot) -> None:
        for b, t in self.conv.items():
            t[slot].copy_(snap.conv[b])
        for b, t in self.ssm.items():
            t[slot].copy_(snap.ssm[b])

    def rollback(self, steps: GDNSteps, n_keep: list[int]) -> None:
        """After a forward with `gdn_steps=True` over T tokens per row, keep only the first
        `n_keep[i]` (1..T) of row i's tokens: main KV length and GDN state become those after them
        (keeping all T leaves the cache as the forward left it). Undoing a call's first token too needs
        a snapshot taken before it (`snapshot_gdn` / `restore_gdn`). Call before any other forward on
        those slots."""
        T = steps.n_tokens
        if len(n_keep) != len(steps.slots):
            raise ValueError(f"rollback: {len(n_keep)} counts for {len(steps.slots)} rows")
        for keep in n_keep:
            if not 1 <= keep <= T:
                raise ValueError(f"rollback: n_keep {keep} not in 1..{T} (the state before the call is not "
                                 "kept; restore a snapshot to undo its first token)")
        for i, (slot, keep) in enumerate(zip(steps.slots, n_keep, strict=True)):
            if keep == T:
                continue
            self.lengths[slot] -= T - keep
            dst = self._gdn_views.get(slot)
            if dst is None:
                dst = self._gdn_views[slot] = [t[slot] for t in (*self.conv.values(), *self.ssm.values())]
            # one call for every block's two states (a partly accepted round of the demo model copied them
            # in 8 calls: ~90 us of its ~2.4)
            torch._foreach_copy_(dst, [steps.conv[b][i, keep - 1] for b in self.conv]
                                 + [steps.ssm[b][i, keep - 1] for b in self.ssm])
