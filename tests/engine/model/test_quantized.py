"""Quantized fixtures run through the same float path; their greedy choices agree with the f32 model
(ik_llama.cpp's own figures on these files: Q8_0 306/307, Q4_K_M 280/307, IQ4_XS 283/307)."""

from __future__ import annotations

import pytest
import torch

from engine.model import ModelCache, load_model, shift_hidden
from tests.conftest import fixture_path
from tests.engine.model.conftest import F32_MODELS, PROMPT_LENGTHS, get_model, get_ref

MIN_TOP1 = {"q8_0": 0.95, "q6_k": 0.95, "q4_k_m": 0.85, "iq4_xs": 0.85}


@pytest.mark.parametrize("qtype", sorted(MIN_TOP1))
def test_quantized_top1_agreement_with_f32(qtype):
    f32 = get_model(F32_MODELS["dense"][0])
    model = load_model(fixture_path(f"models/tiny-qwen35-{qtype}.gguf"))
    ref = get_ref(F32_MODELS["dense"][1])
    agree = mtp_agree = total = 0
    for n in PROMPT_LENGTHS:
        tokens = torch.tensor(ref[f"prompt_{n}"], dtype=torch.long)[None]
        a, b = f32(tokens), model(tokens)
        agree += int((a.logits.argmax(-1) == b.logits.argmax(-1)).sum())
        ma = f32.mtp_forward(tokens, shift_hidden(a.hidden)).logits.argmax(-1)
        mb = model.mtp_forward(tokens, shift_hidden(b.hidden)).logits.argmax(-1)
        mtp_agree += int((ma == mb).sum())
        total += n
    assert agree / total >= MIN_TOP1[qtype], f"{qtype}: main top-1 {agree}/{total}"
    assert mtp_agree / total >= MIN_TOP1[qtype], f"{qtype}: MTP top-1 {mtp_agree}/{total}"


def test_bfloat16_weights_on_cpu_agree_with_f32():
    """The CUDA configuration (bf16 weights and KV, float32 state) run on CPU: ik measured its
    BF16 file at the F32 perplexity; we ask for >= 97 % top-1 agreement with the references."""
    ref = get_ref(F32_MODELS["dense"][1])
    model = load_model(fixture_path(F32_MODELS["dense"][0]), dtype=torch.bfloat16)
    agree = total = 0
    for n in PROMPT_LENGTHS:
        tokens = torch.tensor(ref[f"prompt_{n}"], dtype=torch.long)[None]
        cache = ModelCache(model.cfg, 1, n, kv_dtype=torch.bfloat16)
        out = model(tokens, cache)
        assert cache.ssm[0].dtype == torch.float32 and out.logits.dtype == torch.float32
        agree += int((out.logits[0].argmax(-1).numpy() == ref[f"logits_{n}"].argmax(-1)).sum())
        total += n
    assert agree / total >= 0.97, f"bf16 top-1 {agree}/{total}"
