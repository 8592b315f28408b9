"""The MTP (nextn) head of Qwen3.5 (spec/qwen35-gguf.md §6): eh_proj over [enorm(embedding) |
hnorm(hidden)], one full-attention block with its own KV cache, shared_head_norm, the shared head.

Weights only; the MTP KV cache lives in `ModelCache.mtp_k/mtp_v` (engine/model/cache.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers import Linear, RMSNorm


class NextN(nn.Module):
    """The `blk.N.nextn.*` tensors. Absent optional pieces (spec §3.7, §6.1) are None:
    no eh_proj -> u = en + hn; no shared_head_norm -> output_norm is used (mainline's choice)."""

    def __init__(self, cfg, names: set[str] | None, prefix: str, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        E, eps = cfg.n_embd, cfg.rms_eps

        def has(t: str) -> bool:
            return names is None or f"{prefix}.{t}.weight" in names

        self.enorm = RMSNorm(E, eps, device)
        self.hnorm = RMSNorm(E, eps, device)
        self.eh_proj = Linear(2 * E, E, dtype, device) if has("eh_proj") else None
        self.shared_head_norm = RMSNorm(E, eps, device) if has("shared_head_norm") else None
        # never written for Qwen3.5; used instead of token_embd / output when present
        self.embed_tokens = Linear(E, cfg.n_vocab, dtype, device) \
            if names is not None and has("embed_tokens") else None
        self.shared_head_head = Linear(E, cfg.n_vocab, dtype, device) \
            if names is not None and has("shared_head_head") else None

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb, hidden [B, T, E] -> the block input u [B, T, E] (embedding half first, spec §6.1)."""
        en, hn = self.enorm(emb), self.hnorm(hidden)
        if self.eh_proj is None:
            return en + hn
        return self.eh_proj(torch.cat([en, hn], dim=-1))


def shift_hidden(hidden: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
    """MTP row pairing (spec §6.3): hidden [B, T, E] of the main model at the same positions as the
    tokens -> [B, T, E] where row i holds main hidden i-1; row 0 gets `prev` [B, E] (the last hidden
    row before this call) or zeros on a fresh sequence."""
    first = torch.zeros_like(hidden[:, :1]) if prev is None else prev[:, None].to(hidden.dtype)
    return torch.cat([first, hidden[:, :-1]], dim=1)
