"""The cache's allocated bytes per sequence equal spec/qwen35-gguf.md §7, as `mtpchat inspect --ctx`
reports it, for both fixtures and both engine KV dtypes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.model import ModelCache
from tests.conftest import REPO, fixture_path
from tests.engine.model.conftest import F32_MODELS, get_model


def test_tiny_dense_matches_spec_anchor():
    """spec §7 "Test anchor": n_ctx 4096, f32 KV 8,388,608 B, GDN state 215,040 B; f16 KV 4,194,304 B."""
    cfg = get_model(F32_MODELS["dense"][0]).cfg
    per = ModelCache(cfg, 2, 4096).nbytes_per_slot()
    assert per == {"kv": 8_388_608, "state": 215_040, "total": 8_388_608 + 215_040}
    assert ModelCache(cfg, 1, 4096, kv_dtype=torch.bfloat16).nbytes_per_slot()["kv"] == 4_194_304


@pytest.mark.parametrize("which", sorted(F32_MODELS))
def test_cache_bytes_equal_inspect_ctx(which):
    path = fixture_path(F32_MODELS[which][0])
    n_ctx = 3000
    r = subprocess.run([sys.executable, "-m", "app", "inspect", str(path), "--ctx", str(n_ctx), "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout)["memory"]
    cfg = get_model(F32_MODELS[which][0]).cfg
    for key, dtype in (("engine_cpu", torch.float32), ("engine_cuda", torch.bfloat16)):
        cache = ModelCache(cfg, 3, n_ctx, kv_dtype=dtype)
        per = cache.nbytes_per_slot()
        assert per["kv"] == mem["kv"][key]["kv_bytes"], key
        assert per["state"] == mem["recurrent_state"]["total_bytes"]
        assert cache.nbytes() == 3 * per["total"]
    assert ModelCache(cfg, 1, n_ctx, mtp=False).nbytes_per_slot()["kv"] * 2 == mem["kv"]["engine_cpu"]["kv_bytes"]
