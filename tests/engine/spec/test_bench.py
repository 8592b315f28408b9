"""`run_bench` (engine/spec/bench.py): with compiled steps, no kind of step compiles inside a timed run."""

from __future__ import annotations

import pytest

from engine.model.steps import CompiledSteps
from engine.spec.bench import configurations, median_ci, paired_ratios, run_bench
from tests.engine.model.conftest import get_model, get_ref

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FirstUseSteps:
    """Stands in for `--steps compiled` (engine.model.steps.CompiledSteps with background=False), which
    compiles each kind of call the first time it meets it, blocking: every call here runs eager (the
    stand-in returns None) and records its kind, so a test sees where each kind was first met."""

    background = False
    step1_rows = staticmethod(CompiledSteps.step1_rows)      # the real steps' padded draft step-1 length

    def __init__(self):
        self.kinds: set[tuple] = set()
        self.n_compiled_calls = self.n_eager_calls = 0

    def status(self) -> tuple[str, str]:
        return "eager", "test stand-in for steps compiled on first use"

    @property
    def kinds_ready(self) -> int:
        return len(self.kinds)

    def drain(self, timeout=None) -> bool:
        return True

    def _met(self, *key) -> None:
        self.kinds.add(key)
        self.n_compiled_calls += 1

    def main(self, tokens, cache, slot_idx, positions, n_keys, single, logits, chunk, gdn_steps):
        return self._met("main", tuple(tokens.shape), logits, gdn_steps)

    def mtp(self, tokens, hidden, cache, slot_idx, positions, n_keys, single, logits, n):
        return self._met("mtp", tuple(tokens.shape), logits)

    def chain(self, tokens, hidden, cache, slot_idx, positions, n_keys, single, k, n):
        return self._met("chain", tuple(tokens.shape), k)

    def round(self, *args):
        raise AssertionError("a round in one call runs with compiled steps only")


@pytest.mark.parametrize("wrong", [False, True])
def test_steps_compiled_on_first_use_are_met_before_the_timed_runs(wrong):
    model = get_model("models/tiny-qwen35-f32.gguf")
    ref = get_ref("ref/tiny-qwen35.npz")
    prompts = [ref[f"prompt_{n}"].tolist() for n in (7, 33)]
    steps = FirstUseSteps()
    model._steps = steps
    try:
        doc = run_bench(model, prompts, configurations(["off", "on", "adaptive", "auto"], [3]),
                        max_tokens=16, wrong_drafts=wrong, clock="cpu")
    finally:
        model._steps = None
    assert steps.kinds_ready >= 6          # plain steps, verifications of 3 and 4 rows, MTP passes, chains
    st = doc["steps"]
    # the warm-up runs fresh policies; `auto`'s policy in the timed runs is kept from request to request,
    # and its probes (after plain steps of earlier requests) may meet an MTP backlog length the warm-up
    # did not: such a run is repeated once the kind is ready, and none with a compile is kept
    assert st["kinds_compiled_in_timed_runs"] <= st["runs_repeated_after_a_compile"], st
    assert st["kept_runs_with_a_compile"] == 0, st
    assert st["compiled_calls"] > 0
    by = {c["config"]: c for c in doc["configs"]}
    assert by["on/k=3"]["rounds"] > 0 and by["off"]["plain_steps"] > 0


def test_a_timed_run_that_compiles_runs_again(monkeypatch):
    """A timed run that meets a kind of step the warm-up did not (here: the second timed run, and every run
    of `on/k=2` after the warm-up) is run again once the kind is ready; only the repeat is kept, and a run
    that meets new kinds every time is kept after RERUN_MAX repeats and counted."""
    import engine.spec.bench as bench

    model = get_model("models/tiny-qwen35-f32.gguf")
    ref = get_ref("ref/tiny-qwen35.npz")
    prompts = [ref[f"prompt_{n}"].tolist() for n in (7, 33)]
    steps = FirstUseSteps()
    real = bench._timed_run
    calls = {"timed": 0}

    def timed_run(model, prompt, cfg, *args):
        run = real(model, prompt, cfg, *args)
        calls["timed"] += 1
        if calls["timed"] == 2 or cfg.name == "on/k=2":
            steps.kinds.add(("late", calls["timed"]))     # a kind first met (compiled) inside this run
            run["tps"] = -1.0                              # a figure that must not be kept
        return run

    monkeypatch.setattr(bench, "_timed_run", timed_run)
    model._steps = steps
    try:
        doc = run_bench(model, prompts, configurations(["off", "on"], [3]) + [bench.BenchConfig("on", 2)],
                        max_tokens=8, repeats=2, clock="cpu")
    finally:
        model._steps = None
    st = doc["steps"]
    per_k2 = 2 * len(prompts)                              # runs of on/k=2, each met a new kind every time
    assert st["kept_runs_with_a_compile"] == per_k2
    assert st["runs_repeated_after_a_compile"] == 1 + per_k2 * bench.RERUN_MAX
    assert st["kinds_compiled_in_timed_runs"] == 1 + per_k2 * (bench.RERUN_MAX + 1)
    assert calls["timed"] == 3 * 2 * len(prompts) + st["runs_repeated_after_a_compile"]
    by = {c["config"]: c for c in doc["configs"]}
    for name in ("off", "on/k=3"):
        assert by[name]["runs"] == 2 * len(prompts)
        assert by[name]["decode_tps_median"] > 0           # the run with the compile was not kept
    assert by["on/k=2"]["decode_tps_median"] == -1.0       # kept after RERUN_MAX repeats, and counted


def test_the_interval_for_a_median_uses_binomial_order_statistics():
    assert median_ci(list(range(24, 0, -1))) == (7, 18)     # P(X <= 6) = 0.011, P(X <= 7) = 0.032 at n = 24
    assert median_ci([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None      # 2 / 32 > 5 %: no interval at 95 % from 5 values
    assert median_ci([]) is None


def test_the_interval_for_a_median_covers_it_at_least_as_often_as_it_says():
    """Skewed samples (exponential, median ln 2) of the bench's usual 24 runs: the interval holds the true
    median in >= 95 % of 3,000 draws (97.7 % by the binomial; one order statistic further in, 93.6 %)."""
    import math
    import random

    rng = random.Random(5)
    hits = 0
    for _ in range(3000):
        lo, hi = median_ci([rng.expovariate(1.0) for _ in range(24)])
        hits += lo <= math.log(2) <= hi
    assert hits / 3000 >= 0.96, hits


def test_paired_ratios_compare_runs_of_the_same_prompt_and_repeat():
    off = {(0, 0): 100.0, (0, 1): 50.0, (1, 0): 110.0, (1, 1): 55.0}
    on = {(0, 0): 120.0, (0, 1): 65.0, (1, 0): 121.0, (1, 1): 60.5, (2, 0): 999.0}   # (2, 0): no off run
    p = paired_ratios(on, off)
    assert p["n"] == 4 and p["ci95"] is None
    assert p["median"] == pytest.approx((1.2 + 1.1) / 2)      # ratios 1.2, 1.3, 1.1, 1.1
    assert paired_ratios({}, off) is None


def test_call_costs_time_each_kind_of_call_apart_and_fit_a_draft_row(monkeypatch):
    """`call_costs`: a plain step, verifications of k + 1 rows and chains of 1..max k drafts, each kind met
    (made ready) before it is timed, step 1 of a chain padded as the decoder pads it; a draft row is the
    least-squares slope of the chains' times over k. A clock advanced by known amounts per call checks the
    arithmetic."""
    import engine.spec.bench as bench

    model = get_model("models/tiny-qwen35-f32.gguf")
    ref = get_ref("ref/tiny-qwen35.npz")
    prompt = ref["prompt_7"].tolist()
    t = [0.0]
    monkeypatch.setitem(bench.CLOCKS, "fake", lambda: t[0])
    real_forward, real_chain = model.forward, model.draft_chain

    def forward(tokens, *a, **kw):
        t[0] += 1e-3 if tokens.shape[1] == 1 else 1e-3 * (1 + 0.25 * (tokens.shape[1] - 1))
        return real_forward(tokens, *a, **kw)

    def chain(tokens, hidden, cache, slots, k, **kw):
        t[0] += 1e-4 * (3 + [0, 2, 3, 5][k])            # slope over k = 1..3: 1.5e-4 s a draft
        return real_chain(tokens, hidden, cache, slots, k, **kw)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(model, "draft_chain", chain)
    steps = FirstUseSteps()
    model._steps = steps
    try:
        doc = bench.call_costs(model, prompt, [3, 1], clock="fake", repeats=3)
        met = set(steps.kinds)
        assert bench.call_costs(model, prompt, [], clock="fake") is None
    finally:
        model._steps = None
    assert doc["plain_step_ms"] == pytest.approx(1.0)
    assert doc["verify_ms"] == pytest.approx({"2": 1.25, "4": 1.75})
    assert doc["verify_over_plain_step"] == pytest.approx({"2": 1.25, "4": 1.75})
    assert doc["chain_ms"] == pytest.approx({"1": 0.5, "2": 0.6, "3": 0.8})
    assert doc["draft_row_ms"] == pytest.approx(0.15) and doc["draft_row_over_plain_step"] == pytest.approx(0.15)
    assert doc["passes"] == 3 and doc["calls_per_pass"] >= 1 and doc["clock"] == "fake"
    rows = CompiledSteps.step1_rows
    assert {("chain", (1, rows(k)), k) for k in (1, 2, 3)} <= met          # padded, as rounds pad them
    assert {("main", (1, n), "all", True) for n in (2, 4)} <= met          # verifications keep every GDN state
    assert ("main", (1, 1), "all", False) in met


def test_call_costs_need_an_mtp_model():
    from types import SimpleNamespace

    from engine.spec.bench import call_costs

    assert call_costs(SimpleNamespace(cfg=SimpleNamespace(has_mtp=False)), [1, 2, 3], [3]) is None
