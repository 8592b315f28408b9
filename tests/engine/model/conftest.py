"""Fixture models and references for the forward-pass tests (shared/fixtures, skipped when absent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import load_model
from tests.conftest import fixture_path

PROMPT_LENGTHS = (1, 2, 7, 33, 64, 200)
# f32-equivalent fixtures (the MoE Q8_0 file dequantizes exactly) and their transformers references
F32_MODELS = {
    "dense": ("models/tiny-qwen35-f32.gguf", "ref/tiny-qwen35.npz", "ref/tiny-qwen35-mtp_ik.npz"),
    "moe": ("models/tiny-qwen35moe-q8_0.gguf", "ref/tiny-qwen35moe.npz", "ref/tiny-qwen35moe-mtp_ik.npz"),
}

_models: dict[str, object] = {}


def get_model(rel: str):
    """A float32 CPU model of a fixture file, loaded once per test session."""
    if rel not in _models:
        _models[rel] = load_model(fixture_path(rel))
    return _models[rel]


def get_ref(rel: str) -> dict[str, np.ndarray]:
    with np.load(fixture_path(rel)) as z:
        return {k: z[k] for k in z.files}


def assert_close(got: np.ndarray, ref: np.ndarray, what: str, atol: float = 1e-4, rtol: float = 1e-4):
    """The fixtures' float32 bound, elementwise: |got - ref| <= atol + rtol * |ref|."""
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    bad = np.abs(got - ref) > atol + rtol * np.abs(ref)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {bad.sum()} elements out of tolerance, first at {tuple(i)}: "
                             f"{got[tuple(i)]} vs {ref[tuple(i)]}; max |d| {np.abs(got - ref).max():.3g}")


@pytest.fixture(params=sorted(F32_MODELS))
def f32_model(request):
    model_rel, ref_rel, ik_rel = F32_MODELS[request.param]
    return get_model(model_rel), get_ref(ref_rel), ik_rel


@pytest.fixture(autouse=True)
def _inference_one_thread():
    """Inference mode, one intra-op thread: the tiny fixtures run far faster without OpenMP
    spinning on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(n)
