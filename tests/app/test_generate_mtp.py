"""`mtpchat generate --mtp ... --draft K`: same greedy tokens in every mode, the MTP stats fields,
one-line errors for bad MTP flags."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.app.test_cmd_logits_generate import MODELS, mtpchat  # noqa: F401  (fixture)
from tests.conftest import fixture_path


def _gen(mtpchat, *extra):  # noqa: F811
    model, ref_rel, _ = (fixture_path(p) for p in MODELS["dense"])
    ids = ",".join(str(t) for t in np.load(ref_rel)["prompt_33"])
    r = mtpchat("generate", "--model", str(model), "--tokens", ids, "--max-tokens", "32", "--ignore-eos",
                "--json", "--threads", "1", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_mode_gives_the_plain_tokens_and_reports_mtp_stats(mtpchat):  # noqa: F811
    off = _gen(mtpchat, "--mtp", "off")
    assert off["stats"]["drafted"] == 0 and off["stats"]["accept_rate"] is None
    for mode in ("on", "adaptive", "auto"):
        doc = _gen(mtpchat, "--mtp", mode, "--draft", "2")
        assert doc["tokens"] == off["tokens"], mode
        st = doc["stats"]
        for key in ("drafted", "accepted", "accept_rate", "accepted_per_position", "mean_accepted_length", "gate"):
            assert key in st, (mode, key)
        if mode == "on":
            assert st["drafted"] > 0 and len(st["accepted_per_position"]) == 2
            assert st["accept_rate"] == pytest.approx(st["accepted"] / st["drafted"])
            assert 1.0 <= st["mean_accepted_length"] <= 3.0
            assert st["gate"] == []
        if mode == "adaptive":
            assert st["gate"][0] == {"token": 5, "state": "on", "reason": "baseline ready"}
    default = _gen(mtpchat)
    assert default["mtp"] == "auto" and default["tokens"] == off["tokens"]
    # drafts among the first 300 token ids only: the same output, some of the drafts lost
    small = _gen(mtpchat, "--mtp", "on", "--draft", "2", "--draft-vocab", "300")
    full = _gen(mtpchat, "--mtp", "on", "--draft", "2")
    assert small["tokens"] == off["tokens"] and small["stats"]["drafted"] > 0
    assert small["stats"]["accepted"] <= full["stats"]["accepted"]
    # drafts multiplied by Q8_0 copies of this F32 file's MTP matrices and head: the same output
    q8 = _gen(mtpchat, "--mtp", "on", "--draft", "2", "--draft-weights", "q8_0")
    assert q8["tokens"] == off["tokens"] and q8["stats"]["drafted"] > 0
    # and by int8 copies with a scale per row: the same output
    i8 = _gen(mtpchat, "--mtp", "on", "--draft", "2", "--draft-weights", "int8")
    assert i8["tokens"] == off["tokens"] and i8["stats"]["drafted"] > 0
    from engine.kernels import int8_dots
    if int8_dots.available():   # and those rows by the CPU's 8-bit dot products, activations rounded to int8
        dots = _gen(mtpchat, "--mtp", "on", "--draft", "2", "--draft-weights", "int8_dots")
        assert dots["tokens"] == off["tokens"] and dots["stats"]["drafted"] > 0


def test_int8_dots_switched_off_is_a_one_line_error(mtpchat, monkeypatch):  # noqa: F811
    from engine.kernels import int8_dots
    monkeypatch.setenv("MTPCHAT_INT8_DOTS", "off")
    monkeypatch.setattr(int8_dots, "_state", {"ok": None, "reason": ""})
    model = str(fixture_path(MODELS["dense"][0]))
    r = mtpchat("generate", "--tokens", "1,2", "--max-tokens", "3", "--model", model, "--draft-weights", "int8_dots")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --draft-weights: int8_dots: the CPU's 8-bit dot products are off "
                                "(MTPCHAT_INT8_DOTS)"), r.stderr


@pytest.mark.parametrize("args, message", [
    (("--mtp", "sometimes"), "invalid choice: 'sometimes'"),
    (("--mtp", "on", "--draft", "9"), "--draft: must be in 1..8, got 9"),
    (("--mtp", "on", "--draft", "0"), "--draft: must be in 1..8, got 0"),
    (("--draft-vocab", "0"), "--draft-vocab: 0 not in 1..4096"),
    (("--draft-vocab", "4097"), "--draft-vocab: 4097 not in 1..4096"),
    (("--draft-vocab", "half"), "--draft-vocab: expected 'all' or a token count, got 'half'"),
    (("--draft-weights", "q4"), "invalid choice: 'q4'"),
    (("--draft-weights", "q8_0", "--dtype", "bfloat16"),
     "--draft-weights: q8_0 draft weights run on CPU with float32 weights only (this model: cpu, bfloat16)"),
    (("--draft-weights", "int8", "--dtype", "bfloat16"),
     "--draft-weights: int8 draft weights run on CPU with float32 weights only (this model: cpu, bfloat16)"),
])
def test_bad_mtp_flags_exit_2_with_one_line(args, message, mtpchat):  # noqa: F811
    model = str(fixture_path(MODELS["dense"][0]))
    r = mtpchat("generate", "--tokens", "1,2", "--max-tokens", "3", "--model", model, *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_status_lines_name_the_draft_weights_and_the_dot_products_form():
    from app.commands.logits import describe_draft_weights
    from engine.kernels import int8_dots
    from engine.model import load_model
    model = load_model(fixture_path(MODELS["dense"][0]), packed=True, min_packed=0)
    assert describe_draft_weights(model) == "exact"
    if int8_dots.available():
        model.set_draft_weights("int8_dots")
        assert describe_draft_weights(model) in ("int8_dots (AVX-512 VNNI)", "int8_dots (AVX-VNNI (256-bit))")
