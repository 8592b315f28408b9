"""Compact-weight kernels: exact dequantization, products within float32 rounding of the dense
reference, and the packed model giving the reference's greedy tokens on every fixture."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.bench.packing import pack
from engine.kernels import PackedWeight, fused
from engine.kernels import packed as packed_mod
from engine.quants.dequant import dequantize
from tests.conftest import fixture_path

BLOCK_BYTES = {T.Q8_0: 34, T.Q4_K: 144, T.Q6_K: 210, T.BF16: 2}


@pytest.fixture
def kernels(request, monkeypatch):
    """Run with the compiled or the eager path (param), restoring the process-wide decision; pack
    every quantized matrix, however small (the fixtures' matrices are below the size threshold)."""
    monkeypatch.setattr(packed_mod, "PACKED_MIN_WEIGHTS", 0)
    if request.param == "eager":
        monkeypatch.setenv("MTPCHAT_KERNELS", "eager")
    else:
        monkeypatch.delenv("MTPCHAT_KERNELS", raising=False)
    fused.reset()
    yield request.param
    fused.reset()


def _weight(t: T, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    raw = pack(torch.randn(n, k, generator=g) * 0.05, t).reshape(-1)
    ref = dequantize(raw.reshape(-1, BLOCK_BYTES[t]), t).reshape(n, k)
    return PackedWeight.from_gguf("w", t, (n, k), raw), ref


_slow = pytest.mark.slow  # each compiled (type, rows) costs seconds of C++ compilation


@pytest.mark.parametrize("kernels,t", [
    ("eager", T.Q8_0), ("eager", T.Q4_K), ("eager", T.Q6_K), ("eager", T.BF16), ("compiled", T.Q8_0),
    pytest.param("compiled", T.Q4_K, marks=_slow), pytest.param("compiled", T.Q6_K, marks=_slow),
    pytest.param("compiled", T.BF16, marks=_slow)], indirect=["kernels"])
def test_packed_product_matches_dense_reference(kernels, t):
    pw, ref = _weight(t, 320, 512)
    assert torch.equal(pw.dense(), ref)                       # dequantization is exact
    assert torch.equal(pw[torch.tensor([[5, 9]])][0, 1], ref[9])  # embedding rows
    for m in (1, 3, 20):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        y, r = pw.matmul(x), x @ ref.T
        assert ((y - r).abs().max() / r.abs().max()) < 1e-5, (kernels, t.name, m)
    first = pw.first_rows(37)                                 # a draft vocabulary's head rows
    assert first.shape == (37, 512) and torch.equal(first.dense(), ref[:37])
    assert first.nbytes * 320 == pw.nbytes * 37                # views of the same bytes, 37 rows of them
    mode, reason = fused.status()
    assert mode == kernels and reason
    # many rows (prefill): slices dequantized by a compiled pass on the compiled path, eagerly else
    assert ((t, "dequant") in fused._state["compiled"]) == (kernels == "compiled")


@pytest.mark.parametrize("kernels", ["eager", "compiled"], indirect=True)
def test_q8_0_words_layout_is_the_same_weight(kernels):
    """`PackedWeight.as_words` (the draft weights' Q8_0 copies): the same quants, reordered into 32-bit
    words, dequantize exactly to the file's weight; products (one and several rows, eager, compiled on
    their own and traced into a compiled step's graph) agree with the dense reference; other types and
    a weight already in the layout stay as they are."""
    from engine.model import layers

    pw, ref = _weight(T.Q8_0, 320, 512)
    ww = pw.as_words()
    assert set(ww.parts) == {"qw", "d"} and ww.parts["qw"].shape == (320, 16, 8) and ww.nbytes == pw.nbytes
    assert ww.as_words() is ww and _weight(T.Q4_K, 32, 256)[0].as_words().ggml_type == T.Q4_K
    # byte j of word i of a block is element 8j + i
    qs = pw.parts["qs"].reshape(320, 16, 4, 8)
    assert torch.equal(ww.parts["qw"].view(torch.int8).reshape(320, 16, 8, 4), qs.transpose(-1, -2))
    assert torch.equal(ww.dense(), ref)
    assert torch.equal(ww[torch.tensor([[5, 9]])][0, 1], ref[9])
    assert torch.equal(ww.first_rows(37).dense(), ref[:37])
    for m in (1, 3, 20):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        y, r = ww.matmul(x), x @ ref.T
        assert ((y - r).abs().max() / r.abs().max()) < 1e-5, (kernels, m)
    if kernels == "compiled":
        def step(x):
            layers.set_row_products(True)
            try:
                return ww.matmul(x)
            finally:
                layers.set_row_products(False)
        x = torch.randn(1, 5, 512, generator=torch.Generator().manual_seed(7))
        y, r = torch.compile(step, dynamic=False, fullgraph=True)(x), x @ ref.T
        assert ((y - r).abs().max() / r.abs().max()) < 1e-5


@pytest.mark.parametrize("avx2", [True, False])
def test_q8_0_products_by_groups_of_8_match_the_dense_reference(avx2, monkeypatch):
    """Where compiled kernels run AVX2 code a Q8_0 product of the file's blocks sums 4 groups of 8 elements per
    block and scales the sum once (fused._q8_0_groups_product), else it dequantizes each element; the math
    is torch expressions whatever the CPU, so both are checked here, on every row count of a verification."""
    monkeypatch.setattr(fused, "_q8_0_groups", avx2)
    pw, ref = _weight(T.Q8_0, 96, 512, seed=5)
    parts = [pw.parts[n] for n in fused.part_names(T.Q8_0, pw.parts)]
    for m in (1, 2, 5, 8):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        y, r = fused.small_m_product(T.Q8_0, x, *parts), x @ ref.T
        assert ((y - r).abs().max() / r.abs().max()) < 1e-5, (avx2, m)


@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
def test_a_trace_in_another_thread_does_not_turn_compiled_kernels_off(kernels, monkeypatch):
    """torch.fx's tracing flag is process-wide, and a compiled function called while it is set raises
    (the background step compiler traces so while the decode thread runs eager steps): such a call takes
    the eager math once, and the kernels stay compiled."""
    import torch.fx._symbolic_trace as fx_trace

    pw, ref = _weight(T.Q8_0, 320, 512)
    x1, x20 = (torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) for m in (1, 20))
    want1, want20 = pw.matmul(x1), pw.matmul(x20)          # compiled, before any trace
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", True)
    y1, y20 = pw.matmul(x1), pw.matmul(x20)                # during another thread's trace
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", False)
    assert fused.status()[0] == "compiled", fused.status()
    for y, want, x in ((y1, want1, x1), (y20, want20, x20)):
        r = x @ ref.T
        assert ((y - r).abs().max() / r.abs().max()) < 1e-5 and ((want - r).abs().max() / r.abs().max()) < 1e-5


def test_small_matrices_stay_dense_by_default():
    from engine.kernels import worth_packing
    assert not worth_packing(T.Q8_0, (512, 256)) and worth_packing(T.Q8_0, (3584, 1024))
    assert worth_packing(T.Q6_K, (3584, 1024)) and not worth_packing(T.F32, (3584, 1024))


def test_compiled_steps_pack_every_matrix(monkeypatch):
    """With compiled CPU steps a packed product is part of the step's graph (no call of its own), so the
    loader packs matrices of any size there; eager steps keep the size threshold; CUDA never packs."""
    from engine.model.model import load_model
    from engine.model.steps import _cxx, min_packed
    monkeypatch.setenv("MTPCHAT_STEPS", "eager")
    assert min_packed("eager", "cpu") is None and min_packed("auto", "cpu") is None
    assert min_packed("compiled", "cuda") is None
    if _cxx() is not None:
        assert min_packed("compiled", "cpu") == 0
        monkeypatch.delenv("MTPCHAT_STEPS")
        assert min_packed("auto", "cpu") == 0
    path = fixture_path("models/tiny-qwen35-q8_0.gguf")

    def n_packed(model) -> int:
        return sum(isinstance(v, PackedWeight) for m in model.modules() for v in vars(m).values())
    from engine.gguf import open_gguf
    from engine.kernels import PACKED_TYPES
    f = open_gguf(path)
    packable = sum(t.ggml_type in PACKED_TYPES and len(t.shape) >= 2 for t in f.tensors.values())
    default, every = load_model(f, packed=True), load_model(f, packed=True, min_packed=0)
    assert 0 < n_packed(default) < n_packed(every) == packable   # the fixture's matrices are mostly < 512K


def test_q8_0_packed_quants_are_a_view_of_the_file_bytes():
    raw = pack(torch.randn(64, 256), T.Q8_0).reshape(-1)
    pw = PackedWeight.from_gguf("w", T.Q8_0, (64, 256), raw)
    assert pw.nbytes == raw.numel() // 34 * 36                # int8 view + float32 scales: 36 B / 32
    assert pw.parts["qs"].untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


def _greedy(model, prompt, n):
    from engine.model.cache import ModelCache
    cache = ModelCache(model.cfg, 1, 128)
    with torch.inference_mode():
        out = model.forward(torch.tensor([prompt]), cache, logits="all")
        logits, tok = [out.logits[0]], int(out.logits[0, -1].argmax())
        toks = [tok]
        for _ in range(n - 1):
            o = model.forward(torch.tensor([[tok]]), cache, logits="last")
            logits.append(o.logits[0])
            tok = int(o.logits[0, -1].argmax())
            toks.append(tok)
    return toks, torch.cat(logits)


FIXTURES = ["tiny-qwen35-q8_0.gguf", "tiny-qwen35-q4_k_m.gguf", "tiny-qwen35-f32.gguf",
            "tiny-qwen35-q6_k.gguf", "tiny-qwen35-iq4_xs.gguf", "tiny-qwen35moe-q8_0.gguf"]


def _check_fixture(name: str):
    from engine.model.model import load_model
    path = fixture_path(f"models/{name}")
    prompt = [int(t) for t in np.load(fixture_path("ref/tiny-qwen35.npz"))["prompt_7"]]
    ref_toks, ref_logits = _greedy(load_model(path), prompt, 12)
    model = load_model(path, packed=True)
    n_packed = sum(isinstance(v, PackedWeight) for m in model.modules() for v in vars(m).values())
    assert n_packed > 0 or "f32" in name or "iq4" in name, name
    toks, logits = _greedy(model, prompt, 12)
    assert toks == ref_toks, name
    rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 1e-3, (name, float(rel))


@pytest.mark.parametrize("kernels", ["eager"], indirect=True)
@pytest.mark.parametrize("name", FIXTURES)
def test_packed_model_gives_reference_tokens_eager(kernels, name):
    _check_fixture(name)


@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
@pytest.mark.parametrize("name", ["tiny-qwen35-q8_0.gguf"])
def test_packed_model_gives_reference_tokens_compiled(kernels, name):
    _check_fixture(name)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
@pytest.mark.parametrize("name", FIXTURES)
def test_packed_model_gives_reference_tokens_compiled_every_fixture(kernels, name):
    _check_fixture(name)


@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
@pytest.mark.parametrize("name", ["tiny-qwen35-q8_0.gguf", pytest.param("tiny-qwen35moe-q8_0.gguf", marks=_slow)])
def test_whole_step_compiled_over_packed_weights(kernels, name, monkeypatch):
    """compile_steps on a packed model (dense and MoE): a decode step is one graph with the packed products traced in
    (no graph break, no nested compiled kernel), the packed tensors' shapes static (symbolic block
    sizes kept the C++ compiler from vectorizing: 0.8B shape 52 -> 35 ms a step), each product reading
    a realized activation; the same greedy tokens and logits (1e-3) as the eager packed model."""
    from engine.model.model import load_model
    from engine.model.steps import _cxx
    if _cxx() is None:
        pytest.skip("no C++ compiler for torch.compile's CPU backend")
    graphs = []
    real_compile = torch.compile

    def capture(gm, inputs):
        graphs.append((gm, inputs))
        return gm.forward

    def compile_capturing(fn, **kw):
        kw.pop("options", None)
        return real_compile(fn, backend=capture, **kw)

    path = fixture_path(f"models/{name}")
    prompt = [int(t) for t in np.load(fixture_path("ref/tiny-qwen35.npz"))["prompt_7"]]
    ref_toks, ref_logits = _greedy(load_model(path, packed=True), prompt, 8)
    model = load_model(path, packed=True)
    packed = [v for m in model.modules() for v in vars(m).values() if isinstance(v, PackedWeight)]
    assert len(packed) > 10
    monkeypatch.setattr(torch, "compile", compile_capturing)
    model.compile_steps("compiled", background=False)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    toks, logits = _greedy(model, prompt, 8)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert toks == ref_toks
    assert (logits - ref_logits).abs().max() <= 1e-3 * ref_logits.abs().max()
    decode = [(gm, inp) for gm, inp in graphs
              if any("qs" in str(n.target) or "qs" in n.name for n in gm.graph.nodes if n.op == "placeholder")]
    assert decode, "no traced graph reads packed quants"
    gm, inputs = decode[0]
    parts = {id(t) for w in packed for t in w.parts.values()}
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced = [n.meta["example_value"] for n, i in zip(holders, inputs, strict=True) if id(i) in parts]
    assert traced and all(type(d) is int for v in traced for d in v.shape), [v.shape for v in traced]
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("realize" in t for t in targets) >= len(packed) // 2, "products read unrealized activations"
    assert not any("compile" in t or "packed_" in t for t in targets)


def test_q8_0_copy_of_a_float_weight_is_ggml_s_bytes():
    """`PackedWeight.q8_0_of` (the draft weights' copies) writes the bytes gguf-py's reference quantizer
    writes, zero blocks and exact halves included, however many rows it converts at a time."""
    from gguf import quants
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 96, generator=g) * torch.rand(70, 1, generator=g)
    w[3, :32] = 0                                   # d = 0: every quant 0
    w[5, 32:64] = torch.arange(32) - 16.5            # d = 1/... with values at exact halves of a step
    raw = torch.from_numpy(quants.quantize(w.numpy(), T.Q8_0).reshape(-1).copy())
    ref = PackedWeight.from_gguf("w", T.Q8_0, (70, 96), raw)
    for rows in (1, 16, 1 << 14):
        pw = PackedWeight.q8_0_of("w", w, rows_at_once=rows)
        assert torch.equal(pw.parts["qs"], ref.parts["qs"]) and torch.equal(pw.parts["d"], ref.parts["d"])
    x = torch.randn(3, 96, generator=g)
    torch.testing.assert_close(pw.matmul(x), x @ ref.dense().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight.q8_0_of("w", w[:, :40])


def test_int8_row_copy_of_a_float_weight():
    """`PackedWeight.int8_rows_of` (the 'int8' draft weights): one float32 scale per row, d = max|row| / 127,
    quants rounded half away from zero, a zero row all zeros, the same however many rows it converts at a
    time; its product (the draft's small-M form and the sliced one) is x @ (q * d).T."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 96, generator=g) * torch.rand(70, 1, generator=g)
    w[3] = 0                                          # d = 0: every quant 0
    w[5] = torch.arange(96) - 47.5                    # with a 127 the step is 1: quants at exact halves
    w[5, 0] = 127.0
    d = w.abs().amax(-1, keepdim=True) / 127
    y = w * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (y.sign() * (y.abs() + 0.5).floor()).to(torch.int8)
    for rows in (1, 16, 1 << 14):
        pw = PackedWeight.int8_rows_of("w", w, rows_at_once=rows)
        assert pw.ggml_type == T.I8 and tuple(pw.shape) == (70, 96)
        assert torch.equal(pw.parts["q"], q) and torch.equal(pw.parts["d"], d)
    assert (pw.parts["q"][3] == 0).all() and pw.parts["q"].abs().max() == 127
    assert pw.parts["d"][5].item() == 1.0 and pw.parts["q"][5, 1:3].tolist() == [-47, -46]   # -46.5, -45.5
    assert pw.parts["q"][5, 47:50].tolist() == [-1, 1, 2]     # -0.5, 0.5, 1.5: half away from zero
    err = (pw.dense() - w).abs()
    assert (err <= d / 2 * (1 + 1e-6)).all()                # half a step at most
    for m in (1, 3, 40):                                   # the small-M product and the sliced one
        x = torch.randn(m, 96, generator=g)
        torch.testing.assert_close(pw.matmul(x), x @ (q.float() * d).T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pw.first_rows(8).matmul(x), (x @ (q.float() * d).T)[:, :8], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2-D"):
        PackedWeight.int8_rows_of("w", w.view(7, 10, 96))


# -- inductor's partial byte loads (engine/kernels/codegen.py) ----------------------------------------

def test_byte_load_rewrites_only_partial_loads_of_8_or_16_bytes():
    from engine.kernels.codegen import byte_load
    addr = "in_ptr0 + static_cast<int64_t>(x2 + 34L*x1)"
    eight = byte_load(f"at::vec::Vectorized<int8_t>::loadu({addr}, static_cast<int64_t>(8))")
    assert eight == ("at::vec::Vectorized<int8_t>(_mm256_inserti128_si256(_mm256_set1_epi8(1), _mm_or_si128("
                     f"_mm_loadl_epi64(reinterpret_cast<const __m128i*>({addr})), "
                     "_mm_set_epi64x(0x0101010101010101LL, 0)), 0))")
    sixteen = byte_load(f"at::vec::Vectorized<uint8_t>::loadu({addr}, 16)")
    assert sixteen == ("at::vec::Vectorized<uint8_t>(_mm256_inserti128_si256(_mm256_set1_epi8(1), "
                       f"_mm_loadu_si128(reinterpret_cast<const __m128i*>({addr})), 0))")
    for other in (f"at::vec::Vectorized<float>::loadu({addr}, static_cast<int64_t>(8))",       # not bytes
                  f"at::vec::Vectorized<int8_t>::loadu({addr}, static_cast<int64_t>(4))",       # other counts
                  f"at::vec::Vectorized<int8_t>::loadu({addr}, static_cast<int64_t>(ks1 + (-8L)*x))",
                  f"at::vec::Vectorized<int8_t>::loadu({addr}, static_cast<int64_t>(32))",
                  f"at::vec::Vectorized<int32_t>::loadu({addr}, static_cast<int64_t>(8))",
                  f"at::vec::VecMask<float,1>::from({addr})"):
        assert byte_load(other) is None, other


def _product_code(t: T, x: torch.Tensor, pw: PackedWeight) -> tuple[torch.Tensor, str]:
    from torch._inductor.utils import run_and_get_code

    def product(x, *parts):
        return fused.small_m_product(t, x, *parts)
    fn = torch.compile(product, dynamic=False, fullgraph=True)
    y, code = run_and_get_code(fn, x, *(pw.parts[n] for n in fused.part_names(t, pw.parts)))
    return y, "\n".join(code)


@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
def test_compiled_k_quant_products_of_several_rows_keep_each_rows_bits(kernels, t):
    """A K-quant product of 2-8 rows (an MTP verification, a commit) gives every row the bits that row's product
    alone gives, and writes no float copy of the matrix: a Q4_K weight whose scales were decoded inside it was
    written out (inductor realizes an expression of more than 4 inputs that several reductions read), and its rows
    differed from the one-row product's in the last bits."""
    if fused.status()[0] != "compiled":
        pytest.skip("no compiled kernels here")
    pw, ref = _weight(t, 64, 512, seed=5)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    rows = [_product_code(t, x[i:i + 1].contiguous(), pw)[0][0] for i in range(5)]
    for m in (3, 5):
        torch._dynamo.reset()
        y, code = _product_code(t, x[:m].contiguous(), pw)
        for i in range(m):
            assert torch.equal(y[i], rows[i]), (t.name, m, i)
        r = x[:m] @ ref.T
        assert ((y - r).abs().max() / r.abs().max()) < 1e-5, (t.name, m)
        sizes = [math.prod(int(v) for v in re.findall(r"\d+", shape))
                 for shape in re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", code)]
        assert sizes and max(sizes) < 64 * 512 // 4, (t.name, m, sizes)   # scales, sums: not the matrix


@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
def test_compiled_products_load_bytes_directly_on_avx2(kernels):
    """Where inductor generates AVX2 code, a compiled product's quant loads are direct (no ATen partial load of
    8 or 16 bytes left) and its result is the one ATen's loads give: the same kernel both ways, bit for bit."""
    from engine.kernels import codegen
    if fused.status()[0] != "compiled" or not codegen.avx2():
        pytest.skip("inductor does not generate AVX2 code here (AVX-512 loads bytes with masks)")
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    ats = []
    try:
        for t in (T.Q8_0, T.Q4_K, T.Q6_K):
            pw, ref = _weight(t, 64, 512, seed=4)
            codegen.uninstall()
            torch._dynamo.reset()
            y_aten, code_aten = _product_code(t, x, pw)
            assert codegen.install()
            torch._dynamo.reset()
            y, code = _product_code(t, x, pw)
            partial = [ln for ln in code.splitlines() if "int8_t>::loadu(" in ln and codegen.byte_load(
                ln.split("= ", 1)[-1].rstrip(";").strip())]
            assert not partial, (t.name, partial[:2])
            assert "_mm256_inserti128_si256(_mm256_set1_epi8(1)" in code, t.name
            ats.append("int8_t>::loadu(" in code_aten)
            assert torch.equal(y, y_aten), t.name
            r = x @ ref.T
            assert ((y - r).abs().max() / r.abs().max()) < 1e-5, t.name
    finally:
        codegen.install()
        torch._dynamo.reset()
    assert all(ats)        # without the rewrite, each type's kernel had ATen's partial loads


def test_an_option_set_for_every_thread_reaches_a_new_thread():
    """torch keeps an assignment to one of inductor's options per thread: `_set_in_every_thread` reaches a
    thread started later (the compile worker), where a plain assignment does not."""
    import threading

    from torch._inductor import config

    from engine.kernels import codegen

    def seen_by_a_new_thread():
        got = []
        t = threading.Thread(target=lambda: got.append(config.post_grad_custom_pre_pass))
        t.start()
        t.join()
        return got[0]

    marker = object.__new__(type("Marker", (), {"uuid": lambda self: "test-marker"}))
    saved = config.post_grad_custom_pre_pass
    try:
        codegen._set_in_every_thread(config, "post_grad_custom_pre_pass", marker)
        assert config.post_grad_custom_pre_pass is marker
        assert getattr(seen_by_a_new_thread(), "uuid", lambda: None)() == "test-marker"
    finally:
        codegen._set_in_every_thread(config, "post_grad_custom_pre_pass", saved)
    assert seen_by_a_new_thread() is saved


@pytest.mark.parametrize("kernels", ["compiled"], indirect=True)
def test_the_byte_loads_key_holds_in_every_thread_and_the_code_follows_it(kernels):
    """The rewrite's graph-cache key holds in a thread other than the one that installed it (the compile
    worker: without it, a kind the compile child had cached missed there and compiled again on AVX2), and
    a graph compiled where the key is not set keeps ATen's partial loads: code and key never disagree."""
    import threading

    from torch._inductor import config

    from engine.kernels import codegen
    if fused.status()[0] != "compiled" or not codegen.avx2():
        pytest.skip("inductor does not generate AVX2 code here (AVX-512 loads bytes with masks)")
    assert codegen.install()
    got = []
    t = threading.Thread(target=lambda: got.append(codegen._keyed(config)))
    t.start()
    t.join()
    assert got == [True]
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    pw, _ = _weight(T.Q8_0, 32, 256, seed=6)
    try:
        with config.patch(post_grad_custom_post_pass=None):
            torch._dynamo.reset()
            y_plain, code = _product_code(T.Q8_0, x, pw)
        assert "int8_t>::loadu(" in code and "_mm256_inserti128_si256(_mm256_set1_epi8(1)" not in code
        torch._dynamo.reset()
        y, code = _product_code(T.Q8_0, x, pw)
        assert "_mm256_inserti128_si256(_mm256_set1_epi8(1)" in code
        assert torch.equal(y, y_plain)
    finally:
        torch._dynamo.reset()
