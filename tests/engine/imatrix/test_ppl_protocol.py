"""llama.cpp's chunking and perplexity arithmetic, without a model (fixtures/README.md, "Perplexity reference")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.errors import InputError
from engine.imatrix.perplexity import (
    ChunkScore,
    PerplexityMeter,
    chunk_tokens,
    count_chunks,
    read_calibration_text,
    score_chunk,
)
from tests.conftest import fixture_path


def test_chunk_count_follows_llama_cpp():
    assert count_chunks(12257, 128) == 95          # the fixture: ⌊12257/128⌋
    assert count_chunks(12257, 128, 10) == 10
    assert count_chunks(12257, 512) == 23
    assert count_chunks(256, 128) == 2
    with pytest.raises(InputError, match="--text: tokenizes to 255 tokens; a context of 128 needs at least 256"):
        count_chunks(255, 128)
    with pytest.raises(InputError, match="--ctx"):
        count_chunks(1000, 7)
    with pytest.raises(InputError, match="--chunks"):
        count_chunks(1000, 8, 0)


def test_chunks_and_bos():
    toks = torch.arange(1000)
    c = chunk_tokens(toks, 128, 3)
    assert c.shape == (3, 128) and c[1, 0] == 128 and c[2, -1] == 383
    cb = chunk_tokens(toks, 128, 3, bos_id=7)
    assert cb[:, 0].tolist() == [7, 7, 7] and cb[1, 1] == 129
    assert toks[128] == 128  # the input is untouched


def test_score_chunk_is_second_half_nll():
    g = torch.Generator().manual_seed(3)
    n_ctx, vocab = 16, 11
    logits = torch.randn(n_ctx, vocab, generator=g)
    tokens = torch.randint(0, vocab, (n_ctx,), generator=g)
    s = score_chunk(logits, tokens)
    lp = logits.double().log_softmax(-1).numpy()
    want = [-lp[j, tokens[j + 1]] for j in range(n_ctx // 2, n_ctx - 1)]
    assert s.count == 7 == len(want)
    assert s.nll == pytest.approx(sum(want), rel=1e-14)
    assert s.nll2 == pytest.approx(sum(v * v for v in want), rel=1e-14)


def test_meter_reproduces_reference_running_values():
    ref = np.load(fixture_path("ref/tiny-qwen35.npz"))
    n_ctx = int(ref["ppl_n_ctx"])
    per_chunk = n_ctx - 1 - n_ctx // 2
    m = PerplexityMeter()
    for nll in ref["ppl_chunk_nll"]:
        m.add(ChunkScore(float(nll) * per_chunk, 0.0, per_chunk))
    np.testing.assert_allclose(m.running, ref["ppl_running"], rtol=1e-12)
    assert m.ppl == pytest.approx(float(ref["ppl"]), rel=1e-12)
    assert m.count == 5985


def test_meter_error_estimate():
    m = PerplexityMeter()
    vals = [1.0, 2.0, 4.0]
    m.add(ChunkScore(sum(vals), sum(v * v for v in vals), 3))
    mean = sum(vals) / 3
    var = sum(v * v for v in vals) / 3 - mean * mean
    assert m.ppl == pytest.approx(math.exp(mean))
    assert m.ppl_error == pytest.approx(math.sqrt(var / 2) * math.exp(mean))


def test_read_text_drops_one_trailing_newline(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"a\r\nb\n\n")
    assert read_calibration_text(p) == "a\r\nb\n"
    with pytest.raises(InputError, match="--text: .*: no such file"):
        read_calibration_text(tmp_path / "missing.txt")
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="not UTF-8"):
        read_calibration_text(p)
