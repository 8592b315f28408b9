"""Row A5 of spec/reliability-matrix.md: seeded random mutations of three generated files.

Every mutant is either rejected with ModelFileError or fully valid: it passes every check, its
weights load, and each tensor dequantizes (and 2-D ones multiply) without an exception; the first
`FORWARD_SAMPLE` valid mutants (500 in the slow run) also build the model and run a 4-token
CPU forward (NaN outputs allowed). The per-case time bound is on loading and dequantizing.
"""

from __future__ import annotations

import os
import random
import resource
import time

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.errors import ModelFileError
from engine.gguf import load_model_file
from engine.gguf.precheck import read_header
from tests.engine.gguf.tiny_gguf import TinyDims, tiny_plan, write

SEED = int(os.environ.get("MTPCHAT_FUZZ_SEED", "20240611"))
N_DEFAULT = 3000
FORWARD_SAMPLE = 12
_VALUES_32 = (0, 1, 2**31 - 1, 2**32 - 1)
_VALUES_64 = (0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1)


def _q8_dims() -> TinyDims:
    return TinyDims(n_embd=32, n_ff=32, head_dim=16, ssm_d_state=16, n_ff_exp=32, n_ff_shexp=32)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    files = [write(tiny_plan(), d / "dense.gguf"), write(tiny_plan(moe=True), d / "moe.gguf"),
             write(tiny_plan(matrix_type=T.Q8_0, dims=_q8_dims(), tied=True), d / "q8.gguf")]
    out = []
    for p in files:
        load_model_file(p)
        out.append((p.read_bytes(), [(o, w) for o, w, _ in read_header(p, trace=True).trace]))
    return out


def mutate(rng: random.Random, data: bytes, fields: list[tuple[int, int]], other: bytes) -> tuple[bytes, str]:
    """One mutation, described for the failure message."""
    b = bytearray(data)
    n = len(b)
    op = rng.randrange(8)
    if op == 0:
        i = rng.randrange(n)
        bit = rng.randrange(8)
        b[i] ^= 1 << bit
        return bytes(b), f"flip bit {bit} at {i}"
    if op == 1:
        i = rng.randrange(n)
        v = rng.choice((0x00, 0x7F, 0x80, 0xFF))
        b[i] = v
        return bytes(b), f"byte {i} = {v:#x}"
    if op in (2, 3):  # an integer field of the header, located from the parser's trace (half the cases)
        off, width = rng.choice(fields)
        v = rng.choice((*(_VALUES_64 if width == 8 else _VALUES_32), n, n + 1))
        v &= (1 << (8 * width)) - 1
        b[off:off + width] = v.to_bytes(width, "little")
        return bytes(b), f"field at {off} (u{8 * width}) = {v}"
    if op == 4:
        i = rng.randrange(n)
        k = rng.randrange(1, 64)
        del b[i:i + k]
        return bytes(b), f"delete {k} bytes at {i}"
    if op == 5:
        i = rng.randrange(n)
        k = rng.randrange(1, 64)
        b[i:i] = b[i:i + k]
        return bytes(b), f"duplicate {k} bytes at {i}"
    if op == 6:
        k = rng.randrange(n)
        return bytes(b[:k]), f"truncate to {k}"
    k = rng.randrange(n)
    j = rng.randrange(len(other))
    return bytes(b[:k]) + other[j:], f"splice at {k} with other file from {j}"


def _exercise(m) -> None:
    """A mutant that passed every check must load and dequantize without an exception."""
    w = m.load_weights()
    for q in w.values():
        q.dense()
        if len(q.shape) == 2:
            q.matmul(torch.ones(1, q.shape[1]))


def _settled(dt: float, path) -> float:
    """A slow case is timed twice more and the best run counts: a busy shared CPU is not the loader's time."""
    for _ in range(2 if dt > 0.25 else 0):
        t0 = time.perf_counter()
        try:
            _exercise(load_model_file(path))
        except ModelFileError:
            pass
        dt = min(dt, time.perf_counter() - t0)
    return dt


def _forward(m) -> None:
    from engine.model.model import load_model

    model = load_model(m.gguf)
    with torch.inference_mode():
        model.forward(torch.arange(4).view(1, 4) % m.config.n_vocab)


def test_a5_random_mutations_are_rejected_or_fully_valid(seeds, tmp_path):
    n_cases = int(os.environ.get("MTPCHAT_FUZZ_CASES", N_DEFAULT))
    n_forward = int(os.environ.get("MTPCHAT_FUZZ_FORWARDS", FORWARD_SAMPLE))
    rng = random.Random(SEED)
    path = tmp_path / "mutant.gguf"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rejected = valid = 0
    crashes: list[str] = []
    worst = 0.0
    for case in range(n_cases):
        k = rng.randrange(len(seeds))
        data, fields = seeds[k]
        mutant, what = mutate(rng, data, fields, seeds[(k + 1) % len(seeds)][0])
        path.write_bytes(mutant)
        t0 = time.perf_counter()
        try:
            m = load_model_file(path)
            _exercise(m)
            worst = max(worst, _settled(time.perf_counter() - t0, path))
            if valid < n_forward:
                _forward(m)
            valid += 1
        except ModelFileError:
            rejected += 1
            worst = max(worst, _settled(time.perf_counter() - t0, path))
        except Exception as exc:  # noqa: BLE001 - the point of the test
            crashes.append(f"seed {SEED} case {case} file {k} ({what}): {exc!r}")
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    print(f"METRIC A5 mutations={n_cases} rejected={rejected} valid={valid} forwards={min(valid, n_forward)} "
          f"crashes={len(crashes)} "
          f"max_s={worst:.3f} rss_mib=+{growth:.1f}")
    assert not crashes, crashes[:10]
    assert rejected + valid == n_cases
    assert worst < 1.0
    assert growth < 64


@pytest.mark.slow
def test_a5_many_mutations(seeds, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCHAT_FUZZ_CASES", "100000")
    monkeypatch.setenv("MTPCHAT_FUZZ_FORWARDS", "500")
    test_a5_random_mutations_are_rejected_or_fully_valid(seeds, tmp_path)
