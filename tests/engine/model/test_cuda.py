"""CUDA: bf16 weights, bf16 KV, float32 recurrent state; logits near the float32 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import ModelCache, load_model, shift_hidden
from tests.conftest import fixture_path
from tests.engine.model.conftest import F32_MODELS, PROMPT_LENGTHS, get_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("which", sorted(F32_MODELS))
def test_cuda_bf16_matches_references(which):
    model_rel, ref_rel, _ = F32_MODELS[which]
    ref = get_ref(ref_rel)
    model = load_model(fixture_path(model_rel), device="cuda", dtype=torch.bfloat16)
    agree = total = 0
    for n in PROMPT_LENGTHS:
        tokens = torch.tensor(ref[f"prompt_{n}"], dtype=torch.long, device="cuda")[None]
        cache = ModelCache(model.cfg, 2, n + 8, device="cuda", kv_dtype=torch.bfloat16)
        out = model(tokens, cache, [1])
        mtp = model.mtp_forward(tokens, shift_hidden(out.hidden), cache, [1])
        lg = out.logits[0].float().cpu().numpy()
        assert np.abs(lg - ref[f"logits_{n}"]).max() < 0.5
        agree += int((lg.argmax(-1) == ref[f"logits_{n}"].argmax(-1)).sum())
        total += n
        assert mtp.logits.shape == (1, n, model.cfg.n_vocab)
        step = model(tokens[:, :1], cache, [1])         # one decode step after the prompt
        assert cache.lengths[1] == n + 1 and torch.isfinite(step.logits).all()
    assert agree / total >= 0.97
