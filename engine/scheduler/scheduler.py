"""The slot scheduler: one engine thread, N slots, a request queue, one result stream per request.

spec/mtp-speculation.md §6.1: slot choice (pin, longest common prefix, least recently used, else defer),
continuous batching of every active slot in one backend iteration, cancellation that frees the slot at
the next iteration (reliability-matrix E9), and containment of a failing request (E10). It never prints.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InputError
from engine.scheduler.backend import SlotBackend
from engine.scheduler.prefix import common_prefix
from engine.scheduler.types import (
    MTP_MODES,
    Assigned,
    Event,
    Finished,
    GenerationRequest,
    SlotSnapshot,
    TextDelta,
    Timings,
)
from engine.spec.events import SpecStats

if TYPE_CHECKING:
    from engine.scheduler.text import TextStream

log = logging.getLogger(__name__)

Sink = Callable[[Event], None]


class RequestHandle:
    """A submitted request: its task id, its event stream and `cancel()`, safe from any thread."""

    def __init__(self, task: int, req: GenerationRequest, sink: Sink | None, scheduler: Scheduler):
        self.task = task
        self.request = req
        self._scheduler = scheduler
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._queue: deque[Event] = deque()
        self._cv = threading.Condition()
        self._sink = sink
        self.cancel_time: float | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        if not self._cancel.is_set():
            self.cancel_time = time.monotonic()
            self._cancel.set()
            self._scheduler._wake()

    def _emit(self, ev: Event) -> None:
        if isinstance(ev, Finished):
            self._done.set()
        if self._sink is not None:
            self._sink(ev)
            return
        with self._cv:
            self._queue.append(ev)
            self._cv.notify_all()

    def get(self, timeout: float | None = None) -> Event | None:
        """Next event (blocking streams only); None on timeout."""
        with self._cv:
            if not self._queue and not self._cv.wait_for(lambda: bool(self._queue), timeout):
                return None
            return self._queue.popleft()

    def __iter__(self):
        while True:
            ev = self.get()
            yield ev
            if isinstance(ev, Finished):
                return


@dataclass
class _Active:
    handle: RequestHandle
    slot: int
    text: TextStream
    cache_n: int
    n_prompt: int
    prompt_left: int
    t_start: float
    t_prompt_done: float = 0.0
    generated: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    stopping_word: str = ""


@dataclass
class _SlotState:
    task: int = -1
    last_used: float = 0.0
    params: dict = field(default_factory=dict)
    n_decoded: int = 0
    n_remain: int = 0
    stopped: str = ""
    stopping_word: str = ""
    stats: SpecStats | None = None


class Scheduler:
    """Owns the backend (model, caches, N slots) on one engine thread."""

    def __init__(self, backend: SlotBackend, text_factory: Callable[[tuple[str, ...]], TextStream], *,
                 default_mtp: str = "auto", default_draft: int = 3, queue_timeout_s: float = 600.0,
                 name: str = "mtpchat-engine"):
        if default_mtp not in MTP_MODES:
            raise InputError(f"mtp: {default_mtp!r} is not one of {', '.join(MTP_MODES)}")
        self.backend = backend
        self.n_slots = backend.n_slots
        self.n_ctx_slot = backend.n_ctx_slot
        self.default_mtp = default_mtp
        self.default_draft = default_draft
        self.queue_timeout_s = queue_timeout_s
        self._text_factory = text_factory
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[tuple[RequestHandle, float]] = deque()
        self._active: dict[int, _Active] = {}     # slot -> running request
        self._slots = [_SlotState() for _ in range(self.n_slots)]
        self._task_ids = itertools.count(1)
        self._listeners: list[Sink] = []
        self._closed = False
        self.n_decode_total = 0
        self.n_busy_slots_total = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, any thread

    def add_listener(self, fn: Sink) -> None:
        """`fn` sees every event of every request, on the engine thread (metrics, monitors)."""
        self._listeners.append(fn)

    def submit(self, req: GenerationRequest, sink: Sink | None = None) -> RequestHandle:
        """Queue a request. `sink` receives its events on the engine thread; without one, read them with
        `handle.get()` or by iterating the handle. Raises InputError for a request no slot can run."""
        if not req.prompt:
            raise InputError("prompt: empty")
        if req.slot is not None and not 0 <= req.slot < self.n_slots:
            raise InputError(f"slot: {req.slot} is out of range 0..{self.n_slots - 1}")
        if req.mtp is not None and req.mtp not in MTP_MODES:
            raise InputError(f"mtp: {req.mtp!r} is not one of {', '.join(MTP_MODES)}")
        if len(req.prompt) + req.max_tokens > self.n_ctx_slot:
            raise InputError(f"prompt: {len(req.prompt)} prompt tokens + max_tokens {req.max_tokens} exceed the "
                             f"slot context of {self.n_ctx_slot} tokens")
        with self._lock:
            if self._closed:
                raise RuntimeError("scheduler is closed")
            handle = RequestHandle(next(self._task_ids), req, sink, self)
            self._queue.append((handle, time.monotonic()))
            self._wakeup.notify_all()
        return handle

    def slots(self) -> list[SlotSnapshot]:
        with self._lock:
            out = []
            for i, st in enumerate(self._slots):
                info = dict(self.backend.slot_info(i))
                act = self._active.get(i)
                stats = act.stats if act is not None else st.stats
                if stats is not None:
                    info["draft_n"] = stats.drafted
                    info["draft_n_accepted"] = stats.accepted
                out.append(SlotSnapshot(
                    id=i, id_task=st.task, n_ctx=self.n_ctx_slot, is_processing=act is not None,
                    n_past=info.pop("n_past", 0), n_cached=len(self.backend.cached_tokens(i)),
                    speculative=bool(info.pop("speculative", False)), spec=info, params=dict(st.params),
                    next_token={
                        "has_next_token": act is not None, "n_remain": st.n_remain, "n_decoded": st.n_decoded,
                        "stopped_eos": st.stopped == "eos", "stopped_word": st.stopped == "word",
                        "stopped_limit": st.stopped == "limit", "stopping_word": st.stopping_word,
                    },
                    n_checkpoints=int(info.pop("n_checkpoints", 0)),
                    checkpoint_bytes=int(info.pop("checkpoint_bytes", 0)),
                ))
            return out

    @property
    def requests_processing(self) -> int:
        return len(self._active)

    @property
    def requests_deferred(self) -> int:
        return len(self._queue)

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            self._wakeup.notify_all()
        self._thread.join(timeout)

    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify_all()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._active and not self._queue:
                    self._wakeup.wait(1.0)
                if self._closed:
                    break
                self._drop_cancelled_queued()
                self._expire_queued()
                admitted = self._admit()
            for act in admitted:
                self._begin(act)
            self._reap_cancelled()
            if not self._active:
                if self._queue:
                    with self._lock:
                        self._wakeup.wait(0.05)  # only pinned requests waiting on busy slots
                continue
            self._iterate()
        for act in list(self._active.values()):
            self._end(act, "cancelled")
        with self._lock:
            pending = list(self._queue)
            self._queue.clear()
        for handle, _ in pending:
            self._emit(handle, self._finished_unassigned(handle, "cancelled"))

    def _emit(self, handle: RequestHandle, ev: Event) -> None:
        handle._emit(ev)
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:
                log.exception("event listener failed")

    def _finished_unassigned(self, handle: RequestHandle, reason: str, error: str | None = None,
                             status: int = 0) -> Finished:
        return Finished(task=handle.task, slot=-1, finish_reason=reason, prompt_tokens=len(handle.request.prompt),
                        completion_tokens=0, timings=Timings(0, 0, 0.0, 0, 0.0, n_ctx=self.n_ctx_slot),
                        error=error, error_status=status)

    def _drop_cancelled_queued(self) -> None:
        keep = deque()
        for handle, t in self._queue:
            if handle.cancelled:
                self._emit(handle, self._finished_unassigned(handle, "cancelled"))
            else:
                keep.append((handle, t))
        self._queue = keep

    def _expire_queued(self) -> None:
        now = time.monotonic()
        keep = deque()
        for handle, t in self._queue:
            if now - t > self.queue_timeout_s:
                self._emit(handle, self._finished_unassigned(
                    handle, "error", f"queue: no slot became free within {self.queue_timeout_s:g} s", 503))
            else:
                keep.append((handle, t))
        self._queue = keep

    def _admit(self) -> list[tuple[RequestHandle, int]]:
        """Assign queued requests to idle slots in arrival order (§6.1); a pinned request waits for its
        own slot and does not block the unpinned ones behind it."""
        idle = [i for i in range(self.n_slots) if i not in self._active]
        out: list[tuple[RequestHandle, int]] = []
        keep = deque()
        for handle, t in self._queue:
            slot = self._choose_slot(handle.request, idle)
            if slot is None:
                keep.append((handle, t))
                continue
            idle.remove(slot)
            self._slots[slot].task = handle.task
            out.append((handle, slot))
        self._queue = keep
        return out

    def _choose_slot(self, req: GenerationRequest, idle: list[int]) -> int | None:
        if req.slot is not None:
            return req.slot if req.slot in idle else None
        if not idle:
            return None
        best, best_len = None, 0
        for i in idle:
            n = common_prefix(self.backend.cached_tokens(i), req.prompt)
            if n > best_len:
                best, best_len = i, n
        if best is not None:
            return best
        return min(idle, key=lambda i: self._slots[i].last_used)

    def _begin(self, item: tuple[RequestHandle, int]) -> None:
        handle, slot = item
        req = handle.request
        mtp = req.mtp or self.default_mtp
        if req.mtp_adaptive is not None and mtp in ("on", "adaptive", "auto"):
            mtp = "adaptive" if req.mtp_adaptive else ("on" if mtp == "adaptive" else mtp)
        n_draft = self.default_draft if req.n_draft is None else req.n_draft
        if n_draft == 0:
            mtp = "off"
        t0 = time.monotonic()
        try:
            text = self._text_factory(req.stop)
            cache_n = self.backend.begin(slot, handle.task, req, mtp, n_draft)
        except Exception as exc:
            log.exception("task %d: could not start on slot %d", handle.task, slot)
            self._safe_abort(slot)
            self._slots[slot].task = -1
            self._emit(handle, self._finished_unassigned(handle, "error", f"engine: {exc}", 500))
            return
        act = _Active(handle=handle, slot=slot, text=text, cache_n=cache_n, n_prompt=len(req.prompt),
                      prompt_left=len(req.prompt) - cache_n, t_start=t0)
        st = self._slots[slot]
        st.params = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
                     "seed": req.seed, "n_predict": req.max_tokens, "stop": list(req.stop), "mtp": mtp,
                     "n_draft": n_draft}
        st.n_decoded, st.n_remain, st.stopped, st.stopping_word, st.stats = 0, req.max_tokens, "", "", act.stats
        with self._lock:
            self._active[slot] = act
        self._emit(handle, Assigned(task=handle.task, slot=slot, cache_n=cache_n, n_prompt=len(req.prompt)))

    def _reap_cancelled(self) -> None:
        for act in [a for a in self._active.values() if a.handle.cancelled]:
            self._end(act, "cancelled")

    def _iterate(self) -> None:
        acts = list(self._active.values())
        slots = [a.slot for a in acts]
        budgets = [a.handle.request.max_tokens - len(a.generated) for a in acts]
        try:
            results = self.backend.step(slots, budgets)
        except Exception as exc:
            # A fault inside the batched forward may have touched every slot in it: fail those requests,
            # reset their slots; the thread, the queue and later requests carry on (E10).
            log.exception("engine iteration failed for slots %s", slots)
            for act in acts:
                self._end(act, "error", error=f"engine: {type(exc).__name__}: {exc}", status=500)
            return
        self.n_decode_total += 1
        self.n_busy_slots_total += len(acts)
        now = time.monotonic()
        for act in acts:
            res = results.get(act.slot)
            if res is None:
                continue
            if isinstance(res, Exception):
                self._end(act, "error", error=f"engine: {type(res).__name__}: {res}", status=500)
                continue
            if act.prompt_left > 0:
                act.prompt_left -= res.prompt_processed
                if act.prompt_left <= 0:
                    act.t_prompt_done = now
            for ev in res.events:
                act.stats.add(ev)
                self._emit(act.handle, ev)
            if self._consume_tokens(act, res):
                continue
            if act.handle.cancelled:
                self._end(act, "cancelled")

    def _consume_tokens(self, act: _Active, res) -> bool:
        """Feed new tokens through the detokenizer and stop matcher; True when the request ended."""
        req = act.handle.request
        st = self._slots[act.slot]
        if not res.tokens:
            return False
        if act.t_prompt_done == 0.0:
            act.t_prompt_done = time.monotonic()
        n_new = len(res.tokens)
        out_ids: list[int] = []
        out_text: list[str] = []
        for j, tok in enumerate(res.tokens):
            is_eos = res.eos and j == n_new - 1
            if is_eos and not req.ignore_eos:
                act.generated.append(tok)
                break
            text, stop_word = act.text.push(tok)
            act.generated.append(tok)
            out_ids.append(tok)
            if text:
                out_text.append(text)
            if stop_word is not None:
                act.stopping_word = stop_word
                self._flush_delta(act, out_ids, out_text)
                st.n_decoded = len(act.generated)
                self._end(act, "stop", stopped="word")
                return True
        st.n_decoded = len(act.generated)
        st.n_remain = req.max_tokens - len(act.generated)
        if res.eos and not req.ignore_eos:
            out_text.append(act.text.flush())
            self._flush_delta(act, out_ids, out_text)
            self._end(act, "stop", stopped="eos")
            return True
        if len(act.generated) >= req.max_tokens:
            out_text.append(act.text.flush())
            self._flush_delta(act, out_ids, out_text)
            self._end(act, "length", stopped="limit")
            return True
        self._flush_delta(act, out_ids, out_text)
        return False

    def _flush_delta(self, act: _Active, ids: list[int], texts: list[str]) -> None:
        text = "".join(texts)
        if ids or text:
            self._emit(act.handle, TextDelta(task=act.handle.task, token_ids=tuple(ids), text=text))
        ids.clear()
        texts.clear()

    def _safe_abort(self, slot: int) -> None:
        try:
            self.backend.abort(slot)
        except Exception:
            log.exception("slot %d: abort failed", slot)

    def _end(self, act: _Active, reason: str, *, stopped: str = "", error: str | None = None,
             status: int = 0) -> None:
        slot = act.slot
        if reason in ("stop", "length"):
            try:
                self.backend.finish(slot, len(act.generated))
            except Exception:
                log.exception("slot %d: finish failed", slot)
                self._safe_abort(slot)
        else:
            self._safe_abort(slot)
        now = time.monotonic()
        t_pd = act.t_prompt_done or now
        stats = act.stats
        timings = Timings(
            cache_n=act.cache_n, prompt_n=act.n_prompt - act.cache_n, prompt_ms=1e3 * (t_pd - act.t_start),
            predicted_n=len(act.generated), predicted_ms=1e3 * (now - t_pd) if act.generated else 0.0,
            draft_n=stats.drafted, draft_n_accepted=stats.accepted,
            draft_by_depth=tuple(zip(stats.drafts_per_pos, stats.accepted_per_pos, strict=True)),
            n_ctx=self.n_ctx_slot, n_past=act.n_prompt + len(act.generated),
        )
        st = self._slots[slot]
        st.stopped, st.stopping_word, st.last_used = stopped, act.stopping_word, now
        with self._lock:
            del self._active[slot]
            st.task = -1
        fin = Finished(task=act.handle.task, slot=slot, finish_reason=reason, prompt_tokens=act.n_prompt,
                       completion_tokens=len(act.generated), timings=timings, stopping_word=act.stopping_word,
                       error=error, error_status=status, spec=stats.as_dict())
        self._emit(act.handle, fin)
        self._wake()

