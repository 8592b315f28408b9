"""`mtpchat bench --synthetic`: the JSON document of a short run on the real 0.8B shape, and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_bench_synthetic_08b_q8_0_json_fields():
    # short setting: the real shape and type, few tokens, one repeat, one verification size
    r = _bench("--synthetic", "qwen35-0.8b:Q8_0", "--prompt-tokens", "16", "--decode-tokens", "3",
               "--bench-repeats", "1", "--verify-k", "1", "--threads", "2", "--steps", "eager", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["model"] == "synthetic qwen35-0.8b:Q8_0" and doc["threads"] == 2
    assert 0.80e9 < doc["file_bytes"] < 0.84e9
    # a Q8_0 decode step reads ~1.1 bytes per weight (int8 + float32 block scales), never a float copy
    assert 0.75e9 < doc["bytes_per_decode_step"] < 0.87e9
    assert doc["compute_path"]["kernels"] in ("compiled", "eager") and doc["compute_path"]["why"]
    assert doc["compute_path"]["weights"].get("packed Q8_0", 0) >= 24 * 5
    for key in ("decode_tok_s", "prefill_tok_s", "read_bandwidth_gbs", "bound_tok_s", "bound_pct",
                "mtp_draft_cost", "rollback_ms", "host_ms_per_step", "peak_rss_bytes"):
        assert isinstance(doc[key], (int, float)) and doc[key] >= 0, key
    assert doc["decode_tok_s"] > 0 and doc["prefill_tok_s"] > 0 and doc["read_bandwidth_gbs"] > 0
    assert set(doc["verify_cost"]) == {"1"} and doc["verify_cost"]["1"] > 0
    assert doc["peak_rss_bytes"] > doc["file_bytes"]
    assert doc["steps"]["path"] == "eager" and doc["warmup_s"] > 0
    assert doc["gpu"] == {"available": False, "reason": "no CUDA device"} or doc["gpu"]["available"]


def test_bench_synthetic_refuses_unknown_shape_and_too_big_models():
    r = _bench("--synthetic", "qwen99-1b:Q8_0")
    assert r.returncode == 2 and r.stderr.startswith("error: --synthetic qwen99-1b:Q8_0: unknown shape")
    r = _bench("--synthetic", "qwen35moe-122b-a10b:BF16")
    assert r.returncode == 2
    assert "needs 249,35" in r.stderr and "bytes" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_synthetic_writes_a_gguf(tmp_path):
    out = tmp_path / "tiny.gguf"
    r = _bench("--synthetic", "tiny:Q4_K_M", "--write-gguf", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["bytes"] == out.stat().st_size
    from engine.config import ModelConfig
    from engine.gguf import open_gguf
    assert ModelConfig.from_gguf(open_gguf(out)).n_layer == 4


@pytest.mark.slow
def test_bench_synthetic_bf16_runs():
    r = _bench("--synthetic", "tiny:BF16", "--prompt-tokens", "16", "--decode-tokens", "3",
               "--bench-repeats", "1", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
