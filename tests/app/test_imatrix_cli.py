"""`mtpchat imatrix`: tokenises the text with the model's tokenizer, prints llama.cpp's running perplexity,
writes a GGUF imatrix that the gguf package reads back, and refuses bad input with one line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from app.cli import main
from tests.conftest import fixture_path


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _args(tmp_path, *extra):
    return ["imatrix", "--model", str(fixture_path("models/tiny-qwen35-f32.gguf")),
            "--text", str(fixture_path("text/fixture-text.txt")), "--ctx", "128", "--threads", "1", *extra]


def _tensor_names(path):
    return {t.name for t in GGUFReader(str(path)).tensors}


def test_prints_running_perplexity_and_writes_gguf(tmp_path, capsys):
    out = tmp_path / "imatrix.gguf"
    assert main(_args(tmp_path, "--chunks", "4", "--out", str(out), "--batch", "256")) == 0
    stdout = capsys.readouterr().out.splitlines()
    # the text goes through the model's tokenizer: same tokens as the reference, so the same values
    running = np.load(fixture_path("ref/tiny-qwen35.npz"))["ppl_running"][:4]
    # llama.cpp's layout, 4 decimals; the values are the reference's within the printed rounding (5e-5) plus
    # float32 numerics (one CPU printed 30.0695 for the reference's 30.069447)
    assert re.fullmatch(r"(\[\d+\]\d+\.\d{4},)+", stdout[0]), stdout[0]
    printed = [float(v) for v in re.findall(r"\[\d+\](\d+\.\d{4}),", stdout[0])]
    assert re.findall(r"\[(\d+)\]", stdout[0]) == ["1", "2", "3", "4"]
    np.testing.assert_allclose(printed, running, rtol=2e-6, atol=5.01e-5)
    final = re.fullmatch(r"Final estimate: PPL = (\d+\.\d{4}) \+/- .*", stdout[1])
    assert final, stdout[1]
    np.testing.assert_allclose(float(final.group(1)), running[-1], rtol=2e-6, atol=5.01e-5)

    r = GGUFReader(str(out))
    f = r.fields["imatrix.datasets"]
    assert [bytes(f.parts[i]).decode() for i in f.data] == [str(fixture_path("text/fixture-text.txt"))]
    assert int(r.fields["imatrix.chunk_count"].parts[-1][0]) == 4
    assert int(r.fields["imatrix.chunk_size"].parts[-1][0]) == 128
    names = _tensor_names(out)
    assert "blk.4.nextn.eh_proj.weight.in_sum2" in names and "output.weight.counts" in names
    counts = {t.name: float(t.data.reshape(-1)[0]) for t in r.tensors if t.name.endswith(".counts")}
    assert set(counts.values()) == {4 * 128.0}


def test_no_mtp_and_json(tmp_path, capsys):
    out = tmp_path / "imatrix.gguf"
    assert main(_args(tmp_path, "--chunks", "2", "--out", str(out), "--no-mtp", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mtp"] is False and doc["chunks"] == 2 and doc["n_tokens"] == 12257
    assert not any(n.startswith("blk.4.") for n in _tensor_names(out))
    assert doc["entries"] == len(_tensor_names(out)) // 3


@pytest.mark.parametrize("extra, message", [
    (["--ctx", "8192"], "error: --text: tokenizes to 12257 tokens; a context of 8192 needs at least 16384"),
    (["--chunks", "0"], "error: --chunks: 0 must be at least 1"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, extra, message):
    assert main(_args(tmp_path, "--out", str(tmp_path / "x.gguf"), *extra)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert not (tmp_path / "x.gguf").exists()


def test_missing_out_folder_is_refused_before_work(tmp_path, capsys):
    assert main(_args(tmp_path, "--out", str(tmp_path / "no" / "x.gguf"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out: {tmp_path / 'no' / 'x.gguf'}: folder {tmp_path / 'no'} does not exist"]


def test_legacy_dat_output(tmp_path, capsys):
    from engine.imatrix.gguf_format import read_imatrix_dat

    out = tmp_path / "imatrix.dat"
    assert main(_args(tmp_path, "--chunks", "2", "--out", str(out), "--output-format", "dat", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    dat = read_imatrix_dat(out)
    assert doc["output_format"] == "dat" and doc["entries"] == len(dat.entries) == 40
    assert dat.chunk_count == 2 and dat.dataset == str(fixture_path("text/fixture-text.txt"))
    assert {ncall for ncall, _ in dat.entries.values()} == {2}
    assert dat.entries["blk.4.nextn.eh_proj.weight"][1].shape == (512,)
