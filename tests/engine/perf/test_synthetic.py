"""Random-weight benchmark models: block packing against gguf-py, sane values, GGUF round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.bench import synthetic
from engine.bench.packing import pack
from engine.config import ModelConfig
from engine.errors import InputError
from engine.gguf import open_gguf
from engine.weights import load_weights


def _sample(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 512, generator=g) * 0.05
    x[3, :32] = 0           # an all-zero block
    x[5, 256:] = x[5, 256:].abs()  # a block without negative values (Q4_K min = 0)
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_q8_0_packing_is_bitwise_gguf_py(seed):
    x = _sample(seed)
    assert np.array_equal(pack(x, T.Q8_0).numpy(), quantize(x.numpy(), T.Q8_0)), f"seed {seed}"


@pytest.mark.parametrize("qtype,levels", [(T.Q4_K, 15), (T.Q6_K, 63)])
def test_k_quant_packing_round_trips_through_gguf_py(qtype, levels):
    x = _sample(2)
    packed = pack(x, qtype).numpy()
    y = dequantize(packed, qtype)
    # error within about half a quantization step of each 256-block's range (plus 6-bit scale rounding)
    blocks = x.reshape(-1, 256)
    if qtype == T.Q4_K:  # asymmetric: 16 levels over [min(0, lo), hi]
        step = (blocks.amax(1) - blocks.amin(1).clamp(max=0)) / levels
    else:  # Q6_K is symmetric: 64 levels over [-|max|, |max|]
        step = 2 * blocks.abs().amax(1) / levels
    err = np.abs(y - x.numpy()).reshape(-1, 256).max(1)
    # (Q6_K: a small sub-block scale rounded to int8 can clip its largest weight, as in ggml;
    # any layout error would show as errors of the order of the whole range)
    bound = 0.75 if qtype == T.Q4_K else 1.0
    assert (err <= bound * step.numpy() + 1e-6).all(), float((err / step.numpy()).max())
    # and through the engine's own dequantizer
    w = load_weights(_OneTensor(qtype, packed, x.shape))["w"]
    assert np.allclose(w.dense(torch.float32).numpy(), y, atol=1e-6)


class _OneTensor:
    def __init__(self, qtype, packed, shape):
        from engine.gguf import TensorInfo
        self.tensors = {"w": TensorInfo("w", qtype, tuple(shape), packed.nbytes, 0)}
        self._b = packed.reshape(-1)

    def tensor_bytes(self, name):
        return self._b


@pytest.mark.parametrize("typ", ["F32", "BF16", "Q8_0", "Q4_K_M"])
def test_tiny_synthetic_writes_and_reloads_the_same_model(tmp_path, typ):
    f = synthetic.build_synthetic(f"tiny:{typ}")
    path = tmp_path / f"tiny-{typ}.gguf"
    synthetic.write_gguf(f, path)
    g = open_gguf(path)
    assert ModelConfig.from_gguf(g) == ModelConfig.from_gguf(f)
    assert set(g.tensors) == set(f.tensors)
    for name in f.tensors:
        assert g.tensors[name].ggml_type == f.tensors[name].ggml_type, name
        assert g.tensors[name].shape == f.tensors[name].shape, name
        assert np.array_equal(g.tensor_bytes(name), f.tensor_bytes(name)), name
    assert len(g.metadata["tokenizer.ggml.tokens"]) == f.tensors["token_embd.weight"].shape[0]
    assert abs(path.stat().st_size - synthetic.file_bytes("tiny", typ)) < 1 << 20


def test_synthetic_values_are_sane():
    f = synthetic.build_synthetic("tiny:Q4_K_M")
    w = load_weights(f)
    for name, qw in w.items():
        v = qw.dense(torch.float32)
        assert torch.isfinite(v).all(), name
        if name.endswith("ssm_a"):
            assert (v < 0).all(), name
        elif name.endswith("ssm_dt.bias"):
            assert 0.5 < v.mean() < 1.5, name
        elif "norm" in name:
            assert abs(v.mean() - 1) < 0.05, name
    assert f.tensors["output.weight"].ggml_type == T.Q6_K
    assert f.tensors["blk.0.attn_qkv.weight"].ggml_type == T.Q4_K
    assert f.tensors["blk.0.ssm_conv1d.weight"].ggml_type == T.F32


def test_real_shapes_match_spec_sizes():
    # spec §8 / the issue: the 0.8B shape reads ~801 MB per Q8_0 decode step (MTP block not read)
    s = synthetic.SHAPES["qwen35-0.8b"]
    assert (s.n_embd, s.n_main, s.n_mtp, s.tied, s.n_vocab) == (1024, 24, 1, True, 248320)
    assert 0.80e9 < synthetic.file_bytes("qwen35-0.8b", "Q8_0") < 0.84e9
    assert synthetic.SHAPES["qwen36-27b"].n_ff == 17408
    assert synthetic.SHAPES["qwen35moe-35b-a3b"].n_expert == 256


def test_too_big_shape_is_refused_with_the_bytes_it_needs(monkeypatch):
    monkeypatch.setattr(synthetic, "available_memory", lambda: 8 << 30)
    need = synthetic.file_bytes("qwen36-27b", "Q4_K_M")
    with pytest.raises(InputError) as exc:
        synthetic.build_synthetic("qwen36-27b:Q4_K_M")
    assert f"{need:,} bytes" in str(exc.value)
    with pytest.raises(InputError, match="unknown shape"):
        synthetic.parse_spec("qwen99:Q8_0")
