"""Per-request token choice for the slot backend: greedy argmax at temperature 0, otherwise
engine.sampling's sampler (temperature, top-k, top-p) with one seeded generator per request
(reliability-matrix F5), after logit bias and min-p.

Verification makes the same per-row choice (spec/mtp-speculation.md §3.2 greedy match; §3.3
sample-and-compare, which reuses the plain sampler verbatim, rows in order).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.sampling import Sampler, SamplingParams
from engine.scheduler.types import GenerationRequest


class RequestSampler:
    def __init__(self, req: GenerationRequest, n_vocab: int, device: torch.device | str = "cpu"):
        self.greedy = req.temperature <= 0.0
        self.bias: torch.Tensor | None = None
        if req.logit_bias:
            self.bias = torch.zeros(n_vocab, dtype=torch.float32, device=device)
            for tok, b in req.logit_bias:
                self.bias[tok] = b
        self.temperature = req.temperature
        self.min_p = req.min_p
        self._plain = None if self.greedy else Sampler(
            SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed), device)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to adjust: the caller may take the argmax of a whole batch itself."""
        return self.greedy and self.bias is None

    def _adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] -> [n, V]: logit bias, then min-p (keep p >= min_p * p_max at this temperature,
        i.e. logit >= max + T * ln(min_p)), which the plain sampler does not do itself."""
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias
        if not self.greedy and self.min_p > 0.0:
            cut = logits.max(dim=-1, keepdim=True).values + self.temperature * math.log(self.min_p)
            logits = logits.masked_fill(logits < cut, float("-inf"))
        return logits

    def _choose(self, logits: torch.Tensor) -> list[int]:
        if self.greedy:
            return logits.argmax(dim=-1).tolist()
        return self._plain.sample(logits).tolist()

    def sample_rows(self, logits: torch.Tensor) -> list[int]:
        """logits [n, V] -> one token per row (independent plain steps)."""
        return self._choose(self._adjust(logits))

    def verify(self, logits: torch.Tensor, drafts: list[int],
               accepted_prefix: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[int]:
        """Rows [k+1, V] of one verification pass and the k drafts -> the emitted ids [d1..da, b]."""
        logits = self._adjust(logits)
        k = len(drafts)
        if self.greedy:
            target = logits.argmax(dim=-1)
            a = int(accepted_prefix(target, torch.tensor(drafts, dtype=torch.long, device=target.device)))
            return drafts[:a] + [int(target[a])]
        out: list[int] = []
        for i in range(k + 1):   # sample and compare, row after row from the request's generator
            y = self._choose(logits[i:i + 1])[0]
            out.append(y)
            if i == k or y != drafts[i]:
                break
        return out
