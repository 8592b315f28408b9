"""Logits, hidden states, greedy continuations and MTP rows of the f32-equivalent fixtures against
the transformers and ik_llama.cpp references (fixtures/README.md; CLARIFICATIONS Issue 4, 5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import ModelCache, shift_hidden
from tests.engine.model.conftest import PROMPT_LENGTHS, assert_close, get_ref


def _prompt(ref, n):
    return torch.tensor(ref[f"prompt_{n}"], dtype=torch.long)[None]


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_prefill_logits_and_hidden_match_transformers(f32_model, n):
    model, ref, _ = f32_model
    out = model(_prompt(ref, n))
    logits = out.logits[0].numpy()
    assert_close(logits, ref[f"logits_{n}"], f"logits_{n}")
    assert (logits.argmax(-1) == ref[f"logits_{n}"].argmax(-1)).all()
    assert_close(out.hidden_prenorm[0].numpy(), ref[f"hidden_prenorm_{n}"], f"hidden_prenorm_{n}")
    assert_close(out.hidden[0].numpy(), ref[f"hidden_postnorm_{n}"], f"hidden_postnorm_{n}")


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_mtp_rows_match_references(f32_model, n):
    model, ref, ik_rel = f32_model
    tokens = _prompt(ref, n)
    out = model(tokens, logits="none")
    mtp = model.mtp_forward(tokens, shift_hidden(out.hidden))
    lg = mtp.logits[0].numpy()
    assert (lg.argmax(-1) == ref[f"mtp_argmax_{n}"]).all()
    if n == 33:
        assert_close(lg, ref["mtp_logits_33"], "mtp_logits_33")
    ik = get_ref(ik_rel)[f"mtp_ik_{n}"]
    assert np.abs(lg - ik).max() <= 3e-3, f"mtp_ik_{n}: max |d| {np.abs(lg - ik).max():.3g}"
    differ = np.nonzero(lg.argmax(-1) != ik.argmax(-1))[0].tolist()
    # the one documented near-tie: dense, prompt 200, row 40 (top-1/top-2 gap 4.2e-4 in ik)
    assert differ in ([], [40] if n == 200 else []), f"mtp_ik_{n}: argmax differs at rows {differ}"


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_greedy_continuation_matches(f32_model, n):
    model, ref, _ = f32_model
    tokens = _prompt(ref, n)
    cache = ModelCache(model.cfg, 1, n + 24)
    out = model(tokens, cache, logits="last")
    got = []
    for _ in range(24):
        nxt = int(out.logits[0, -1].argmax())
        got.append(nxt)
        out = model(torch.tensor([[nxt]]), cache, logits="last")
    assert got == ref[f"greedy_{n}"].tolist()


def test_mtp_incremental_equals_batched(f32_model):
    """Prompt rows warmed in one call, then one row at a time: same logits as all rows at once."""
    model, ref, _ = f32_model
    tokens = _prompt(ref, 33)
    hidden = shift_hidden(model(tokens, logits="none").hidden)
    full = model.mtp_forward(tokens, hidden).logits[0]
    cache = ModelCache(model.cfg, 1, 64)
    model.mtp_forward(tokens[:, :20], hidden[:, :20], cache, logits="none")
    rows = [model.mtp_forward(tokens[:, i:i + 1], hidden[:, i:i + 1], cache).logits[0, 0] for i in range(20, 33)]
    assert cache.mtp_lengths[0] == 33
    assert_close(torch.stack(rows).numpy(), full[20:].numpy(), "mtp rows one at a time", atol=1e-5, rtol=1e-5)
