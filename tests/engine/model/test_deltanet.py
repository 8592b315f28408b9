"""The delta rule's chunked form equals the token-by-token recurrence (spec §4.4.5), per-step states
included, and the full-sequence path is differentiable."""

from __future__ import annotations

import pytest
import torch

from engine.model.deltanet import (
    causal_conv1d,
    conv_states_per_step,
    delta_rule_chunked,
    delta_rule_recurrent,
)


def _inputs(seed: int, B=2, T=300, H=4, dk=16, dv=8, grad=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1) * dk ** -0.5
    v = torch.randn(B, T, H, dv, generator=g)
    gate = -torch.rand(B, T, H, generator=g) * 2.0          # log decay <= 0
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, dk, dv, generator=g) * 0.3
    xs = [q, k, v, gate, beta, s0]
    if grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


@pytest.mark.parametrize("chunk", [1, 7, 64, 512])
def test_chunked_equals_recurrent(chunk):
    seed = 1234 + chunk
    q, k, v, g, b, s0 = _inputs(seed)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, g, b, s0)
    o, s = delta_rule_chunked(q, k, v, g, b, s0, chunk=chunk)
    assert (o - o_ref).abs().max() <= 1e-4, f"seed {seed}"
    assert (s - s_ref).abs().max() <= 1e-4, f"seed {seed}"


@pytest.mark.parametrize("T", [1, 2, 5])
def test_per_step_states_match_recurrence(T):
    """The verification mode: state after every token, vectorised, within 1e-5 relative of the
    per-token update (CLARIFICATIONS Issue 5)."""
    q, k, v, g, b, s0 = _inputs(7 + T, T=T)
    o_ref, s_ref, st_ref = delta_rule_recurrent(q, k, v, g, b, s0, all_states=True)
    o, s, st = delta_rule_chunked(q, k, v, g, b, s0, chunk=64, all_states=True)
    assert st.shape == st_ref.shape == (2, T - 1, 4, 16, 8)     # after tokens 1..T-1
    for j in range(1, T):       # the state after j tokens is the final state of a call over those j
        _, s_j = delta_rule_recurrent(q[:, :j], k[:, :j], v[:, :j], g[:, :j], b[:, :j], s0)
        assert torch.equal(st_ref[:, j - 1], s_j)
    scale = st_ref.abs().amax(dim=(-1, -2), keepdim=True)
    assert T == 1 or ((st - st_ref).abs() / scale).max() <= 1e-5
    assert (o - o_ref).abs().max() <= 1e-5
    _, s_final = delta_rule_chunked(q, k, v, g, b, s0)
    assert (s - s_final).abs().max() <= 1e-6
    assert torch.equal(s_ref, delta_rule_recurrent(q, k, v, g, b, s0)[1])


def test_conv_state_per_step():
    g = torch.Generator().manual_seed(3)
    x, w, st = torch.randn(2, 5, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(2, 6, 3, generator=g)
    u, xpad = causal_conv1d(x, w, st)
    steps = conv_states_per_step(xpad, 4)
    assert torch.equal(steps[:, 0], st)
    for j in range(1, 6):     # running the first j tokens alone leaves the same state
        _, xp = causal_conv1d(x[:, :j], w, st)
        assert torch.equal(steps[:, j], xp[:, :, j:])
    u1, _ = causal_conv1d(x[:, 3:], w, steps[:, 3])
    assert torch.allclose(u1, u[:, 3:], atol=1e-6)


def test_conv_output_is_time_major():
    """u comes out [B, T, C] with the channels contiguous, so the delta rule's q, k and v are views it
    reads as vectors. A channel-major u (stride T between channels) made every compiled verification
    gather v one element at a time in each per-token state update (docs/benchmarks.md, thirteenth
    session); the conv states it returns keep their [B, C, Kc-1+T] shape."""
    g = torch.Generator().manual_seed(4)
    x, w, st = torch.randn(1, 4, 8, generator=g), torch.randn(8, 4, generator=g), torch.randn(1, 8, 3, generator=g)
    u, xpad = causal_conv1d(x, w, st)
    assert u.shape == (1, 4, 8) and u.is_contiguous()
    assert xpad.shape == (1, 8, 7) and torch.equal(xpad[:, :, :3], st) and torch.equal(xpad[:, :, 3:], x.transpose(1, 2))
    want = torch.stack([(xpad[:, :, t:t + 4] * w).sum(-1) for t in range(4)], dim=1)
    assert torch.allclose(u, torch.nn.functional.silu(want), atol=1e-6)


def test_chunked_form_is_differentiable():
    with torch.inference_mode(False), torch.enable_grad():
        q, k, v, g, b, s0 = _inputs(11, T=40, grad=True)
        o, s = delta_rule_chunked(q, k, v, g, b, s0, chunk=16)
        (o.square().sum() + s.sum()).backward()
        grads = [x.grad.clone() for x in (q, k, v, g, b, s0)]
        for x in (q, k, v, g, b, s0):
            x.grad = None
        o, s = delta_rule_recurrent(q, k, v, g, b, s0)
        (o.square().sum() + s.sum()).backward()
    for got, x in zip(grads, (q, k, v, g, b, s0), strict=True):
        assert torch.isfinite(got).all()
        assert (got - x.grad).abs().max() <= 1e-3 * (1 + x.grad.abs().max())
