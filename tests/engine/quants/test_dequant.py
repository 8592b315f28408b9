"""Dequantization equals gguf-py's `gguf.quants.dequantize` bit for bit (max abs diff 0 in float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as reference
from gguf.quants import quantize

from engine.errors import ModelFileError
from engine.gguf import TensorInfo, load_model_file
from engine.quants import SUPPORTED, dequantize
from engine.quants.matmul import tiled_matmul
from engine.weights import QuantWeight, load_weights
from tests.conftest import fixture_path

REQUIRED = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
            T.IQ4_NL, T.IQ4_XS]
# byte offsets of the fp16 scale fields inside one block
FP16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
               T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # gguf-py has a quantizer


def test_the_required_set_is_supported():
    assert set(REQUIRED) == set(SUPPORTED)


def _random_blocks(t: T, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes with finite, realistic fp16 scales (or finite floats for the float types)."""
    rng = np.random.default_rng(seed)
    qt = SUPPORTED[t]
    if t == T.F32:
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8)
    if t in (T.F16, T.BF16):
        x = rng.standard_normal(n_blocks).astype(np.float32) * 10
        if t == T.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, qt.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[t]:
        scale = (rng.standard_normal(n_blocks) * rng.choice([1e-3, 1e-1, 10.0], n_blocks)).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def _assert_bit_equal(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    ref = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)
    ours = np.ascontiguousarray(ours).reshape(-1)
    assert ours.dtype == np.float32 and ours.shape == ref.shape, what
    assert np.isnan(ours).tolist() == np.isnan(ref).tolist(), what
    ok = ~np.isnan(ref)
    assert np.array_equal(ours[ok].view(np.uint32), ref[ok].view(np.uint32)), what
    assert float(np.max(np.abs(ours[ok] - ref[ok]), initial=0.0)) == 0.0, what


@pytest.mark.parametrize("t", REQUIRED, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_blocks_equal_gguf_py(t, seed):
    raw = _random_blocks(t, 384, seed)
    ref = reference(raw.copy(), t)
    ours = dequantize(torch.from_numpy(raw.copy()), t).numpy()
    _assert_bit_equal(ours, ref, f"{t.name} seed {seed}")


@pytest.mark.parametrize("t", [t for t in REQUIRED if t not in (T.F32, T.F16, T.BF16)], ids=lambda t: t.name)
def test_fully_random_bytes_including_nan_and_inf_scales_equal_gguf_py(t):
    raw = np.random.default_rng(7).integers(0, 256, size=SUPPORTED[t].type_size * 256, dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = reference(raw.copy(), t)
    _assert_bit_equal(dequantize(torch.from_numpy(raw.copy()), t).numpy(), ref, t.name)


@pytest.mark.parametrize("t", QUANTIZABLE, ids=lambda t: t.name)
def test_blocks_from_gguf_py_quantizer_equal_gguf_py(t):
    x = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    packed = np.ascontiguousarray(quantize(x, t)).view(np.uint8).reshape(-1)
    ref = reference(packed.copy().reshape(16, -1), t)
    _assert_bit_equal(dequantize(torch.from_numpy(packed.copy()), t).numpy(), ref, t.name)


QUANT_FIXTURES = ["tiny-qwen35-q8_0", "tiny-qwen35-q6_k", "tiny-qwen35-q4_k_m", "tiny-qwen35-iq4_xs",
                  "tiny-qwen35moe-q8_0"]


@pytest.mark.parametrize("name", QUANT_FIXTURES)
def test_every_tensor_of_the_quantized_fixtures_equals_gguf_py(name):
    path = fixture_path(f"models/{name}.gguf")
    weights = load_model_file(path).load_weights()
    seen = set()
    for t in GGUFReader(path).tensors:
        ref = reference(np.asarray(t.data), t.tensor_type)
        _assert_bit_equal(weights[t.name].dense(torch.float32).numpy(), ref, t.name)
        seen.add(t.tensor_type.name)
    assert seen - {"F32"}, seen


def _weight(t: T, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    qt = SUPPORTED[t]
    raw = _random_blocks(t, rows * cols // qt.block_size, seed) if t not in (T.F32, T.F16, T.BF16) else \
        _random_blocks(t, rows * cols, seed)
    info = TensorInfo("w", t, (rows, cols), raw.size, 0)
    return QuantWeight(info, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.IQ4_XS, T.BF16, T.F32], ids=lambda t: t.name)
def test_tiled_matmul_equals_the_dense_product(t):
    w = _weight(t, 48, 512)
    x = torch.randn(3, 5, 512)
    dense = w.dense()
    want = x @ dense.T
    # tiles of 7 rows: several tiles, a ragged last one
    got = tiled_matmul(x, w.raw, t, (48, 512), tile_elements=7 * 512)
    assert got.shape == (3, 5, 48)
    # float32 sums in another order: differences of a few ulps of the largest term
    atol = 1e-5 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    torch.testing.assert_close(w.matmul(x), want, rtol=1e-5, atol=atol)


def test_rows_and_experts_equal_slices_of_dense():
    w = _weight(T.Q6_K, 10, 256)
    ids = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(w.rows(ids), w.dense()[ids])
    e = QuantWeight(TensorInfo("e", T.Q8_0, (4, 6, 64), 4 * 6 * 2 * 34, 0),
                    torch.from_numpy(_random_blocks(T.Q8_0, 4 * 6 * 2, 5)))
    full = e.dense()
    for i in range(4):
        assert torch.equal(e.expert(i).dense(), full[i])


def test_dense_in_other_dtypes_is_the_float32_result_cast():
    w = _weight(T.Q4_K, 4, 256)
    f32 = w.dense(torch.float32)
    assert torch.equal(w.dense(torch.bfloat16), f32.to(torch.bfloat16))
    assert torch.equal(w.dense(torch.float16), f32.to(torch.float16))


def test_unsupported_type_is_refused_at_load_naming_type_and_tensor(tmp_path):
    from tests.engine.gguf.tiny_gguf import tiny_plan, write

    plan = tiny_plan()
    plan.set_tensor("blk.2.ssm_out.weight", np.zeros((4, 66), np.uint8), T.IQ2_XXS)
    p = write(plan, tmp_path / "iq2.gguf")
    with pytest.raises(ModelFileError, match=r"blk\.2\.ssm_out\.weight: type IQ2_XXS is not supported"):
        load_model_file(p)
    from engine.gguf import open_gguf

    with pytest.raises(ModelFileError, match=r"blk\.2\.ssm_out\.weight: type IQ2_XXS is not supported"):
        load_weights(open_gguf(p))


@pytest.mark.gpu
@pytest.mark.parametrize("t", REQUIRED, ids=lambda t: t.name)
def test_cuda_dequantization_equals_cpu(t):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    raw = torch.from_numpy(_random_blocks(t, 4096, 11))
    cpu = dequantize(raw, t)
    gpu = dequantize(raw.cuda(), t).cpu()
    assert torch.equal(cpu.view(torch.int32), gpu.view(torch.int32)), t.name
