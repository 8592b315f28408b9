"""Per-request token choice for the slot backend: greedy argmax at temperature 0, otherwise
engine.sampling's sampler (temperature, top-k, top-p) with one seeded generator per request
(reliability-matrix F5), after logit bias, repetition/presence/frequency penalties and min-p.

Verification makes the same per-row choice (spec/mtp-speculation.md §3.2 greedy match; §3.3
sample-and-compare, which reuses the plain sampler verbatim, rows in order); row i's penalties see the
history including drafts d1..di, as if they had been committed (§3.3).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import torch

from engine.sampling import Sampler, SamplingParams
from engine.scheduler.types import GenerationRequest

PENALTY_LAST_N = 64   # llama.cpp's default penalty window (prompt tokens included)


class RequestSampler:
    def __init__(self, req: GenerationRequest, n_vocab: int, device: torch.device | str = "cpu"):
        self.greedy = req.temperature <= 0.0
        self.n_vocab = n_vocab
        self.device = device
        self.bias: torch.Tensor | None = None
        if req.logit_bias:
            self.bias = torch.zeros(n_vocab, dtype=torch.float32, device=device)
            for tok, b in req.logit_bias:
                self.bias[tok] = b
        self.repeat, self.presence, self.frequency = req.repeat_penalty, req.presence_penalty, req.frequency_penalty
        self.penalize = self.repeat != 1.0 or self.presence != 0.0 or self.frequency != 0.0
        self.window: deque[int] = deque(req.prompt[-PENALTY_LAST_N:], maxlen=PENALTY_LAST_N)
        self.temperature = req.temperature
        self.min_p = req.min_p
        self._plain = None if self.greedy else Sampler(
            SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed), device)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to adjust: the caller may take the argmax of a whole batch itself."""
        return self.greedy and self.bias is None and not self.penalize

    def accept(self, tokens: Sequence[int]) -> None:
        """Tokens committed to the output (the penalty window moves on)."""
        if self.penalize:
            self.window.extend(tokens)

    def _penalties(self, logits: torch.Tensor, extra: Sequence[Sequence[int]]) -> torch.Tensor:
        """llama.cpp's penalties sampler per row: over the last PENALTY_LAST_N tokens of window + extra[i],
        a token seen c times gets logit/repeat (logit > 0) or logit*repeat, then - c*frequency - presence."""
        counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for i, more in enumerate(extra):
            hist = (list(self.window) + list(more))[-PENALTY_LAST_N:]
            if hist:
                counts[i].index_add_(0, torch.tensor(hist, dtype=torch.long, device=logits.device),
                                     torch.ones(len(hist), device=logits.device))
        seen = counts > 0
        if self.repeat != 1.0:
            logits = torch.where(seen, torch.where(logits > 0, logits / self.repeat, logits * self.repeat), logits)
        return logits - counts * self.frequency - seen.float() * self.presence

    def _adjust(self, logits: torch.Tensor, extra: Sequence[Sequence[int]]) -> torch.Tensor:
        """[n, V] -> [n, V]: logit bias, penalties, then min-p (keep p >= min_p * p_max at this temperature,
        i.e. logit >= max + T * ln(min_p)); the plain sampler does none of these itself."""
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.penalize:
            logits = self._penalties(logits, extra)
        if not self.greedy and self.min_p > 0.0:
            cut = logits.max(dim=-1, keepdim=True).values + self.temperature * math.log(self.min_p)
            logits = logits.masked_fill(logits < cut, float("-inf"))
        return logits

    def _choose(self, logits: torch.Tensor) -> list[int]:
        if self.greedy:
            return logits.argmax(dim=-1).tolist()
        return self._plain.sample(logits).tolist()

    def sample_rows(self, logits: torch.Tensor) -> list[int]:
        """logits [n, V] -> one token per row; every row sees the committed history only."""
        return self._choose(self._adjust(logits, [()] * logits.shape[0]))

    def verify(self, logits: torch.Tensor, drafts: list[int],
               accepted_prefix: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[int]:
        """Rows [k+1, V] of one verification pass and the k drafts -> the emitted ids [d1..da, b]."""
        k = len(drafts)
        logits = self._adjust(logits, [drafts[:i] for i in range(k + 1)])
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
