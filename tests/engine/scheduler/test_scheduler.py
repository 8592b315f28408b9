"""Scheduler mechanics on a scripted backend: streams, slot choice, pinning, cancellation, containment."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import InputError
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.types import Assigned, Finished, GenerationRequest, TextDelta
from tests.engine.scheduler.scripted import CharText, ScriptedBackend, script_token


def collect(handle, timeout=10.0):
    evs = []
    deadline = time.monotonic() + timeout
    while True:
        ev = handle.get(max(0.0, deadline - time.monotonic()))
        assert ev is not None, f"no Finished within {timeout}s; got {evs}"
        evs.append(ev)
        if isinstance(ev, Finished):
            return evs


@pytest.fixture
def sched_factory():
    made = []

    def make(backend, **kw):
        s = Scheduler(backend, CharText, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_stream_yields_every_token_once_and_usage_matches(sched_factory):
    sched = sched_factory(ScriptedBackend(n_slots=2))
    prompt = tuple(range(1, 20))
    evs = collect(sched.submit(GenerationRequest(prompt=prompt, max_tokens=12)))
    assert isinstance(evs[0], Assigned) and evs[0].cache_n == 0
    toks = [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids]
    assert toks == [script_token(prompt, i) for i in range(12)]
    fin = evs[-1]
    assert fin.finish_reason == "length" and fin.completion_tokens == 12 and fin.prompt_tokens == 19
    assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == "".join(chr(97 + t % 26) for t in toks)


def test_eos_ends_with_stop_and_is_not_emitted(sched_factory):
    sched = sched_factory(ScriptedBackend(n_slots=1, eos_after=3))
    evs = collect(sched.submit(GenerationRequest(prompt=(5, 6), max_tokens=50)))
    toks = [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids]
    assert len(toks) == 3 and evs[-1].finish_reason == "stop" and evs[-1].completion_tokens == 4


def test_stop_string_cut_and_cache_trimmed(sched_factory):
    backend = ScriptedBackend(n_slots=1)
    sched = sched_factory(backend)
    prompt = (3, 4, 5)
    full = "".join(chr(97 + script_token(prompt, i) % 26) for i in range(30))
    stop = full[10:12]
    evs = collect(sched.submit(GenerationRequest(prompt=prompt, max_tokens=30, stop=(stop,))))
    text = "".join(e.text for e in evs if isinstance(e, TextDelta))
    assert text == full[: full.find(stop)]
    fin = evs[-1]
    assert fin.finish_reason == "stop" and fin.stopping_word == stop
    assert len(backend.cache[0]) == len(prompt) + fin.completion_tokens


def test_active_slots_share_one_batched_iteration(sched_factory):
    backend = ScriptedBackend(n_slots=4, step_s=0.002)
    sched = sched_factory(backend)
    hs = [sched.submit(GenerationRequest(prompt=(i + 1,) * 5, max_tokens=40)) for i in range(4)]
    for h in hs:
        collect(h)
    assert max(len(b) for b in backend.batches) == 4


def test_pinned_request_waits_for_its_slot_and_never_moves(sched_factory):
    backend = ScriptedBackend(n_slots=2, step_s=0.002)
    sched = sched_factory(backend)
    busy = sched.submit(GenerationRequest(prompt=(1, 2), max_tokens=60, slot=1))
    assert isinstance(busy.get(5), Assigned)
    pinned = sched.submit(GenerationRequest(prompt=(7, 8), max_tokens=3, slot=1))
    free = sched.submit(GenerationRequest(prompt=(9, 9), max_tokens=3))
    ev_free = collect(free)
    assert ev_free[0].slot == 0
    ev_pinned = collect(pinned)
    assert ev_pinned[0].slot == 1 and ev_pinned[-1].finish_reason == "length"
    assert collect(busy)[-1].finish_reason == "length"
    assert isinstance(ev_pinned[0], Assigned)


def test_out_of_range_slot_refused(sched_factory):
    sched = sched_factory(ScriptedBackend(n_slots=2))
    with pytest.raises(InputError):
        sched.submit(GenerationRequest(prompt=(1,), max_tokens=2, slot=2))
    with pytest.raises(InputError):
        sched.submit(GenerationRequest(prompt=(1,) * 500, max_tokens=100))


def test_longest_common_prefix_slot_is_chosen(sched_factory):
    backend = ScriptedBackend(n_slots=3)
    sched = sched_factory(backend)
    a = tuple(range(1, 30))
    first = collect(sched.submit(GenerationRequest(prompt=a, max_tokens=2, slot=2)))
    assert first[0].slot == 2
    again = collect(sched.submit(GenerationRequest(prompt=a + (40, 41), max_tokens=2)))
    assert again[0].slot == 2 and again[0].cache_n == len(a)


@pytest.mark.parametrize("phase", ["queue", "prefill", "decode"])
def test_cancel_frees_slot_within_one_second(sched_factory, phase):
    backend = ScriptedBackend(n_slots=1, n_ctx_slot=1024, step_s=0.01, prefill_chunk=1)
    sched = sched_factory(backend)
    blocker = None
    if phase == "queue":
        blocker = sched.submit(GenerationRequest(prompt=(1,), max_tokens=400))
    h = sched.submit(GenerationRequest(prompt=(2,) * 200, max_tokens=400))
    if phase == "decode":
        while True:
            ev = h.get(5)
            assert ev is not None
            if isinstance(ev, TextDelta):
                break
    elif phase == "prefill":
        assert isinstance(h.get(5), Assigned)
        time.sleep(0.05)
    t0 = time.monotonic()
    h.cancel()
    evs = collect(h, timeout=2)
    assert evs[-1].finish_reason == "cancelled"
    if phase != "queue":
        while sched.slots()[0].is_processing:
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.005)
        assert time.monotonic() - t0 < 1.0
        assert backend.cache[0] == []  # aborted mid-way: nothing half-valid is kept
    if blocker is not None:
        blocker.cancel()
        collect(blocker)


def test_failing_request_does_not_hurt_others(sched_factory):
    backend = ScriptedBackend(n_slots=2, fail_task=2)
    sched = sched_factory(backend)
    good = sched.submit(GenerationRequest(prompt=(1, 2, 3), max_tokens=20))
    bad = sched.submit(GenerationRequest(prompt=(4, 5, 6), max_tokens=20))
    fin_bad = collect(bad)[-1]
    assert fin_bad.finish_reason == "error" and fin_bad.error_status == 500
    evs = collect(good)
    assert [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids] == \
        [script_token((1, 2, 3), i) for i in range(20)]
    again = collect(sched.submit(GenerationRequest(prompt=(4, 5, 6), max_tokens=3)))
    assert again[-1].finish_reason == "length"


def test_queue_timeout_is_503(sched_factory):
    backend = ScriptedBackend(n_slots=1, step_s=0.01)
    sched = sched_factory(backend, queue_timeout_s=0.2)
    busy = sched.submit(GenerationRequest(prompt=(1,), max_tokens=200))
    waiting = sched.submit(GenerationRequest(prompt=(2,), max_tokens=2, slot=0))
    fin = collect(waiting)[-1]
    assert fin.finish_reason == "error" and fin.error_status == 503 and fin.slot == -1
    busy.cancel()
    collect(busy)


def test_sink_receives_events_on_engine_thread(sched_factory):
    sched = sched_factory(ScriptedBackend(n_slots=1))
    got, done = [], threading.Event()

    def sink(ev):
        got.append((threading.current_thread().name, ev))
        if isinstance(ev, Finished):
            done.set()

    sched.submit(GenerationRequest(prompt=(1, 2), max_tokens=4), sink=sink)
    assert done.wait(5)
    assert {name for name, _ in got} == {"mtpchat-engine"}
