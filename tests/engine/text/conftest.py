"""Shared fixtures for the text tests: the real Qwen3.5 vocabulary, built once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import fixture_path

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="session")
def qwen_gguf():
    from engine.gguf import open_gguf

    return open_gguf(fixture_path("tokenizer/qwen35-vocab.gguf"))


@pytest.fixture(scope="session")
def qwen_tok(qwen_gguf):
    from engine.text import Tokenizer

    return Tokenizer.from_gguf(qwen_gguf)


@pytest.fixture(scope="session")
def tokenizer_goldens():
    return json.loads((DATA / "tokenizer_goldens.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="session")
def template_goldens():
    return json.loads((DATA / "template_goldens.json").read_text(encoding="utf-8"))
