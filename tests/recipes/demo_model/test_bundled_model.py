"""The shipped demo model: present, small, loads through the engine's path, behaves on held-out prompts."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.gguf import open_gguf
from engine.resources import DEMO_MODEL_NAME, RESOURCES_DIR, default_model_path
from engine.text.tokenizer import Tokenizer
from recipes.demo_model import corpus

MODEL = RESOURCES_DIR / DEMO_MODEL_NAME


@pytest.fixture(scope="module")
def demo():
    if not MODEL.is_file():
        pytest.skip(f"{MODEL} not built yet")
    return open_gguf(MODEL)


def test_default_model_path_is_the_bundled_file(demo, monkeypatch):
    monkeypatch.delenv("MTPCHAT_DEFAULT_MODEL", raising=False)
    assert default_model_path() == MODEL
    assert MODEL.stat().st_size <= 25_000_000


def test_architecture_vocabulary_and_template(demo):
    cfg = ModelConfig.from_gguf(demo)
    assert cfg.arch == "qwen35" and cfg.layer_pattern() == "GDN GDN GDN ATTN | MTP"
    assert demo.metadata["tokenizer.chat_template"] == corpus.chat_template_text()
    tok = Tokenizer.from_gguf(demo)
    assert tok.piece(demo.metadata["tokenizer.ggml.eos_token_id"]) == "<|im_end|>"
    assert tok.encode("<tool_call>") == [tok.added_tokens["<tool_call>"]]


def test_held_out_prompts_tool_calls_and_mtp(demo):
    """A small sample of the acceptance run (the full one is the slow test below)."""
    from recipes.demo_model.evaluate import evaluate

    rep = evaluate(MODEL, n_tool=6, n_plain=6, max_tokens=96, n_followup=6)
    assert rep["tool_call_valid_rate"] >= 5 / 6, rep["rows"]
    assert rep["plain_no_tool_call_rate"] >= 5 / 6, rep["rows"]
    assert rep["accepted_per_position"][0] >= 0.7
    # after a tool result: an answer, not the same call again
    assert rep["followup_no_call_rate"] >= 5 / 6, rep["followup_rows"]


@pytest.mark.slow
def test_acceptance_on_the_held_out_split(demo):
    """The issue's bars on 150 + 150 held-out prompts, and the answer after a tool result on 100 held-out
    tool dialogues (no new call; quoting the result: 0.80 for the shipped file, every miss a read_file
    answer that copies the file's lines or name wrongly, so only the no-call part has a bar)."""
    from recipes.demo_model.evaluate import evaluate

    rep = evaluate(MODEL, n_tool=150, n_plain=150, n_followup=100)
    assert rep["tool_call_valid_rate"] >= 0.90
    assert rep["plain_no_tool_call_rate"] >= 0.95
    assert rep["accepted_per_position"][0] >= 0.85
    assert rep["mean_acceptance_length"] >= 3.0
    assert rep["followup_no_call_rate"] >= 0.95
