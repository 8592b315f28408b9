"""`mtpchat inspect`: a correct summary of every fixture GGUF; one error line and exit 2 for a bad file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.cli import main
from engine.gguf import load_model_file
from engine.memory import sequence_memory
from tests.conftest import REPO, fixture_path

# file -> (arch, tensors per quant type) read from fixtures/README.md
FIXTURES = {
    "tiny-qwen35-f32": ("qwen35", {"F32": 71}),
    "tiny-qwen35-q8_0": ("qwen35", {"Q8_0": 41, "F32": 30}),
    "tiny-qwen35-q6_k": ("qwen35", {"Q6_K": 41, "F32": 30}),
    "tiny-qwen35-q4_k_m": ("qwen35", {"Q4_K": 38, "Q6_K": 3, "F32": 30}),
    "tiny-qwen35-iq4_xs": ("qwen35", {"IQ4_XS": 38, "Q6_K": 1, "Q5_K": 2, "F32": 30}),
    "tiny-qwen35moe-q8_0": ("qwen35moe", {"Q8_0": 56, "F32": 40}),
}


def _run(capsys, *argv):
    rc = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", list(FIXTURES))
def test_json_summary_of_every_fixture(capsys, name):
    path = fixture_path(f"models/{name}.gguf")
    rc, out, err = _run(capsys, str(path), "--json")
    assert rc == 0 and err == ""
    s = json.loads(out)
    arch, quant = FIXTURES[name]
    assert s["architecture"] == arch
    assert s["layer_kinds"] == ["GDN", "GDN", "GDN", "ATTN"] and s["layer_pattern"] == "GDN GDN GDN ATTN | MTP"
    assert s["mtp"]["present"] is True and s["mtp"]["blocks"] == [4]
    assert s["blocks"] == 5 and s["main_blocks"] == 4
    d = s["dims"]
    assert (d["n_embd"], d["n_vocab"], d["n_head"], d["n_head_kv"], d["head_dim"], d["rope_dim"]) == \
        (256, 4096, 4, 2, 64, 16)
    assert (d["ssm_n_group"], d["ssm_dt_rank"], d["ssm_d_state"], d["ssm_conv_kernel"]) == (2, 4, 64, 4)
    assert d["rope_theta"] == 1e7 and d["rope_sections"] == [3, 3, 2, 0]
    if arch == "qwen35moe":
        assert (d["n_expert"], d["n_expert_used"], d["n_ff_exp"], d["n_ff_shexp"]) == (8, 2, 128, 256)
    else:
        assert d["n_ff"] == 512
    assert {k: v["tensors"] for k, v in s["quant_types"].items()} == quant
    assert s["tensor_bytes"] == sum(v["bytes"] for v in s["quant_types"].values())
    assert s["file_bytes"] == path.stat().st_size and s["tensor_bytes"] < s["file_bytes"]
    assert s["output_head"].startswith("untied")
    t = s["tokenizer"]
    assert (t["model"], t["pre"], t["vocab_size"], t["merges"], t["add_bos_token"]) == ("gpt2", "qwen35", 4096, 3143,
                                                                                          False)
    assert t["special"] == {"eos": {"id": 3401, "text": "<|im_end|>"},
                            "padding": {"id": 3399, "text": "<|endoftext|>"}}
    assert s["chat_template"] == {"present": True, "bytes": 7756}
    assert "memory" not in s


def test_ctx_memory_figures_match_spec_section_7(capsys):
    """spec/qwen35-gguf.md §7 test anchor: tiny f32 fixture at n_ctx 4096."""
    rc, out, _ = _run(capsys, str(fixture_path("models/tiny-qwen35-f32.gguf")), "--json", "--ctx", "4096")
    assert rc == 0
    m = json.loads(out)["memory"]
    assert m["kv"]["llama_cpp"] == {"kv_dtype": "f16", "kv_bytes": 4_194_304}
    assert m["kv"]["engine_cpu"] == {"kv_dtype": "f32", "kv_bytes": 8_388_608}
    assert m["kv"]["engine_cuda"] == {"kv_dtype": "bf16", "kv_bytes": 4_194_304}
    assert m["recurrent_state"]["total_bytes"] == 215_040
    assert m["recurrent_state"]["gdn_blocks"] == 3 and m["attention_blocks_with_kv"] == 2
    assert m["kv"]["llama_cpp"]["kv_bytes"] + m["recurrent_state"]["total_bytes"] == 4_409_344


def test_memory_worked_example_of_the_27b():
    """spec §7 worked example, Qwen3.6-27B: 17 attention blocks (16 + MTP), 48 GDN blocks."""
    from engine.config import ATTN, GDN, ModelConfig

    kinds = tuple(ATTN if (i + 1) % 4 == 0 else GDN for i in range(64))
    cfg = ModelConfig(arch="qwen35", n_embd=5120, n_block=65, n_nextn=1, layer_kinds=kinds, n_head=24, n_head_kv=4,
                      head_dim=256, rope_dim=64, rope_theta=1e7, rope_sections=(11, 11, 10, 0), rms_eps=1e-6,
                      n_ff=17408, n_vocab=248320, context_length=262144, ssm_conv_kernel=4, ssm_d_state=128,
                      ssm_n_group=16, ssm_dt_rank=48, ssm_d_inner=48 * 128)
    s = sequence_memory(cfg, 32768, "f16")
    assert s.kv_bytes == 2_281_701_376 and s.state_bytes == 156_893_184
    assert sequence_memory(cfg, 262144, "f16").kv_bytes == 18_253_611_008


def test_text_summary_names_the_facts(capsys):
    rc, out, _ = _run(capsys, str(fixture_path("models/tiny-qwen35moe-q8_0.gguf")), "--ctx", "4096")
    assert rc == 0
    assert "GDN GDN GDN ATTN | MTP" in out and "qwen35moe" in out and "MoE: 8 experts, top-2" in out
    assert "Q8_0" in out and "56 tensors" in out and "MTP             present" in out
    assert "chat template   present (7,756 bytes)" in out
    assert "engine on CPU (f32): 8,388,608 B" in out and "llama.cpp default (f16): 4,194,304 B" in out
    assert "215,040 B" in out


def test_tokenizer_only_fixture_exits_2_with_one_line(capsys):
    path = fixture_path("tokenizer/qwen35-vocab.gguf")
    rc, out, err = _run(capsys, str(path))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"error: {path}: has no model weights")


def test_invalid_file_exits_2_naming_the_offset_without_traceback(tmp_path):
    """The real entry point in a child process: one stderr line, no traceback."""
    src = fixture_path("models/tiny-qwen35-q4_k_m.gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src.read_bytes()[:4113])
    r = subprocess.run([sys.executable, "-m", "app", "inspect", str(bad)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {bad}: offset ") and "left in the file" in r.stderr


def test_missing_file_and_bad_ctx(capsys, tmp_path):
    rc, _, err = _run(capsys, str(tmp_path / "nope.gguf"))
    assert rc == 2 and err == f"error: {tmp_path / 'nope.gguf'}: no such file\n"
    rc, _, err = _run(capsys, str(fixture_path("models/tiny-qwen35-f32.gguf")), "--ctx", "0")
    assert rc == 2 and err.count("\n") == 1 and "--ctx" in err


def test_summary_agrees_with_the_loader():
    from app.commands.inspect import summarize

    m = load_model_file(fixture_path("models/tiny-qwen35-q4_k_m.gguf"))
    s = summarize(m, 128)
    assert s["tensors"] == len(m.gguf.tensors)
    assert s["memory"]["kv"]["engine_cpu"]["kv_bytes"] == sequence_memory(m.config, 128, "f32").kv_bytes
