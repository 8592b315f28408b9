"""`mtpchat logits` and `mtpchat generate` against the fixture references, and their one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from app.cli import main
from tests.conftest import fixture_path

MODELS = {"dense": ("models/tiny-qwen35-f32.gguf", "ref/tiny-qwen35.npz", "ref/tiny-qwen35-mtp_ik.npz"),
          "moe": ("models/tiny-qwen35moe-q8_0.gguf", "ref/tiny-qwen35moe.npz", "ref/tiny-qwen35moe-mtp_ik.npz")}


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def mtpchat(capsys):
    """Run the CLI in this process (a subprocess per call costs seconds of imports)."""
    n_threads = torch.get_num_threads()

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as exc:
            rc = exc.code
        out = capsys.readouterr()
        return Result(rc, out.out, out.err)

    yield run
    torch.set_num_threads(n_threads)


@pytest.mark.parametrize("which", sorted(MODELS))
def test_logits_and_mtp_out_match_references(which, tmp_path, mtpchat):
    model, ref_rel, ik_rel = (fixture_path(p) for p in MODELS[which])
    ref, ik = np.load(ref_rel), np.load(ik_rel)
    ids = ",".join(str(t) for t in ref["prompt_33"])
    r = mtpchat("logits", "--model", str(model), "--tokens", ids, "--out", str(tmp_path / "l.npy"),
                "--mtp-out", str(tmp_path / "m.npy"), "--threads", "1")
    assert r.returncode == 0, r.stderr
    logits, mtp = np.load(tmp_path / "l.npy"), np.load(tmp_path / "m.npy")
    assert logits.dtype == np.float32 and logits.shape == (33, 4096)
    for got, want, what in ((logits, ref["logits_33"], "logits"), (mtp, ref["mtp_logits_33"], "mtp")):
        assert (np.abs(got - want) <= 1e-4 + 1e-4 * np.abs(want)).all(), what
        assert (got.argmax(-1) == want.argmax(-1)).all(), what
    assert (mtp.argmax(-1) == ref["mtp_argmax_33"]).all()
    assert np.abs(mtp - ik["mtp_ik_33"]).max() <= 3e-3
    assert (mtp.argmax(-1) == ik["mtp_ik_33"].argmax(-1)).all()


def test_generate_greedy_tokens_json(mtpchat):
    model, ref_rel, _ = (fixture_path(p) for p in MODELS["dense"])
    ref = np.load(ref_rel)
    ids = ",".join(str(t) for t in ref["prompt_64"])
    r = mtpchat("generate", "--model", str(model), "--tokens", ids, "--max-tokens", "24", "--ignore-eos",
                "--json", "--threads", "1", "--mtp", "off")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == ref["greedy_64"].tolist()
    assert doc["finish_reason"] == "length"
    st = doc["stats"]
    assert st["prompt_tokens"] == 64 and st["generated_tokens"] == 24 and st["decode_steps"] == 23
    assert st["prefill_seconds"] > 0 and st["decode_seconds"] > 0 and st["tokens_per_second"] > 0
    assert isinstance(doc["text"], str) and doc["text"]


def test_generate_seeded_sampling_is_reproducible(mtpchat):
    pytest.importorskip("engine.text", reason="the tokenizer (engine/text) is needed for --prompt")
    model = str(fixture_path(MODELS["dense"][0]))
    args = ("generate", "--model", model, "--prompt", "The class statement", "--max-tokens", "12",
            "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "7", "--json", "--threads", "1")
    a, b = mtpchat(*args), mtpchat(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


@pytest.mark.parametrize("args, message", [
    (("logits", "--tokens", "1,2", "--out", "{tmp}/o.npy", "--device", "tpu"), "invalid choice: 'tpu'"),
    (("logits", "--tokens", "1,x", "--out", "{tmp}/o.npy"), "--tokens: expected comma-separated integers"),
    (("logits", "--tokens", "1,4096", "--out", "{tmp}/o.npy"), "--tokens: token id 4096 is outside the vocabulary"),
    (("logits", "--tokens", "-1", "--out", "{tmp}/o.npy"), "--tokens: token id -1 is outside the vocabulary"),
    (("logits", "--tokens", "1", "--out", "{tmp}/no/such/dir/o.npy"), "--out: folder"),
    (("generate", "--tokens", "1,2", "--max-tokens", "-3"), "--max-tokens: must be >= 0"),
    (("generate", "--tokens", "1,2", "--max-tokens", "3", "--top-p", "0"), "top_p: must be in (0, 1]"),
])
def test_bad_inputs_exit_2_with_one_line(args, message, tmp_path, mtpchat):
    model = str(fixture_path(MODELS["dense"][0]))
    r = mtpchat(*(a.replace("{tmp}", str(tmp_path)) for a in args), "--model", model)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_missing_model_file_exit_2(tmp_path, mtpchat):
    r = mtpchat("logits", "--model", str(tmp_path / "nope.gguf"), "--tokens", "1", "--out", str(tmp_path / "o.npy"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {tmp_path / 'nope.gguf'}: no such file"


def test_generate_chat_wraps_the_prompt_with_the_template(mtpchat):
    pytest.importorskip("engine.text", reason="the tokenizer (engine/text) is needed for --prompt")
    model = str(fixture_path(MODELS["dense"][0]))
    r = mtpchat("generate", "--model", model, "--prompt", "What is a lambda?", "--chat", "--max-tokens", "4",
                "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n (ids of the fixture vocabulary)
    assert doc["prompt"][0] == 3400 and doc["prompt"].count(3400) == 2 and 3401 in doc["prompt"]
    assert len(doc["tokens"]) <= 4 and doc["finish_reason"] in ("stop", "length")
