"""engine.kernels.int8_dots: int8 draft rows multiplied by the CPU's 8-bit dot products (AVX-512 VNNI).

The operator must return exactly the integers its rule defines (activations rounded to int8 with a scale per
row, sums in int32) times the scales, on every shape a draft meets: tails of K past a multiple of 64, N past a
multiple of 16, several rows, one thread or two."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.errors import InputError
from engine.kernels import PackedWeight, int8_dots


@pytest.fixture(scope="module")
def dots():
    ok, why = int8_dots.status()
    if not ok:
        pytest.skip(f"int8 dot products {why}")
    return int8_dots.int8_dots


@pytest.fixture(params=["avx512", "avx2"])
def form(request, dots):
    """Each form of the operator this CPU runs: AVX-512 VNNI, and AVX-VNNI (256-bit), which CPUs without
    AVX-512 take and AVX-512 CPUs with AVX-VNNI run too."""
    isa = torch.ops.mtpchat.int8_dots_isa
    was = isa("")
    try:
        isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU does not run the {request.param} form")
    yield request.param
    isa(was)


def _case(rng: random.Random, M: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(M, K, generator=g) * rng.choice([1e-3, 1.0, 40.0])
    w = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=g)
    d = torch.rand(N, generator=g) * 0.02
    return x, w, d


def test_products_equal_their_integer_rule_on_every_shape(dots, form):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    shapes = [(1, 2048, 256), (1, 256, 512), (3, 37, 200), (8, 100, 1000), (2, 16, 64), (1, 5, 17), (1, 1, 1),
              (4, 17, 63), (1, 33, 65), (7, 300, 128), (2, 9, 31), (1, 8, 32), (3, 7, 7)]
    shapes += [(rng.randint(1, 8), rng.randint(1, 400), rng.randint(1, 700)) for _ in range(20)]
    for M, N, K in shapes:
        x, w, d = _case(rng, M, N, K)
        x[0, rng.randrange(K)] = 0.0
        if M > 1:
            x[1] = 0.0                       # a zero row: scale 0, every product 0
        got = dots(x, w, d)
        assert got.shape == (M, N) and torch.equal(got, int8_dots.reference(x, w, d)), (form, seed, M, N, K)


def test_the_reference_rounds_halves_away_from_zero_and_approximates_the_float_product():
    # max |x| = 127: the scale is 1, so the integers are x rounded, halves away from zero
    x = torch.tensor([[127.0, 2.5, -2.5, 0.5, -0.5, 1.49, -126.5, 0.0]])
    q, s = int8_dots.quantize_rows(x)
    assert s.item() == 1.0 and q.tolist() == [[127, 3, -3, 1, -1, 1, -127, 0]]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=g)
    w = torch.randint(0, 256, (50, 300), dtype=torch.uint8, generator=g)
    d = torch.rand(50, generator=g)
    wf = (w.double() - 128) * d.double().view(-1, 1)
    exact = x.double() @ wf.T
    # each activation is off by at most half its row's step: |error| <= step / 2 * sum |w| (+ float32 rounding)
    step = x.abs().amax(1, keepdim=True).double() / 127
    bound = step / 2 * wf.abs().sum(1).view(1, -1) + 1e-4 * exact.abs()
    err = (int8_dots.reference(x, w, d).double() - exact).abs()
    assert (err <= bound).all() and err.max() > 0


def test_one_thread_and_two_give_the_same_products(dots, form):
    x, w, d = _case(random.Random(3), 2, 4096, 256)      # 1 MiB of weights: split between threads
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dots(x, w, d)
        torch.set_num_threads(2)
        two = dots(x, w, d)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two) and torch.equal(one, int8_dots.reference(x, w, d))


def test_bad_operands_raise(dots):
    x, w, d = _case(random.Random(4), 1, 8, 64)
    with pytest.raises(RuntimeError, match="w must be a 2-D uint8 tensor"):
        dots(x, w.view(torch.int8), d)
    with pytest.raises(RuntimeError, match="do not agree"):
        dots(x[:, :32], w, d)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
        dots(x.double(), w, d)
    with pytest.raises(RuntimeError, match="expected avx512 or avx2, got sse"):
        torch.ops.mtpchat.int8_dots_isa("sse")


def test_a_packed_int8_weight_in_the_dots_form_multiplies_by_the_operator(dots):
    g = torch.Generator().manual_seed(5)
    wf = torch.randn(40, 96, generator=g)
    rows = PackedWeight.int8_rows_of("w", wf)
    form = rows.as_int8_dots()
    assert set(form.parts) == {"qu", "d"} and form.parts["qu"].dtype == torch.uint8
    assert torch.equal(form.parts["qu"].view(torch.int8), rows.parts["q"] ^ -128)     # q + 128, top bit flipped
    assert torch.equal(form.dense(), rows.dense())                                  # the same weights
    assert form.as_int8_dots() is form and PackedWeight.q8_0_of("w", wf).as_int8_dots().ggml_type.name == "Q8_0"
    for m in (1, 3, 20):                                 # a draft's rows, and more than the small-M products take
        x = torch.randn(m, 96, generator=g)
        assert torch.equal(form.matmul(x), int8_dots.reference(x, form.parts["qu"], form.parts["d"].view(-1)))
    head = form.first_rows(7)                            # a draft vocabulary: the first rows, still this form
    x = torch.randn(1, 96, generator=g)
    assert torch.equal(head.matmul(x), form.matmul(x)[:, :7])


def test_switched_off_it_is_not_used_and_asking_for_it_is_a_clear_error(monkeypatch):
    from engine.model import load_model
    from tests.conftest import fixture_path

    monkeypatch.setenv("MTPCHAT_INT8_DOTS", "off")
    monkeypatch.setattr(int8_dots, "_state", {"ok": None, "reason": ""})
    assert int8_dots.status() == (False, "off (MTPCHAT_INT8_DOTS)")
    model = load_model(fixture_path("models/tiny-qwen35-f32.gguf"), packed=True, min_packed=0)
    with pytest.raises(InputError, match=r"^draft weights: int8_dots: the CPU's 8-bit dot products are off "
                                         r"\(MTPCHAT_INT8_DOTS\)$"):
        model.set_draft_weights("int8_dots")
    assert model.draft_weights == "exact"


def test_a_fresh_build_completes_past_a_lock_a_killed_build_left(dots, tmp_path):
    """A build killed midway leaves torch's lock file in the build folder, on which torch's builder waits
    forever; the next process must build and load anyway (a fresh cache folder, so this builds from scratch)."""
    import hashlib
    import subprocess
    import sys

    import torch as _torch
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    source = hashlib.sha256(int8_dots.SOURCE.read_bytes()).hexdigest()[:12]
    folder = tmp_path / "mtpchat" / "kernels" / f"torch-{_torch.__version__}" / source
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    code = "from engine.kernels import int8_dots; print(int8_dots.status())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("(True, 'AVX-512 VNNI (built in ") or \
        r.stdout.strip().startswith("(True, 'AVX-VNNI (256-bit) (built in "), r.stdout
    assert str(folder) in r.stdout and not (folder / "lock").exists()
