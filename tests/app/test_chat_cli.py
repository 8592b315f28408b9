"""`mtpchat chat`: the terminal chat that `mtpchat` starts while the desktop app is not built."""

import io
import subprocess
import sys

import pytest

from tests.conftest import fixture_path


@pytest.fixture(scope="module")
def model_path():
    return str(fixture_path("models/tiny-qwen35-f32.gguf"))


def _chat(model_path, mtp):
    from app.commands.chat import TerminalChat

    return TerminalChat(model_path, mtp=mtp, draft=3, max_tokens=12, temperature=0.0, system="Be brief.",
                        think=False)


def test_two_turns_same_text_with_mtp_on_and_off(model_path):
    replies = {}
    for mode in ("off", "on"):
        chat = _chat(model_path, mode)
        try:
            out = io.StringIO()
            first = chat.reply("Hello there", out)
            second = chat.reply("And then?", out)
            replies[mode] = (first, second)
            assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
            assert chat.last_stats["tokens"] > 0
            if mode == "on":
                assert chat.last_stats["drafted"] > 0
            else:
                assert chat.last_stats["drafted"] == 0
            chat.reset()
            assert chat.messages == [{"role": "system", "content": "Be brief."}]
        finally:
            chat.close()
    assert replies["on"] == replies["off"]
    assert replies["off"][0]


def test_the_model_is_set_up_in_a_thread_that_ends_before_decoding(model_path, monkeypatch):
    """Loading and allocating the cache run outside both the caller's thread and the scheduler's (see
    engine.threads: a live thread that ran parallel regions slowed the decoding thread's ~6x)."""
    import threading

    import app.commands.chat as chat_mod
    from tests.conftest import record_load_threads

    seen = record_load_threads(monkeypatch, chat_mod)
    chat = _chat(model_path, "off")
    try:
        assert chat.reply("Hello there", io.StringIO())
    finally:
        chat.close()
    (t,) = seen
    assert t is not threading.current_thread() and not t.is_alive()


def test_cli_session_and_bad_flag(model_path):
    r = subprocess.run([sys.executable, "-m", "app", "chat", "--model", model_path, "--max-tokens", "6",
                        "--threads", "1"], input="Hi\n/stats\n/quit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout
    r = subprocess.run([sys.executable, "-m", "app", "chat", "--draft", "0"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --draft: 0 not in 1..8"]


@pytest.mark.parametrize("mtp", [pytest.param("off"), pytest.param("on", marks=pytest.mark.slow)])
def test_compiled_steps_give_the_eager_replies(model_path, mtp):
    """The scheduler's batched rounds (the server's and the chat's path) on compiled steps, compiled
    before first use: the same two replies as eager."""
    from app.commands.chat import TerminalChat
    from engine.model.steps import _cxx

    if _cxx() is None:
        pytest.skip("no C++ compiler for torch.compile's CPU backend")
    replies = {}
    for steps in ("eager", "compiled"):
        chat = TerminalChat(model_path, mtp=mtp, draft=3, max_tokens=12, temperature=0.0, system="Be brief.",
                            think=False, steps=steps)
        try:
            out = io.StringIO()
            replies[steps] = (chat.reply("Hello there", out), chat.reply("And then?", out))
            assert chat.steps_status[0] == steps
        finally:
            chat.close()
    assert replies["compiled"] == replies["eager"]
