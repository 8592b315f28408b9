"""Side-by-side decode speed of MTP configurations in one process (`mtpchat bench`).

Every configuration runs on the same prompts, interleaved (A B C A B C ..., the order rotated per
prompt) so machine drift hits all of them alike; figures are medians over prompts and repeats.
Optionally every draft is replaced by a wrong token, which measures the pure overhead of speculation.
With compiled steps a warm-up runs first; a timed run that still meets a kind of step not compiled yet
(a step-1 length that only a policy carried across requests produces) is run again once it is compiled.
Returns plain dicts; never prints.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.bench.speed import bytes_per_decode_step, measure_read_bandwidth, weight_inventory
from engine.sampling import SamplingParams
from engine.spec.decode import SpecDecoder, SpecOptions
from engine.spec.events import SpecStats
from engine.spec.policy import AutoPolicy
from engine.spec.stops import StopRule

# wall: perf_counter; cpu: this thread's CPU time (stable on a loaded machine when torch runs one thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
RERUN_MAX = 3   # times a timed run that compiled a kind of step (or ran one eager) is run again


@dataclass(frozen=True)
class BenchConfig:
    mode: str
    k: int

    @property
    def name(self) -> str:
        return "off" if self.mode == "off" else f"{self.mode}/k={self.k}"


def configurations(modes: Sequence[str], drafts: Sequence[int]) -> list[BenchConfig]:
    out = [BenchConfig("off", 0)] if "off" in modes else []
    out += [BenchConfig(m, k) for m in modes if m != "off" for k in drafts]
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of the population xs were drawn from: the
    order statistics x_(j) and x_(n+1-j) with the largest j whose tails each hold at most (1 - level) / 2
    of Binomial(n, 1/2) (so the coverage is at least `level`). None when n is too small for it (n < 6 at
    95 %)."""
    n = len(xs)
    if n == 0 or not 0 < level < 1:
        return None
    tail, cum, j = (1.0 - level) / 2.0, 0.0, 0
    while j < n:
        cum += math.comb(n, j) / 2.0 ** n           # P(X <= j), X ~ Binomial(n, 1/2)
        if cum > tail:
            break
        j += 1
    if j == 0:
        return None
    ys = sorted(xs)
    return ys[j - 1], ys[n - j]


def paired_ratios(runs: dict, off: dict) -> dict | None:
    """Per-run ratios to `off` for runs of the same prompt in the same repeat (run back to back, so a drift of
    the machine's speed hits both): their median, a 95 % interval for it (`median_ci`) and their count."""
    ratios = [tps / off[key] for key, tps in runs.items() if off.get(key)]
    if not ratios:
        return None
    ci = median_ci(ratios)
    return {"median": statistics.median(ratios), "ci95": list(ci) if ci else None, "n": len(ratios)}


def run_bench(model, prompts: Sequence[Sequence[int]], configs: Sequence[BenchConfig], *, max_tokens: int,
              repeats: int = 1, wrong_drafts: bool = False, hidden: str = "post-norm",
              eos_ids: frozenset[int] = frozenset(), progress: Callable[[int, int], None] | None = None,
              clock: str = "wall", sampling: SamplingParams = SamplingParams()) -> dict:
    """Every configuration on every prompt, `repeats` times, interleaved. With sampling (temperature > 0)
    every configuration's run of a prompt in a repeat draws from one seed (`run_seed`): each position is drawn
    at its own uniform (spec §3.3), so they emit the same text and their times compare like for like."""
    # wrong drafts: every draft is (its argmax + 1) mod vocab, made inside the chain's own call
    # (`set_wrong_drafts`), so rounds keep drafting and verifying in one compiled graph as real
    # rejected rounds do (a draft hook between the calls forced the slower unfused path)
    before = model.wrong_drafts
    model.set_wrong_drafts(wrong_drafts)
    try:
        return _run(model, prompts, configs, max_tokens=max_tokens, repeats=repeats, wrong_drafts=wrong_drafts,
                    hidden=hidden, eos_ids=eos_ids, progress=progress, clock=clock, sampling=sampling)
    finally:
        model.set_wrong_drafts(before)


def run_seed(rep: int, prompt_index: int, n_prompts: int) -> int:
    """The sampling seed of every configuration's run of one prompt in one repeat."""
    return rep * n_prompts + prompt_index


def _run(model, prompts, configs, *, max_tokens, repeats, wrong_drafts, hidden, eos_ids, progress, clock,
         sampling) -> dict:
    # "tps": each kept run's decode tok/s by (repeat, prompt index)
    per: dict[str, dict] = {c.name: {"tps": {}, "tokens": {}, "stats": SpecStats(), "plain_s": [], "verify_s": {},
                                     "draft_s": [], "post_s": [], "cache_bytes": 0, "cuda_peak": 0, "fused": 0}
                            for c in configs}
    total, done = repeats * len(prompts) * len(configs), 0
    cuda = model.device.type == "cuda"
    # `auto` keeps what it learnt across requests on a slot (engine/scheduler): one policy per
    # configuration here too, carried from run to run; on/adaptive decide per request anyway
    policies = {c.name: AutoPolicy(k_max=max(c.k, 1)) for c in configs if c.mode == "auto"}

    def factory(cfg: BenchConfig):
        if cfg.mode != "auto":
            return None
        pol = policies[cfg.name]

        def make(_i: int) -> AutoPolicy:
            pol.new_request()
            return pol
        return make

    def options(cfg: BenchConfig, **extra) -> SpecOptions:
        return SpecOptions(mode=cfg.mode, n_draft=max(cfg.k, 1), hidden=hidden, **extra)

    steps = getattr(model, "_steps", None)
    if steps is not None:
        # compiled steps (in the background, or on first use with `--steps compiled`): run every
        # configuration until no kind of step is left to compile, so the timed runs measure compiled
        # calls only, never a compile (a foreground compile inside a timed round is seconds to minutes)
        # (every prompt: where a reply stops decides which verification and chain lengths occur)
        k_top = max([c.k for c in configs] + [1])
        warm = [BenchConfig("on", k) for k in range(1, k_top + 1)] + list(configs)   # every verify length
        for _ in range(4):
            before = steps.kinds_ready
            for cfg in warm:
                for i, prompt in enumerate(prompts):
                    SpecDecoder(model, options(cfg)).generate([prompt], StopRule(max_tokens=max_tokens, eos_ids=eos_ids),
                                                              dataclasses.replace(sampling, seed=run_seed(0, i, len(prompts))))
            steps.drain()
            if steps.kinds_ready == before:
                break
    counts0 = (steps.n_compiled_calls, steps.n_eager_calls, steps.kinds_ready) if steps is not None else None
    repeated = tainted = 0
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(configs)
            for cfg in list(configs[shift:]) + list(configs[:shift]):
                for attempt in range(RERUN_MAX + 1):
                    before = (steps.n_eager_calls, steps.kinds_ready) if steps is not None else None
                    run = _timed_run(model, prompt, cfg, options(cfg, clock=CLOCKS[clock], controller_factory=factory(cfg)),
                                     max_tokens, eos_ids, cuda,
                                     dataclasses.replace(sampling, seed=run_seed(rep, i, len(prompts))))
                    if steps is None or (steps.n_eager_calls, steps.kinds_ready) == before:
                        break
                    if attempt == RERUN_MAX:
                        tainted += 1
                        break
                    # the run met a kind of step the warm-up did not (a step-1 length only a policy carried
                    # across requests produces): it compiled inside the run (first use) or ran eager while
                    # the worker compiled it; its time is not the configuration's, so it runs again (an
                    # `auto` policy keeps what it learnt in the dropped run, as a slot would)
                    steps.drain()
                    repeated += 1
                _merge(per[cfg.name], run)
                per[cfg.name]["tps"][(rep, i)] = run["tps"]
                per[cfg.name]["tokens"][(rep, i)] = run["tokens"]
                done += 1
                if progress is not None:
                    progress(done, total)
    off_tps = _median(list(per["off"]["tps"].values())) if "off" in per else None
    off_step = _median(per["off"]["plain_s"]) if "off" in per else None
    rows = []
    for c in configs:
        acc = per[c.name]
        tps = _median(list(acc["tps"].values()))
        st = acc["stats"]
        verify = {n: _median(v) for n, v in sorted(acc["verify_s"].items())}
        draft = _median(acc["draft_s"])
        rows.append({
            "config": c.name, "mode": c.mode, "k": c.k,
            "decode_tps_median": tps,
            "ratio_to_off": tps / off_tps if tps and off_tps else None,
            # the same, prompt by prompt: each run against `off`'s run of that prompt in that repeat
            "ratio_to_off_paired": paired_ratios(acc["tps"], per["off"]["tps"]) if "off" in per else None,
            # runs whose tokens differ from `off`'s run of the same prompt and repeat: 0 greedy (F1) and sampled
            # (each prompt's runs share a seed, spec §3.3), but for a near-tie that the verification's numerics tip
            "runs_differing_from_off": sum(toks != per["off"]["tokens"].get(key) for key, toks in acc["tokens"].items())
            if "off" in per else None,
            "accepted_per_position": st.accepted_per_position,
            "accept_rate": st.accept_rate,
            "mean_accepted_length": st.mean_accepted_length,
            "rounds": st.rounds, "plain_steps": st.plain_steps,
            "plain_step_ms": _ms(_median(acc["plain_s"])),
            "verify_ms": {str(n): _ms(v) for n, v in verify.items()},
            "verify_over_plain_step": {str(n): v / off_step for n, v in verify.items()} if off_step else {},
            # rounds drafted and verified in one call (compiled steps): their verify_ms is the
            # whole call, k drafts included, and draft_step_ms covers the other rounds only
            "fused_rounds": acc["fused"],
            "draft_step_ms": _ms(draft),
            "draft_over_plain_step": draft / off_step if draft and off_step else None,
            "post_ms": _ms(_median(acc["post_s"])),
            "cache_mib": acc["cache_bytes"] / 2**20,
            "peak_cuda_mib": acc["cuda_peak"] / 2**20 if cuda else None,
            "runs": len(acc["tps"]),
        })
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # before the buffers below
    steps_doc = {**dict(zip(("path", "why"), model.steps_status, strict=True)),
                 # timed calls that ran compiled / eager (a kind first met in the timed runs runs eager
                 # while it compiles, and so does every step while the worker holds the tracer), and kinds
                 # of step that became ready during the timed runs, the repeated runs' calls included
                 **({"compiled_calls": steps.n_compiled_calls - counts0[0],
                     "eager_calls": steps.n_eager_calls - counts0[1],
                     "kinds_compiled_in_timed_runs": steps.kinds_ready - counts0[2],
                     # runs that met such a kind were run again once it was ready (up to RERUN_MAX times);
                     # kept_runs_with_a_compile counts those kept anyway (0 unless a run met new kinds every time)
                     "runs_repeated_after_a_compile": repeated, "kept_runs_with_a_compile": tainted}
                    if counts0 is not None else {})}
    # the calls of a round apart (spec §4's costs: a verification of k + 1 rows and a draft row in plain
    # steps), after the timed runs and outside their counts (a standalone verification is a kind of its own)
    calls = call_costs(model, prompts[0], sorted({c.k for c in configs if c.mode != "off"}), clock=clock) \
        if prompts else None
    return {
        "configs": rows,
        "prompts": len(prompts), "repeats": repeats, "max_tokens": max_tokens,
        "wrong_drafts": wrong_drafts, "hidden": hidden, "clock": clock,
        # None: greedy; else the sampling every run used (each prompt's runs sharing one seed: `run_seed`)
        "sampling": None if sampling.greedy else {"temperature": sampling.temperature, "top_k": sampling.top_k,
                                                  "top_p": sampling.top_p},
        "n_vocab": model.cfg.n_vocab,
        "draft_vocab": model.draft_vocab or model.cfg.n_vocab,     # token ids a draft chooses among
        "draft_weights": model.draft_weights,                      # exact or q8_0 (set_draft_weights)
        "peak_rss_mib": peak_rss_mib,
        # the machine's state, read right after the timed runs: on the same code and file the ratios move with
        # it (a machine whose weight reads slow down favours rounds, which read the weights once for k+1 rows)
        "bandwidth": read_bandwidth(model),
        "calls": calls,
        "threads": torch.get_num_threads(), "device": str(model.device), "dtype": str(model.dtype).split(".")[-1],
        "weights": weight_inventory(model),     # matrices per form: {"packed Q8_0": n, "dense float32": m}
        "steps": steps_doc,
        "auto_policy": "one per configuration, kept from run to run (as a server slot keeps it)",
    }


def call_costs(model, prompt: Sequence[int], ks: Sequence[int], *, clock: str = "wall", budget_s: float = 2.0,
               repeats: int = 7) -> dict | None:
    """The calls of a round measured apart, on this model as the bench runs it (its steps, draft weights and
    draft vocabulary), after the prompt: a plain step; the verification of k + 1 rows (with the GDN states
    of every row kept) for each k in `ks`; and draft chains of 1..max(ks) drafts (step 1 padded as the
    decoder pads it). A draft row's cost is the slope of the chains' times over k (least squares): what one
    more draft adds to a round, without the call's fixed host cost, which a fused round pays once for its
    drafts and its verification together. The kinds are called and, with compiled steps, made ready first;
    then `repeats` passes of n calls of each kind, interleaved, n set so that the timed calls take about
    `budget_s` in all. Medians in ms and over the plain step. None for a model without MTP or no k."""
    if not model.cfg.has_mtp or not ks:
        return None
    from engine.model.cache import ModelCache
    now = CLOCKS[clock]
    k_top = max(ks)
    dev = model.device
    cache = ModelCache(model.cfg, 1, len(prompt) + k_top + 16, device=dev, kv_dtype=torch.float32, mtp=True)
    with torch.inference_mode():
        # toks too: a compiled kind's guards tell inference tensors from others, and the decoder's prompt warm-up
        # (an MTP commit of the prompt's length, the same kind) passes inference tensors
        toks = torch.tensor([list(prompt)], dtype=torch.long, device=dev)
        out = model.forward(toks, cache, [0], logits="last")
        model.mtp_forward(toks, out.hidden, cache, [0], logits="none")
        tok = out.logits[:, -1:].argmax(-1)
        carry = out.hidden[:, -1:]
        n0, m0, snap = cache.lengths[0], cache.mtp_lengths[0], cache.snapshot_gdn(0)

        def reset() -> None:
            cache.truncate(0, n0)
            cache.truncate_mtp(0, m0)
            cache.restore_gdn(0, snap)

        def plain() -> None:
            int(model.forward(tok, cache, [0], logits="all").logits[0, -1].argmax())

        def verify(k: int) -> Callable[[], None]:
            rows = tok.repeat(1, k + 1)

            def call() -> None:
                int(model.forward(rows, cache, [0], logits="all", gdn_steps=True).logits[0, -1].argmax())
            return call

        def chain(k: int) -> Callable[[], None]:
            def call() -> None:
                pad = model.step1_pad(cache, 0, 1, k)
                drafts, _ = model.draft_chain(tok.repeat(1, pad + 1), carry.expand(1, pad + 1, -1).contiguous(),
                                              cache, [0], k, pad=pad)
                int(drafts[0, -1])
            return call
        calls = {"plain": plain, **{f"verify{k}": verify(k) for k in sorted(set(ks))},
                 **{f"chain{k}": chain(k) for k in range(1, k_top + 1)}}
        steps = getattr(model, "_steps", None)
        for _ in range(2):                       # first use, then (compiled steps) once every kind is ready
            for fn in calls.values():
                fn()
                reset()
            if steps is not None:
                steps.drain()
        t0 = now()
        for fn in calls.values():
            fn()
            reset()
        per_call = max((now() - t0) / len(calls), 1e-6)
        n = max(1, min(50, round(budget_s / (repeats * len(calls) * per_call))))
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, fn in calls.items():
                ts = []
                for _ in range(n):
                    t0 = now()
                    fn()
                    ts.append(now() - t0)
                    reset()
                times[name].append(statistics.median(ts))
    med = {name: statistics.median(v) for name, v in times.items()}
    plain_s = med["plain"]
    xs = list(range(1, k_top + 1))
    ys = [med[f"chain{k}"] for k in xs]
    slope = None
    if len(xs) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {
        "plain_step_ms": plain_s * 1e3,
        "verify_ms": {str(k + 1): med[f"verify{k}"] * 1e3 for k in sorted(set(ks))},
        "verify_over_plain_step": {str(k + 1): med[f"verify{k}"] / plain_s for k in sorted(set(ks))},
        "chain_ms": {str(k): med[f"chain{k}"] * 1e3 for k in xs},
        # one more draft in a chain (None with chains of one length only)
        "draft_row_ms": None if slope is None else slope * 1e3,
        "draft_row_over_plain_step": None if slope is None else slope / plain_s,
        "calls_per_pass": n, "passes": repeats, "clock": clock,
    }


def _timed_run(model, prompt, cfg: BenchConfig, opts: SpecOptions, max_tokens: int, eos_ids, cuda: bool,
               sampling: SamplingParams) -> dict:
    """One request of one configuration: its decode tokens/s, its events' timings, its stats."""
    run: dict = {"plain_s": [], "verify_s": {}, "draft_s": [], "post_s": [], "fused": 0}
    dec = SpecDecoder(model, opts)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for ev in dec.stream([prompt], StopRule(max_tokens=max_tokens, eos_ids=eos_ids), sampling):
        if ev.k == 0:
            run["plain_s"].append(ev.round_s)
        else:
            run["verify_s"].setdefault(ev.k + 1, []).append(ev.verify_s)
            if ev.draft_s > 0:     # 0: drafted inside the verification's call (a fused round)
                run["draft_s"].append(ev.draft_s / ev.k)
            else:
                run["fused"] += 1
            run["post_s"].append(ev.rollback_s)
    res = dec.results()[0]
    run["cuda_peak"] = torch.cuda.max_memory_allocated() if cuda else 0
    run["tps"] = res.decode_tokens_per_second
    run["tokens"] = res.tokens
    run["cache_bytes"] = dec.cache.nbytes()
    run["stats"] = res.stats
    return run


def _merge(acc: dict, run: dict) -> None:
    """Add one kept run to its configuration's totals."""
    for f in ("plain_s", "draft_s", "post_s"):
        acc[f].extend(run[f])
    for n, v in run["verify_s"].items():
        acc["verify_s"].setdefault(n, []).extend(v)
    acc["fused"] += run["fused"]
    acc["cuda_peak"] = max(acc["cuda_peak"], run["cuda_peak"])
    acc["cache_bytes"] = max(acc["cache_bytes"], run["cache_bytes"])
    st, rs = acc["stats"], run["stats"]
    for f in ("rounds", "plain_steps", "drafted", "accepted"):
        setattr(st, f, getattr(st, f) + getattr(rs, f))
    for j, (d, a) in enumerate(zip(rs.drafts_per_pos, rs.accepted_per_pos, strict=True)):
        while len(st.drafts_per_pos) <= j:
            st.drafts_per_pos.append(0)
            st.accepted_per_pos.append(0)
        st.drafts_per_pos[j] += d
        st.accepted_per_pos[j] += a


def read_bandwidth(model) -> dict:
    """GB/s (median of 9) of `torch.sum` over a buffer of one decode step's weight bytes (where a small
    model's weights stay: the caches) and over 256 MiB (memory), with the current torch threads."""
    step = bytes_per_decode_step(model)
    step_mib = max(1, -(-step // (1 << 20)))
    scale = 16 if model.device.type == "cuda" else 1     # measure_read_bandwidth's buffer on a GPU

    def gbs(mib: int) -> float:
        return round(statistics.median(measure_read_bandwidth(mib, device=model.device)), 2)
    return {"decode_step_bytes": step, "step_sized_mib": step_mib * scale, "step_sized_gbs": gbs(step_mib),
            "memory_mib": 256 * scale, "memory_gbs": gbs(256)}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3
