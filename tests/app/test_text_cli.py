"""`mtpchat tokenize` and `mtpchat template` on the vocab-only Qwen3.5 GGUF (issue 3 CLI contract)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from tests.conftest import fixture_path

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def vocab() -> str:
    return str(fixture_path("tokenizer/qwen35-vocab.gguf"))


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_tokenize_plain_special_json(capsys, vocab):
    rc, out, err = _run(capsys, ["tokenize", "--model", vocab, "--text", "Hello<|im_start|><think>"])
    assert rc == 0 and err == ""
    plain = [int(x) for x in out.split()]
    assert plain[0] == 9419 and 248045 not in plain and plain[-1] == 248068
    rc, out, _ = _run(capsys, ["tokenize", "--model", vocab, "--text", "Hello<|im_start|><think>", "--special"])
    assert [int(x) for x in out.split()] == [9419, 248045, 248068]
    rc, out, _ = _run(capsys, ["tokenize", "--model", vocab, "--text", "Hello world", "--json"])
    doc = json.loads(out)
    assert doc == {"ids": [9419, 1814], "tokens": ["Hello", "Ġworld"], "n_tokens": 2, "special": False}


def test_tokenize_file_matches_text(capsys, vocab, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("中文 😀\n  code()", encoding="utf-8")
    _, a, _ = _run(capsys, ["tokenize", "--model", vocab, "--file", str(f)])
    _, b, _ = _run(capsys, ["tokenize", "--model", vocab, "--text", "中文 😀\n  code()"])
    assert a == b and a.strip()


def test_template_prints_exactly_the_hf_text(capsysbinary, vocab, tmp_path):
    cases = {c["name"]: c for c in json.loads((DATA / "template_goldens.json").read_text("utf-8"))["cases"]}
    c = cases["tool_call_dict"]
    m, t = tmp_path / "m.json", tmp_path / "t.json"
    m.write_text(json.dumps(c["messages"]), encoding="utf-8")
    t.write_text(json.dumps(c["tools"]), encoding="utf-8")
    assert main(["template", "--model", vocab, "--messages", str(m), "--tools", str(t)]) == 0
    assert capsysbinary.readouterr().out == c["text"].encode("utf-8")  # no newline added
    c = cases["thinking_off"]
    m.write_text(json.dumps(c["messages"]), encoding="utf-8")
    assert main(["template", "--model", vocab, "--messages", str(m), "--enable-thinking", "false"]) == 0
    assert capsysbinary.readouterr().out == c["text"].encode("utf-8")
    c = cases["no_gen_prompt"]
    m.write_text(json.dumps(c["messages"]), encoding="utf-8")
    assert main(["template", "--model", vocab, "--messages", str(m), "--no-generation-prompt"]) == 0
    assert capsysbinary.readouterr().out == c["text"].encode("utf-8")


@pytest.mark.parametrize("content, extra, expected", [
    ("[{\"role\": \"user\"", [], "error: --messages: {m}: not valid JSON (line 1 column 17: Expecting ',' delimiter)"),
    ('[{"role": "system", "content": "only"}]', [], "error: template raised: No user query found in messages."),
    ('[{"role": "wizard", "content": "x"}]', [], "error: messages[0].role: 'wizard' is not one of system, user, "
                                                  "assistant, tool"),
    ('[{"role": "user", "content": "x"}]', ["--tools", "/nonexistent/t.json"],
     "error: --tools: /nonexistent/t.json: No such file or directory"),
])
def test_template_errors_are_one_line_exit_2(capsys, vocab, tmp_path, content, extra, expected):
    m = tmp_path / "m.json"
    m.write_text(content, encoding="utf-8")
    rc, out, err = _run(capsys, ["template", "--model", vocab, "--messages", str(m), *extra])
    assert rc == 2 and out == ""
    assert err == expected.format(m=m) + "\n"


def test_missing_model_and_bad_flags_exit_2_one_line(tmp_path):
    if not list(Path(__file__).resolve().parents[2].glob("resources/**/*.gguf")):  # until the demo model lands
        r = subprocess.run([sys.executable, "-m", "app", "tokenize", "--text", "x"], capture_output=True, text=True)
        assert r.returncode == 2
        assert r.stderr == "error: --model: required (no bundled demo model found in resources/)\n"
    r = subprocess.run([sys.executable, "-m", "app", "template", "--messages", "m.json", "--enable-thinking", "maybe"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--enable-thinking" in r.stderr
    r = subprocess.run([sys.executable, "-m", "app", "tokenize", "--model", str(tmp_path / "none.gguf"),
                        "--text", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
