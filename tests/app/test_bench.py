"""`mtpchat bench`: one JSON document with every configuration side by side; one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.kernels import codegen, int8_dots
from tests.app.test_cmd_logits_generate import MODELS, mtpchat  # noqa: F401  (fixture)
from tests.conftest import fixture_path


def test_bench_json_reports_every_configuration(tmp_path, mtpchat):  # noqa: F811
    model, ref_rel, _ = (fixture_path(p) for p in MODELS["dense"])
    ref = np.load(ref_rel)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": ref[f"prompt_{n}"].tolist()}) for n in (7, 33)) + "\n")
    r = mtpchat("bench", "--model", str(model), "--prompts", str(prompts), "--max-tokens", "16",
                "--mtp", "off,on,auto", "--draft", "1,2", "--threads", "1", "--clock", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    names = [c["config"] for c in doc["configs"]]
    assert names == ["off", "on/k=1", "on/k=2", "auto/k=1", "auto/k=2"]
    by = {c["config"]: c for c in doc["configs"]}
    assert by["off"]["ratio_to_off"] == 1.0 and by["off"]["rounds"] == 0
    for c in doc["configs"]:
        assert c["runs"] == 2 and c["decode_tps_median"] > 0
        paired = c["ratio_to_off_paired"]                       # 2 prompts x 1 repeat: too few for an interval
        assert paired["n"] == 2 and paired["ci95"] is None and paired["median"] > 0
    assert by["off"]["ratio_to_off_paired"]["median"] == 1.0
    assert all(c["runs_differing_from_off"] == 0 for c in doc["configs"])    # greedy: F1
    on2 = by["on/k=2"]
    assert on2["rounds"] > 0 and len(on2["accepted_per_position"]) == 2
    assert 1.0 <= on2["mean_accepted_length"] <= 3.0
    assert set(on2["verify_ms"]) >= {"3"} and on2["draft_step_ms"] > 0
    assert doc["prompts"] == 2 and doc["clock"] == "cpu" and doc["peak_rss_mib"] > 0
    assert doc["draft_vocab"] == doc["n_vocab"] == 4096          # the default: drafts among every token
    # auto: copies for compiled steps only; int8 rows by the CPU's dot products where it has them
    compiled_form = "int8_dots" if int8_dots.available() else "int8" if codegen.avx512() else "q8_0"
    assert doc["draft_weights"] == (compiled_form if doc["steps"]["path"] == "compiled" else "exact")
    assert set(doc["weights"]) == {"dense float32"} and doc["weights"]["dense float32"] > 10  # F32: none packed
    bw = doc["bandwidth"]    # the machine's state beside the ratios
    assert bw["memory_mib"] == 256 and bw["memory_gbs"] > 0 and bw["step_sized_gbs"] > 0
    assert bw["step_sized_mib"] * 2**20 >= bw["decode_step_bytes"] > (bw["step_sized_mib"] - 1) * 2**20  # CPU
    calls = doc["calls"]     # the calls of a round apart: verifications of k + 1 rows, chains of 1..max k
    assert set(calls["verify_over_plain_step"]) == {"2", "3"} and set(calls["chain_ms"]) == {"1", "2"}
    assert calls["plain_step_ms"] > 0 and all(v > 0 for v in calls["verify_ms"].values())
    assert calls["draft_row_ms"] == pytest.approx(calls["chain_ms"]["2"] - calls["chain_ms"]["1"])
    assert calls["draft_row_over_plain_step"] == pytest.approx(calls["draft_row_ms"] / calls["plain_step_ms"])


def test_bench_wrong_drafts_are_never_accepted(tmp_path, mtpchat):  # noqa: F811
    model, ref_rel, _ = (fixture_path(p) for p in MODELS["dense"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": np.load(ref_rel)["prompt_33"].tolist()}) + "\n")
    r = mtpchat("bench", "--model", str(model), "--prompts", str(prompts), "--max-tokens", "12",
                "--mtp", "on", "--draft", "3", "--threads", "1", "--wrong-drafts", "--draft-vocab", "512", "--draft-weights", "q8_0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (on,) = doc["configs"]
    assert on["rounds"] > 0 and on["accept_rate"] < 0.2
    assert doc["draft_vocab"] == 512 and doc["n_vocab"] == 4096 and doc["draft_weights"] == "q8_0"


def test_bench_samples_when_given_a_temperature(tmp_path, mtpchat):  # noqa: F811
    """--temperature: every configuration's run of a prompt draws from one seed (spec §3.3: each position at its
    own uniform), so `on` emits the same tokens as `off`; the document says how it sampled."""
    model, ref_rel, _ = (fixture_path(p) for p in MODELS["dense"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": np.load(ref_rel)["prompt_33"].tolist()}) + "\n")
    r = mtpchat("bench", "--model", str(model), "--prompts", str(prompts), "--max-tokens", "16", "--mtp", "off,on",
                "--draft", "2", "--threads", "1", "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
    off, on = doc["configs"]
    assert on["rounds"] > 0 and off["rounds"] == 0
    assert on["runs_differing_from_off"] == off["runs_differing_from_off"] == 0
    greedy = mtpchat("bench", "--model", str(model), "--prompts", str(prompts), "--max-tokens", "4", "--mtp", "off",
                     "--threads", "1", "--json")
    assert json.loads(greedy.stdout)["sampling"] is None


@pytest.mark.parametrize("args, message", [
    (("--mtp", "off,sometimes"), "--mtp: 'sometimes' is not one of"),
    (("--draft", "1,9"), "--draft: 9 is not one of"),
    (("--draft", "x"), "--draft: expected a comma-separated list"),
    (("--max-tokens", "1"), "--max-tokens: must be >= 2"),
    (("--temperature", "-1"), "temperature: must be >= 0"),
    (("--temperature", "1", "--top-p", "0"), "top_p: must be in (0, 1]"),
])
def test_bench_bad_flags_exit_2_with_one_line(args, message, mtpchat):  # noqa: F811
    r = mtpchat("bench", "--model", str(fixture_path(MODELS["dense"][0])), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_bench_packs_a_quantized_file_by_default(mtpchat):  # noqa: F811
    """--weights auto on CPU: a Q8_0 file's large matrices run packed (with the test suite's eager steps,
    those of >= 512K weights: the fixture's embedding and head); --weights dense packs none."""
    model = fixture_path("models/tiny-qwen35-q8_0.gguf")
    docs = {}
    for extra in ([], ["--weights", "dense"]):
        r = mtpchat("bench", "--model", str(model), "--max-tokens", "4", "--mtp", "off", "--threads", "1",
                    "--json", *extra)
        assert r.returncode == 0, r.stderr
        docs[" ".join(extra) or "auto"] = json.loads(r.stdout)["weights"]
    assert docs["auto"].get("packed Q8_0", 0) >= 2 and docs["auto"]["dense float32"] > 0
    assert set(docs["--weights dense"]) == {"dense float32"}
