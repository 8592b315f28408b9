"""E10: bad requests and a fault inside one slot's forward never hurt the other requests or the process."""

from __future__ import annotations

import json
import random
import threading

import pytest

from tests.app.server.inproc import InProcessServer
from tests.app.server.test_robustness import BOUNDS, CHAT_MALFORMED, E8_INVALID, MALFORMED
from tests.conftest import fixture_path

FAULT_TOKEN = 4000   # a prompt starting with this id fails inside the engine (test hook)


@pytest.fixture(scope="module")
def server():
    s = InProcessServer("--model", str(fixture_path("models/tiny-qwen35-f32.gguf")), "--parallel", "4",
                        "--mtp", "on", "--ctx", "8192")

    def fault(slot, task):
        run = s.backend.slots[slot].run
        if run.req.prompt[0] == FAULT_TOKEN and run.n_generated >= 2:
            raise RuntimeError("injected fault inside the slot's forward")

    s.backend.fault_hook = fault
    yield s
    s.stop()


def _stream_text(url: str, body: dict) -> tuple[str, int]:
    import httpx
    text, done = [], 0
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            text.append(obj["choices"][0]["text"])
    return "".join(text), done


def test_e10_bad_requests_and_a_slot_fault_do_not_hurt_good_requests(server):
    rng = random.Random(10)
    goods = [{"prompt": [rng.randrange(3399) for _ in range(12)], "max_tokens": 48, "temperature": 0,
              "stream": True, "ignore_eos": True} for _ in range(4)]
    clean = [_stream_text(server.url, g) for g in goods]
    assert all(done == 1 for _, done in clean)
    results: list = [None] * 4

    def good(i):
        results[i] = _stream_text(server.url, goods[i])

    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    bad = 0
    with server.client() as c:
        corpus = [("raw", raw) for raw in MALFORMED] + [("chat", b) for b in CHAT_MALFORMED]
        corpus += [("field", {"prompt": "x", field: v}) for field, vs in BOUNDS for v in vs]
        corpus += [("field", {"prompt": "x", **body}) for body, _ in E8_INVALID]
        while bad < 400:
            kind, item = corpus[bad % len(corpus)]
            if kind == "raw":
                r = c.post("/v1/completions", content=item, headers={"Content-Type": "application/json"})
            elif kind == "chat":
                r = c.post("/v1/chat/completions", json=item)
            else:
                r = c.post("/v1/completions", json=item)
            assert 400 <= r.status_code < 500, (item, r.status_code)
            bad += 1
            if bad % 100 == 0:
                r = c.post("/v1/completions", json={"prompt": [FAULT_TOKEN, 5, 6], "max_tokens": 20,
                                                    "temperature": 0})
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            if bad % 50 == 0:
                assert c.get("/health").status_code == 200
    for t in threads:
        t.join(120)
    assert results == clean
    assert server.thread.is_alive() and server.state.scheduler._thread.is_alive()
    with server.client() as c:
        assert all(not s["is_processing"] for s in c.get("/slots").json())
    print(f"METRIC E10 bad={bad} good=4 good_equal=4 faults=4 deaths=0")


def test_the_server_sets_its_model_up_in_a_thread_that_ends(monkeypatch):
    """Loading and the slots' caches run outside the caller's thread and the scheduler's, in a thread that
    has ended when the server starts (engine.threads: a live thread that ran parallel regions slowed the
    scheduler's compiled steps ~6x)."""
    import app.commands.serve as serve_mod
    from app.cli import build_parser
    from tests.conftest import record_load_threads

    seen = record_load_threads(monkeypatch, serve_mod)
    state = serve_mod.build_state(build_parser().parse_args(
        ["serve", "--model", str(fixture_path("models/tiny-qwen35-f32.gguf")), "--steps", "eager"]))
    try:
        (t,) = seen
        assert t is not threading.current_thread() and not t.is_alive()
        assert state.scheduler.backend.n_slots == 2 and state.scheduler.backend.cache.lengths == [0, 0]
    finally:
        state.scheduler.close()
