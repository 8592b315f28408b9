"""Sampling: greedy, top-k / top-p filtering, seeded reproducibility, and the empirical distribution."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InputError
from engine.sampling import Sampler, SamplingParams


def _logits(seed=0, B=3, V=50):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    lg = _logits()
    assert torch.equal(Sampler(SamplingParams()).sample(lg), lg.argmax(-1))


def test_top_k_and_top_p_keep_the_right_tokens():
    lg = _logits(1)
    p = Sampler(SamplingParams(temperature=1.0, top_k=5)).probs(lg)
    assert ((p > 0).sum(-1) == 5).all()
    assert torch.equal((p > 0), lg >= lg.topk(5).values[:, -1:])
    full = lg.softmax(-1)
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.5)).probs(lg)
    for row in range(lg.shape[0]):
        kept = full[row][p[row] > 0]
        assert kept.sum() >= 0.5 and kept.sum() - kept.min() < 0.5   # smallest set reaching 0.5
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, top_p=1e-6)).sample(lg), lg.argmax(-1))


def test_seed_reproduces_and_distribution_matches():
    lg = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    a = [int(Sampler(SamplingParams(1.0, seed=s)).sample(lg)) for s in range(20)]
    b = [int(Sampler(SamplingParams(1.0, seed=s)).sample(lg)) for s in range(20)]
    assert a == b
    s = Sampler(SamplingParams(temperature=0.7, seed=123))
    n = 5000
    counts = torch.bincount(torch.stack([s.sample(lg)[0] for _ in range(n)]), minlength=4).float() / n
    expected = (lg[0] / 0.7).softmax(-1)
    assert (counts - expected).abs().max() < 0.03, "seed 123"


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_parameters_are_input_errors(kw):
    with pytest.raises(InputError):
        SamplingParams(**kw)
