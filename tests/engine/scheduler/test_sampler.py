"""The request sampler: verification rows make exactly the plain steps' choices (penalties included)."""

from __future__ import annotations

import copy
import random

import torch

from engine.scheduler.sampler import RequestSampler
from engine.scheduler.types import GenerationRequest
from engine.spec.rejection import accepted_prefix

V = 32


def _plain_run(sampler: RequestSampler, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """What plain decoding emits: row i sampled after the previous choices were committed."""
    s = copy.deepcopy(sampler)
    out = []
    for i in range(logits.shape[0]):
        y = s.sample_rows(logits[i:i + 1])[0]
        out.append(y)
        s.accept([y])
        if i == len(drafts) or y != drafts[i]:
            break
    return out


def test_greedy_verify_equals_plain_with_penalties_and_bias():
    seed = 1234
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for case in range(300):
        req = GenerationRequest(prompt=tuple(rng.randrange(V) for _ in range(rng.randrange(1, 80))), max_tokens=8,
                                temperature=0.0, repeat_penalty=rng.choice([1.0, 1.3, 0.7]),
                                presence_penalty=rng.choice([0.0, 0.8, -0.5]),
                                frequency_penalty=rng.choice([0.0, 0.4]),
                                logit_bias=((rng.randrange(V), rng.uniform(-5, 5)),) if rng.random() < 0.3 else ())
        sampler = RequestSampler(req, V)
        k = rng.randrange(1, 5)
        logits = torch.randn(k + 1, V, generator=gen) * 3
        plain = _plain_run(sampler, logits, [-1] * k)          # the tokens plain decoding would produce
        drafts = []
        for i in range(k):   # drafts agree with plain decoding up to a random point, then differ
            drafts.append(plain[i] if i < len(plain) and rng.random() < 0.7 else (plain[0] + 1 + i) % V)
        want = _plain_run(sampler, logits, drafts)
        got = sampler.verify(logits, drafts, accepted_prefix)
        assert got == want, f"seed={seed} case={case}"


def test_penalties_change_the_choice_as_llama_cpp():
    req = GenerationRequest(prompt=(3,), max_tokens=4, temperature=0.0, repeat_penalty=2.0)
    s = RequestSampler(req, V)
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 5] = 4.0, 2.5
    assert s.sample_rows(logits) == [5]            # 4.0 / 2 = 2.0 < 2.5: the repeated token loses
    s2 = RequestSampler(GenerationRequest(prompt=(7,), max_tokens=4, temperature=0.0, presence_penalty=2.0), V)
    logits[0, 7] = 5.0
    assert s2.sample_rows(logits) == [3]           # 5.0 - 2.0 = 3.0 < 4.0
