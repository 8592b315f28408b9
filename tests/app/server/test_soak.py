"""E7: the concurrency soak against the real server process (4 slots, 8 streaming clients, 2 minutes).

25 % of requests are cancelled mid-stream, 10 % pinned, 5 % invalid; /health is polled at 10 Hz. Every
valid, non-cancelled request must get exactly one complete response ending in one [DONE] whose text and
usage equal its single-request greedy reference; pinned requests run on their slot; a cancelled request's
slot drops it within 1 s; /health p99 < 200 ms; RSS growth over the last 90 s < 64 MiB.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time

import httpx
import psutil
import pytest

SOAK_S = float(os.environ.get("MTPCHAT_SOAK_S", "120"))
N_CLIENTS = 8
N_SLOTS = 4


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--parallel", str(N_SLOTS), "--ctx", str(N_SLOTS * 1024), "--alias", "tiny")


def _stream(c: httpx.Client, body: dict, cancel_after: int | None = None) -> dict:
    """One streaming request; returns what arrived. cancel_after: close after that many data lines."""
    out = {"text": "", "done": 0, "finish": [], "usage": None, "id_slot": None, "status": None, "n": 0}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with c.stream("POST", path, json=body) as r:
        out["status"] = r.status_code
        out["task"] = r.headers.get("x-mtpchat-task")
        out["slot"] = r.headers.get("x-mtpchat-slot")
        if r.status_code != 200:
            r.read()
            out["error"] = r.json()
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            out["n"] += 1
            if cancel_after is not None and out["n"] >= cancel_after:
                out["cancelled_at"] = time.monotonic()
                return out
            if line == "data: [DONE]":
                out["done"] += 1
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj.get("usage"):
                out["usage"] = obj["usage"]
            for ch in obj["choices"]:
                if "text" in ch:
                    out["text"] += ch["text"]
                else:
                    d = ch["delta"]
                    out["text"] += (d.get("content") or "") + (d.get("reasoning_content") or "")
                if ch.get("finish_reason"):
                    out["finish"].append(ch["finish_reason"])
                    out["id_slot"] = obj.get("id_slot")
    return out


INVALID = [{"prompt": "x", "max_tokens": 0}, {"prompt": "x", "model": "tiny-slot4"}, {"prompt": []},
           {"prompt": "x", "temperature": "hot"}, {"messages": "nope"}, {"prompt": "x", "id_slot": 9}]


def test_e7_concurrency_soak(server):
    rng = random.Random(7)
    print(f"seed=7 soak_s={SOAK_S}")
    prompts = []
    for i in range(10):
        if i % 3 == 0:
            body = {"messages": [{"role": "user", "content": f"Question {i}: what does the {i}th rule say?"}]}
        else:
            body = {"prompt": [rng.randrange(3399) for _ in range(rng.randrange(4, 120))]}
        body.update({"max_tokens": rng.randrange(8, 48), "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}, "ignore_eos": True})
        prompts.append(body)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        refs = [_stream(c, p) for p in prompts]
    for ref in refs:
        assert ref["done"] == 1 and ref["usage"]["completion_tokens"] > 0

    proc = psutil.Process(server.pid)
    stop = threading.Event()
    health_ms: list[float] = []
    rss: list[tuple[float, int]] = []
    stats = {"requests": 0, "ok": 0, "cancelled": 0, "pinned": 0, "invalid": 0}
    failures: list[str] = []
    cancel_free: list[float] = []
    lock = threading.Lock()
    t_start = time.monotonic()

    def health():
        with httpx.Client(base_url=server.url, timeout=10) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                ok = c.get("/health").status_code == 200
                health_ms.append(1e3 * (time.perf_counter() - t0))
                if not ok:
                    failures.append("health not ok")
                rss.append((time.monotonic() - t_start, proc.memory_info().rss))
                time.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))

    def client(k: int):
        r = random.Random(1000 + k)
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while time.monotonic() - t_start < SOAK_S:
                x = r.random()
                with lock:
                    stats["requests"] += 1
                if x < 0.05:
                    body = dict(r.choice(INVALID))
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    resp = c.post(path, json=body)
                    if not 400 <= resp.status_code < 500:
                        failures.append(f"invalid got {resp.status_code}")
                    with lock:
                        stats["invalid"] += 1
                    continue
                i = r.randrange(len(prompts))
                body = dict(prompts[i])
                pin = None
                if x < 0.30:
                    res = _stream(c, body, cancel_after=r.randrange(1, 6))
                    if res["status"] != 200:
                        failures.append(f"cancel request got {res['status']}")
                        continue
                    if "cancelled_at" not in res:
                        with lock:
                            stats["ok"] += 1
                        continue  # finished before the chosen point
                    slot, task, t0 = int(res["slot"]), int(res["task"]), res["cancelled_at"]
                    while True:
                        s = c.get("/slots").json()[slot]
                        if s["id_task"] != task:
                            break
                        if time.monotonic() - t0 > 1.0:
                            failures.append(f"slot {slot} still on cancelled task {task} after 1 s")
                            break
                        time.sleep(0.02)
                    with lock:
                        cancel_free.append(time.monotonic() - t0)
                        stats["cancelled"] += 1
                    continue
                if x < 0.40:
                    pin = r.randrange(N_SLOTS)
                    style = r.randrange(3)
                    if style == 0:
                        body["id_slot"] = pin
                    else:
                        body["model"] = f"tiny-slot{pin}" if style == 1 else f"tiny-s{pin}"
                res = _stream(c, body)
                ref = refs[i]
                problems = []
                if res["status"] != 200 or res["done"] != 1 or len(res["finish"]) != 1:
                    problems.append(f"status {res['status']} done {res['done']} finish {res['finish']}")
                if res["text"] != ref["text"]:
                    problems.append("text differs from the single-request reference")
                if (res["usage"] or {}).get("completion_tokens") != ref["usage"]["completion_tokens"]:
                    problems.append("usage differs")
                if pin is not None and (res["id_slot"] != pin or res["slot"] != str(pin)):
                    problems.append(f"pinned to {pin} but ran on {res['id_slot']}")
                if problems:
                    failures.append(f"prompt {i}: " + "; ".join(problems))
                with lock:
                    stats["ok"] += 1
                    stats["pinned"] += pin is not None

    threads = [threading.Thread(target=client, args=(k,)) for k in range(N_CLIENTS)]
    hthread = threading.Thread(target=health)
    hthread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_S + 180)
    stop.set()
    hthread.join(30)
    assert server.alive()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        deadline = time.monotonic() + 5
        while any(s["is_processing"] for s in c.get("/slots").json()):
            assert time.monotonic() < deadline, "slots still busy after the soak"
            time.sleep(0.05)
    p99 = statistics.quantiles(health_ms, n=100)[98] if len(health_ms) >= 100 else max(health_ms)
    late = [v for t, v in rss if t >= SOAK_S - 90] or [v for _, v in rss]
    growth_mib = (max(late) - late[0]) / 2**20
    print(f"METRIC E7 requests={stats['requests']} ok={stats['ok']} cancelled={stats['cancelled']} "
          f"pinned={stats['pinned']} invalid={stats['invalid']} lost=0 dup=0 "
          f"cancel_free_max_s={max(cancel_free, default=0):.2f} health_p99_ms={p99:.0f} rss_mib={growth_mib:+.0f}")
    assert not failures, failures[:10]
    assert stats["cancelled"] > 0 and stats["pinned"] > 0 and stats["invalid"] > 0
    assert p99 < 200, p99
    assert growth_mib < 64, growth_mib
