"""F4: speculative sampling emits exactly the plain-sampling distribution (reliability-matrix F4).

A Markov "model" over a tiny vocabulary (p0 for the first token, M[x] for the token after x) is
decoded speculatively with greedy-style drafts (argmax chain, low-probability chain, zero-probability
chain) for k = 1..3, 10^6 samples per case, all samples of a round drawn in one vectorised call.
The joint distribution of the first two emitted tokens is compared with p0[x1]·M[x1, x2] by a
chi-square test (p > 1e-4). A deliberately wrong rule must fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.spec.rejection import (
    accept_residual,
    accepted_prefix,
    draw_uniforms,
    inverse_cdf,
    sample_and_compare,
)

N_SAMPLES = 1_000_000
P_MIN = 1e-4


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _top_k(p, k):
    out = np.zeros_like(p)
    idx = np.argsort(-p, kind="stable")[:k]
    out[idx] = p[idx]
    return out / out.sum()


def _top_p(p, top_p):
    order = np.argsort(-p, kind="stable")
    csum = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(csum, top_p) + 1)]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


def _min_p(p, min_p):
    out = np.where(p >= min_p * p.max(), p, 0.0)
    return out / out.sum()


def _distributions() -> dict[str, np.ndarray]:
    """Twelve target distributions as the plain sampler would produce them (after truncation)."""
    rng = np.random.default_rng(1234)
    d = {}
    d["peaked8"] = np.array([0.93, 0.02, 0.01, 0.01, 0.01, 0.01, 0.005, 0.005])
    d["flat8"] = np.full(8, 1 / 8)
    d["zeros8"] = np.array([0.0, 0.3, 0.0, 0.25, 0.2, 0.0, 0.15, 0.1])
    d["onehot8"] = np.eye(8)[5]
    d["twopoint8"] = np.array([0, 0, 0.5, 0, 0, 0.5, 0, 0.0])
    d["geometric16"] = 0.5 ** np.arange(1, 17) / (0.5 ** np.arange(1, 17)).sum()
    d["temp0.3_16"] = _softmax(rng.normal(size=16) / 0.3)
    d["topk3_16"] = _top_k(_softmax(rng.normal(size=16) * 2), 3)
    d["topp0.8_16"] = _top_p(_softmax(rng.normal(size=16) * 2), 0.8)
    d["minp0.1_32"] = _min_p(_softmax(rng.normal(size=32) * 2), 0.1)
    d["dirichlet32"] = rng.dirichlet(np.full(32, 0.5))
    d["flat_tail32"] = _softmax(np.concatenate([[3.0, 2.5], np.zeros(30)]))
    return d


def _markov(p0: np.ndarray, seed: int) -> np.ndarray:
    """Transition rows M[x]: rotations / truncations of p0 so that every row differs."""
    rng = np.random.default_rng(seed)
    v = len(p0)
    rows = []
    for x in range(v):
        r = np.roll(p0, x + 1) if x % 3 else _top_k(rng.dirichlet(np.full(v, 0.7)), max(2, v // 3))
        rows.append(r / r.sum())
    return np.stack(rows)


def _draft_chain(start_row: np.ndarray, m: np.ndarray, k: int, how: str) -> list[int]:
    def pick(p):
        if how == "argmax":
            return int(np.argmax(p))
        if how == "low":
            pos = np.where(p > 0, p, np.inf)
            return int(np.argmin(pos))
        zero = np.flatnonzero(p == 0)
        return int(zero[0]) if len(zero) else int(np.argmin(p))

    drafts, p = [], start_row
    for _ in range(k):
        d = pick(p)
        drafts.append(d)
        p = m[d]
    return drafts


def _round(row0, m, drafts, method, gen, n, broken=False):
    """One speculative round for n samples from the same state: (a [n], emitted [n, k+1])."""
    k = len(drafts)
    probs = torch.tensor(np.stack([row0] + [m[d] for d in drafts]))
    dt = torch.tensor(drafts, dtype=torch.long)
    if method == "compare":
        a, y = sample_and_compare(probs, dt, draw_uniforms(k + 1, n, gen))
        return a.numpy(), y.T.numpy()
    a, last = accept_residual(probs, dt, draw_uniforms(k, n, gen), draw_uniforms(k + 1, n, gen))
    if broken:  # wrong rule: on rejection sample p itself, draft token included
        last = inverse_cdf(probs, draw_uniforms(k + 1, n, gen)).gather(0, a[None])[0]
    emitted = np.tile(np.array(drafts + [0]), (n, 1))
    emitted[np.arange(n), a.numpy()] = last.numpy()
    return a.numpy(), emitted


def _simulate(p0, m, k, how, method, gen, n=N_SAMPLES, broken=False):
    """First two emitted tokens of n independent speculative generations, vectorised.

    Round 1 drafts k tokens from the prompt state; samples that emitted only one token run a
    second round (one draft, the argmax chain) from the state of that token.
    """
    a, emitted = _round(p0, m, _draft_chain(p0, m, k, how), method, gen, n, broken)
    out = np.empty((n, 2), dtype=np.int64)
    out[:, 0] = emitted[:, 0]
    out[:, 1] = emitted[:, 1]
    need = np.flatnonzero(a == 0)
    x1 = emitted[need, 0]
    for state in np.unique(x1):
        grp = need[x1 == state]
        _, em2 = _round(m[state], m, _draft_chain(m[state], m, 1, "argmax"), method, gen, len(grp), broken)
        out[grp, 1] = em2[:, 0]
    assert (out >= 0).all() and (out < len(p0)).all()
    return out


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value; cells with expected < 5 are pooled; zero-expected cells must be empty."""
    assert observed[expected == 0].sum() == 0, "a zero-probability sequence was emitted"
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


CASES = [(name, how, k) for name in _distributions() for how in ("argmax", "low") for k in (1, 2, 3)]


def _run_f4(method, cases):
    dists = _distributions()
    gen = torch.Generator().manual_seed(20260801)
    results = []
    for name, how, k in cases:
        p0 = dists[name]
        m = _markov(p0, seed=CASES.index((name, how, k)))
        toks = _simulate(p0, m, k, how, method, gen)
        v = len(p0)
        joint = np.bincount(toks[:, 0] * v + toks[:, 1], minlength=v * v).astype(np.float64)
        expected = (p0[:, None] * m).reshape(-1) * len(toks)
        p_joint = _chi2_pvalue(joint, expected)
        p_first = _chi2_pvalue(np.bincount(toks[:, 0], minlength=v).astype(np.float64), p0 * len(toks))
        results.append((name, how, k, p_first, p_joint))
    failed = [r for r in results if min(r[3], r[4]) <= P_MIN]
    min_p = min(min(r[3], r[4]) for r in results)
    print(f"METRIC F4 method={method} cases={len(results)} samples=1e6 min_p={min_p:.3g} failed={len(failed)}")
    assert not failed, failed


def test_f4_sample_and_compare_matches_plain_distribution():
    """The rule the decode loop uses, on all 72 cases (12 distributions x 2 drafts x k = 1..3)."""
    assert len(CASES) == 72
    _run_f4("compare", CASES)


def test_f4_residual_rule_matches_plain_distribution():
    """The explicit accept/residual form, one case per distribution (all 72 in the slow run)."""
    _run_f4("residual", [c for c in CASES if c[1] == "low" and c[2] == 2])


@pytest.mark.slow
def test_f4_residual_rule_all_cases():
    _run_f4("residual", CASES)


def test_f4_detects_a_wrong_rule():
    """The same test rejects a residual that forgets to remove the draft token (test power)."""
    gen = torch.Generator().manual_seed(7)
    p0 = _distributions()["zeros8"]
    m = _markov(p0, seed=3)
    toks = _simulate(p0, m, 2, "argmax", "residual", gen, n=200_000, broken=True)
    joint = np.bincount(toks[:, 0] * 8 + toks[:, 1], minlength=64).astype(np.float64)
    assert _chi2_pvalue(joint, (p0[:, None] * m).reshape(-1) * len(toks)) < 1e-10


def test_inverse_cdf_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([[0.0, 0.4999999, 0.5, 0.999999999], [0.0, 0.3, 0.7, 0.9999999999]], dtype=torch.float64)
    out = inverse_cdf(probs, u)
    assert out.tolist() == [[1, 1, 3, 3], [0, 0, 0, 0]]


def test_accepted_prefix_stops_at_first_mismatch():
    target = torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [1, 6, 7, 8], [5, 6, 7, 9]])
    drafts = torch.tensor([5, 6, 7]).expand(4, 3)
    assert accepted_prefix(target, drafts).tolist() == [3, 1, 0, 3]
    assert accepted_prefix(torch.tensor([[4]]), torch.zeros((1, 0), dtype=torch.long)).tolist() == [0]


def test_seeded_draws_are_reproducible():
    """F5 at the sampler level: the same seed gives the same accepted counts and tokens."""
    probs = torch.tensor(_distributions()["dirichlet32"]).repeat(4, 1)
    drafts = torch.tensor([3, 4, 5])
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(99)
        runs.append([sample_and_compare(probs, drafts, draw_uniforms(4, 1, g)) for _ in range(50)])
    for (a1, y1), (a2, y2) in zip(*runs, strict=True):
        assert torch.equal(a1, a2) and torch.equal(y1, y2)
