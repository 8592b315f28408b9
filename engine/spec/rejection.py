"""Acceptance of drafts against the verification rows: greedy match and speculative sampling.

spec/mtp-speculation.md §3.2 (greedy: accept while the target argmax equals the draft) and §3.3
(temperature > 0: the emitted tokens have exactly the plain-sampling distribution). Drafts are greedy,
so the draft distribution is one-hot and the standard rule reduces to "accept d with probability p(d),
else sample p with d removed". Everything stays on the device; the caller reads the result once.
"""

from __future__ import annotations

import torch


def accepted_prefix(target: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Number of leading drafts equal to the target tokens.

    target [..., k+1] long (the token each verification row proposes), drafts [..., k] long -> [...] long.
    """
    k = drafts.shape[-1]
    if k == 0:
        return torch.zeros(target.shape[:-1], dtype=torch.long, device=target.device)
    match = (target[..., :k] == drafts).to(torch.long)
    return match.cumprod(dim=-1).sum(dim=-1)


def accepted_count(drafts: list[int], target: list[int], k: int | None = None) -> int:
    """`accepted_prefix` on host lists: leading drafts (of the first k, default all) equal to the targets."""
    k = len(drafts) if k is None else k
    a = 0
    while a < k and drafts[a] == target[a]:
        a += 1
    return a


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample each row of probs at the uniforms u.

    probs [R, V] (non-negative, any positive total), u [R, S] in [0, 1) float64 -> [R, S] long.
    Zero-probability tokens are never returned (right-sided search over the cumulative sum).
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    x = u.to(torch.float64) * cdf[:, -1:]
    # search the V-1 inner boundaries: the result is always a valid token id
    return torch.searchsorted(cdf[:, :-1].contiguous(), x, right=True)


def draw_uniforms(rows: int, samples: int, generator: torch.Generator | None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, samples] float64 uniforms from the request's generator, row after row (spec §3.3 RNG)."""
    return torch.rand((rows, samples), generator=generator, dtype=torch.float64, device=device)


def sample_and_compare(probs: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling by drawing every row with the plain sampler and comparing (spec §3.3).

    probs [k+1, V] (row i = target distribution given d1..di), drafts [k] long, u [k+1, S] uniforms.
    Returns (a [S], y [k+1, S]): the emitted tokens of sample s are y[:a[s]+1, s]
    (accepted drafts, then the first mismatching sample or the bonus).
    """
    y = inverse_cdf(probs, u)
    k = drafts.shape[0]
    match = (y[:k] == drafts.unsqueeze(-1)).to(torch.long)        # [k, S]
    a = match.cumprod(dim=0).sum(dim=0) if k else torch.zeros(y.shape[1], dtype=torch.long, device=y.device)
    return a, y


def accept_residual(probs: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                    u_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling in the form of Leviathan et al. for a one-hot draft distribution.

    Accept d_{i+1} iff u_accept[i] < p_i(d_{i+1}); at the first rejection sample the residual
    p_i with d_{i+1} removed; if all k are accepted sample the bonus from p_k.
    probs [k+1, V], drafts [k], u_accept [k, S], u_sample [k+1, S] -> (a [S], last token [S]).
    """
    k = drafts.shape[0]
    rows = torch.arange(k, device=probs.device)
    p = probs.to(torch.float64)
    p_draft = p[rows, drafts] / p[:k].sum(dim=-1)                 # [k] normalised p_i(d)
    ok = (u_accept < p_draft.unsqueeze(-1)).to(torch.long)        # [k, S]
    a = ok.cumprod(dim=0).sum(dim=0) if k else torch.zeros(u_sample.shape[1], dtype=torch.long)
    residual = p.clone()
    residual[rows, drafts] = 0.0
    y = inverse_cdf(residual, u_sample)                           # [k+1, S]
    last = y.gather(0, a.unsqueeze(0)).squeeze(0)
    return a, last
