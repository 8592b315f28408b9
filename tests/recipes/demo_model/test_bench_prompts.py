"""`python -m recipes.demo_model.bench_prompts`: the bench's prompt sets of the bundled demo model."""

from __future__ import annotations

import json

import pytest

from engine.gguf import open_gguf
from engine.resources import default_model_path
from engine.text.tokenizer import Tokenizer
from recipes.demo_model.bench_prompts import main, random_prompts


def test_random_prompts_are_seeded_token_ids_without_control_ones(tmp_path):
    path = default_model_path()
    tok = Tokenizer.from_gguf(open_gguf(path))
    a = random_prompts(path, n=5, length=20, seed=3)
    assert len(a) == 5 and all(len(p) == 20 for p in a)
    assert all(tok.token_type(i) != 3 for p in a for i in p)          # no CONTROL token
    assert a == random_prompts(path, n=5, length=20, seed=3) != random_prompts(path, n=5, length=20, seed=4)
    assert len({i for p in a for i in p}) > 50                        # spread over the vocabulary
    out = tmp_path / "r.jsonl"
    assert main(["--model", str(path), "-n", "5", "--random-tokens", "20", "--seed", "3", "--out", str(out)]) == 0
    assert [json.loads(line)["tokens"] for line in out.read_text().splitlines()] == a
    with pytest.raises(SystemExit) as e:
        main(["--model", str(path), "--random-tokens", "0", "--out", str(out)])
    assert e.value.code == 2
