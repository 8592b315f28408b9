"""Token sampling: greedy, temperature, top-k, top-p, seeded (one torch.Generator per sampler).

`probs` exposes the final distribution so speculative verification can use the same filtering.
Order of the filters (as transformers): temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # <= 0: greedy (argmax)
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1.0: off
    seed: int | None = None      # None: a random seed

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature != self.temperature:
            raise InputError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p: must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Draws tokens from logits rows [B, V] under `SamplingParams`; reproducible for a given seed."""

    def __init__(self, params: SamplingParams = SamplingParams(), device: torch.device | str = "cpu"):
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> probabilities [B, V] float32 after temperature, top-k and top-p
        (greedy: one-hot on the argmax)."""
        p = self.params
        logits = logits.float()
        if p.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # drop a token when the tokens before it already reach top_p (the first is always kept)
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] (long)."""
        if self.params.greedy:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator)[:, 0]
