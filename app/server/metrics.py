"""Prometheus exposition for `GET /metrics` (spec/mtp-speculation.md §7.4).

llama.cpp's server-wide set under the `mtpchat:` prefix, vLLM's speculative counters labelled by
`model_name` and `slot` (plus `drafts_per_pos` so the true per-position rate can be computed), the gate
gauge, and request latency histograms. Updated from scheduler events on the engine thread.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

from engine.scheduler.types import Assigned, Finished, TextDelta
from engine.spec.events import GATE_GAUGE, RoundEvent

P = "mtpchat:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LiveGauges(Collector):
    """Gauges read from the scheduler at scrape time."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        yield GaugeMetricFamily(P + "requests_processing", "Requests running on a slot.",
                                value=self.scheduler.requests_processing)
        yield GaugeMetricFamily(P + "requests_deferred", "Requests waiting for a slot.",
                                value=self.scheduler.requests_deferred)
        n = self.scheduler.n_decode_total
        yield GaugeMetricFamily(P + "n_busy_slots_per_decode", "Average busy slots per engine iteration.",
                                value=self.scheduler.n_busy_slots_total / n if n else 0.0)


class ServerMetrics:
    def __init__(self, scheduler, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # prometheus_client appends _total to counters itself; names below are without it.
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.prompt_seconds = Counter(P + "prompt_seconds", "Prompt processing time.", registry=r)
        self.tokens_predicted = Counter(P + "tokens_predicted", "Generated tokens.", registry=r)
        self.tokens_predicted_seconds = Counter(P + "tokens_predicted_seconds", "Generation time.", registry=r)
        self.n_decode = Counter(P + "n_decode", "Speculative rounds and plain steps.", registry=r)
        self.prompt_tps = Gauge(P + "prompt_tokens_seconds", "Prompt tokens/s of the last request.", registry=r)
        self.predicted_tps = Gauge(P + "predicted_tokens_seconds", "Generation tokens/s of the last request.",
                                   registry=r)
        labels = ("model_name", "slot")
        self.drafts = Counter(P + "spec_decode_num_drafts", "Speculative rounds (k > 0).", labels, registry=r)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                    registry=r)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds that accepted draft position i.", (*labels, "position"),
                                        registry=r)
        self.drafts_per_pos = Counter(P + "spec_decode_num_drafts_per_pos", "Rounds that drafted position i.",
                                      (*labels, "position"), registry=r)
        self.gate_state = Gauge(P + "mtp_gate_state", "MTP gate: 0 on, 1 collecting the no-MTP baseline, 2 off.",
                                ("slot",), registry=r)
        self.gate_disabled = Counter(P + "mtp_gate_disabled", "Times the gate turned MTP off.", ("reason",),
                                     registry=r)
        self.requests = Counter(P + "requests", "Finished requests by finish reason.", ("finish_reason",),
                                registry=r)
        self.latency = Histogram(P + "request_latency_seconds", "Submit to last token.", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Submit to first token.", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        r.register(_LiveGauges(scheduler))
        for i in range(scheduler.n_slots):
            self.gate_state.labels(slot=str(i)).set(0)
        self._t_submit: dict[int, float] = {}
        self._first: set[int] = set()

    def submitted(self, task: int) -> None:
        self._t_submit[task] = time.monotonic()

    def on_event(self, ev) -> None:
        """Scheduler listener (engine thread)."""
        if isinstance(ev, RoundEvent):
            self._round(ev)
        elif isinstance(ev, TextDelta):
            if ev.task not in self._first and ev.task in self._t_submit:
                self._first.add(ev.task)
                self.ttft.observe(time.monotonic() - self._t_submit[ev.task])
        elif isinstance(ev, Finished):
            self._finished(ev)
        elif isinstance(ev, Assigned):
            pass

    def _round(self, ev: RoundEvent) -> None:
        slot = str(ev.slot)
        self.n_decode.inc()
        self.gate_state.labels(slot=slot).set(GATE_GAUGE.get(ev.gate_state, 0))
        if ev.gate_change in ("low acceptance", "slower than no-MTP"):
            self.gate_disabled.labels(reason=ev.gate_change).inc()
        if ev.k == 0:
            return
        lab = {"model_name": self.model_name, "slot": slot}
        counted = min(ev.accepted, ev.emitted)
        self.drafts.labels(**lab).inc()
        self.draft_tokens.labels(**lab).inc(ev.k)
        self.accepted.labels(**lab).inc(counted)
        for i in range(ev.k):
            self.drafts_per_pos.labels(**lab, position=str(i)).inc()
            if i < counted:
                self.accepted_per_pos.labels(**lab, position=str(i)).inc()

    def _finished(self, ev: Finished) -> None:
        t0 = self._t_submit.pop(ev.task, None)
        self._first.discard(ev.task)
        self.requests.labels(finish_reason=ev.finish_reason).inc()
        if t0 is not None:
            self.latency.observe(time.monotonic() - t0)
        t = ev.timings
        if ev.slot < 0:
            return
        self.prompt_tokens.inc(t.prompt_n)
        self.prompt_seconds.inc(t.prompt_ms / 1e3)
        self.tokens_predicted.inc(t.predicted_n)
        self.tokens_predicted_seconds.inc(t.predicted_ms / 1e3)
        if t.prompt_ms > 0:
            self.prompt_tps.set(1e3 * t.prompt_n / t.prompt_ms)
        if t.predicted_ms > 0:
            self.predicted_tps.set(1e3 * t.predicted_n / t.predicted_ms)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
