"""Compiled decode steps (engine/model/steps.py): the same greedy tokens and logits (1e-3 relative) as
the eager path on the fixture models, for plain decoding, MTP rounds and several sequences; the
background mode runs eager until a kind of step is compiled; every failure falls back to eager."""

from __future__ import annotations

import logging
import statistics
import time

import pytest
import torch

import engine.model.layers as layers
import engine.model.steps as steps_mod
from engine.errors import InputError
from engine.kernels import codegen
from engine.model import ModelCache, load_model
from engine.spec.decode import SpecDecoder, SpecOptions
from engine.spec.stops import StopRule
from tests.conftest import fixture_path
from tests.engine.model.conftest import get_ref

needs_cxx = pytest.mark.skipif(steps_mod._cxx() is None, reason="no C++ compiler for torch.compile's CPU backend")

MODELS = {"dense": ("models/tiny-qwen35-f32.gguf", "ref/tiny-qwen35.npz"),
          "moe": ("models/tiny-qwen35moe-q8_0.gguf", "ref/tiny-qwen35moe.npz"),
          "q8_0": ("models/tiny-qwen35-q8_0.gguf", "ref/tiny-qwen35.npz"),
          "q6_k": ("models/tiny-qwen35-q6_k.gguf", "ref/tiny-qwen35.npz"),
          "q4_k_m": ("models/tiny-qwen35-q4_k_m.gguf", "ref/tiny-qwen35.npz"),
          "iq4_xs": ("models/tiny-qwen35-iq4_xs.gguf", "ref/tiny-qwen35.npz")}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(ref):
    s = ref["ppl_tokens"]
    return [ref["prompt_7"].tolist(), ref["prompt_33"].tolist(), s[4000:4021].tolist()]


def _gen(model, prompts, mode, k, n=32):
    dec = SpecDecoder(model, SpecOptions(mode=mode, n_draft=k))
    return [r.tokens for r in dec.generate(prompts, StopRule(max_tokens=n))]


def test_choose_modes(monkeypatch):
    monkeypatch.delenv("MTPCHAT_STEPS", raising=False)
    assert steps_mod.choose("eager", "cpu") == ("eager", "steps=eager")
    monkeypatch.setenv("MTPCHAT_STEPS", "eager")
    assert steps_mod.choose("auto", "cpu") == ("eager", "MTPCHAT_STEPS=eager")
    monkeypatch.delenv("MTPCHAT_STEPS")
    monkeypatch.setattr(steps_mod, "_cxx", lambda: None)
    path, why = steps_mod.choose("auto", "cpu")
    assert path == "eager" and "no C++ compiler" in why
    with pytest.raises(InputError, match="steps: compiled steps are not available here: no C\\+\\+ compiler"):
        steps_mod.choose("compiled", "cpu")
    with pytest.raises(InputError, match="steps: one of auto, compiled, eager"):
        steps_mod.choose("fast", "cpu")


@needs_cxx
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "dense" else pytest.mark.slow) for n in MODELS])
def test_compiled_steps_match_eager(name):
    """Foreground compilation: plain decoding and MTP rounds (k = 3, one and two sequences) give the
    eager path's greedy tokens; one decode step's logits agree within 1e-3 relative."""
    path, ref_path = MODELS[name]
    ref = get_ref(ref_path)
    eager = load_model(fixture_path(path))
    fast = load_model(fixture_path(path))
    assert fast.compile_steps("compiled", background=False)[0] == "compiled"
    prompts = _prompts(ref)
    for mode, k in (("off", 1), ("on", 3)):
        want = _gen(eager, prompts[:1], mode, k) + _gen(eager, prompts[1:], mode, k)
        got = _gen(fast, prompts[:1], mode, k) + _gen(fast, prompts[1:], mode, k)
        assert got == want, (name, mode)
    assert fast._steps.n_compiled_calls > 0 and fast.steps_status[0] == "compiled"
    # greedy rounds drafted and verified in one compiled graph (draft_and_verify), one and two sequences
    rounds = {key[1] is not None for key in fast._steps._ready if key[0] == "round"}
    assert rounds == {True, False}, fast._steps._ready
    # two sequences x (k + 1) = 8 rows: compiled for B = 2 (per-row products, as their plain steps)
    assert any(key[0] == "round" and key[-1] == 2 for key in fast._steps._ready), fast._steps._ready
    if name in ("dense", "moe"):    # the quantized files' greedy text differs from the f32 reference's
        assert got[0][:24] == ref["greedy_7"].tolist()
    with torch.inference_mode():
        caches = [ModelCache(m.cfg, 1, 64) for m in (eager, fast)]
        tok = torch.tensor([prompts[0]])
        outs = []
        for m, c in zip((eager, fast), caches, strict=True):
            m.forward(tok, c, logits="none")
            outs.append(m.forward(tok[:, :1], c, logits="all").logits)
    scale = outs[0].abs().max()
    assert (outs[1] - outs[0]).abs().max() <= 1e-3 * scale


@needs_cxx
@pytest.mark.parametrize("name", ["dense", pytest.param("q4_k_m", marks=pytest.mark.slow)])
def test_contracted_kernels_give_a_verifications_first_row_the_plain_steps_bits(name, monkeypatch):
    """Compiled steps on CPU build their kernels with -ffp-contract=fast (a multiply and an add become one
    fused multiply-add): the first row of a verification of 5 rows has the plain step's logits bit for bit
    (a row's sums are contracted alike whatever the row count), and both stay within 1e-3 of the eager path.
    q4_k_m: packed K-quant weights (the products of engine/kernels/fused.py inside the graphs)."""
    options = []
    real = torch.compile

    def recording(fn, **kw):
        options.append(kw.get("options") or {})
        return real(fn, **kw)
    monkeypatch.setattr(torch, "compile", recording)
    path, ref_path = MODELS[name]
    prompt = _prompts(get_ref(ref_path))[1]
    packed = name != "dense"
    eager = load_model(fixture_path(path), packed=packed)
    fast = load_model(fixture_path(path), packed=packed)
    assert fast.compile_steps("compiled", background=False)[0] == "compiled"
    with torch.inference_mode():
        out = {}
        for m in (eager, fast):
            cache = ModelCache(m.cfg, 1, 64)
            m.forward(torch.tensor([prompt]), cache, logits="none")
            n0, snap = cache.lengths[0], cache.snapshot_gdn(0)
            nxt = torch.tensor([[prompt[0]]])
            plain = m.forward(nxt, cache, logits="all").logits[0, 0].clone()
            cache.truncate(0, n0)
            cache.restore_gdn(0, snap)
            rows = torch.tensor([prompt[:1] + prompt[2:6]])
            verify = m.forward(rows, cache, logits="all", gdn_steps=True).logits[0]
            out[m is fast] = (plain, verify)
    assert fast._steps.n_compiled_calls >= 2 and fast._steps.n_eager_calls == 0
    step_options = [o for o in options if o.get("cpp_wrapper")]     # (not the eager model's fused kernels)
    assert step_options and all(o.get("cpp.enable_floating_point_contract_flag") == "fast" for o in step_options)
    plain, verify = out[True]
    assert torch.equal(verify[0], plain)
    want_plain, want_verify = out[False]
    scale = want_verify.abs().max()
    assert (plain - want_plain).abs().max() <= 1e-3 * scale
    assert (verify - want_verify).abs().max() <= 1e-3 * scale


@needs_cxx
def test_int8_dots_drafts_in_compiled_rounds_keep_the_plain_tokens():
    """Draft weights 'int8_dots' (engine.kernels.int8_dots, called from the compiled graphs' host code): greedy
    rounds of one and of two sequences (a kind compiled for B = 2) give plain decoding's tokens, and drafts
    are still accepted."""
    from engine.kernels import int8_dots
    if not int8_dots.available():
        pytest.skip(f"int8 dot products {int8_dots.status()[1]}")
    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))
    m = load_model(fixture_path(path), packed=True, min_packed=0)
    want = _gen(m, prompts[:1], "off", 1) + _gen(m, prompts[1:], "off", 1)
    m.compile_steps("compiled", background=False)
    m.set_draft_weights("int8_dots")
    dec = SpecDecoder(m, SpecOptions(mode="on", n_draft=3))
    events = list(dec.stream(prompts[:1], StopRule(max_tokens=32)))
    got = [r.tokens for r in dec.results()] + _gen(m, prompts[1:], "on", 3)
    assert got == want
    assert sum(e.accepted for e in events if e.k > 0) > 0
    assert any(key[0] == "round" and key[-1] == 2 for key in m._steps._ready), m._steps._ready


@needs_cxx
def test_wrong_drafts_run_in_the_fused_round():
    """With `set_wrong_drafts(True)` (bench --wrong-drafts) a greedy round still drafts and verifies in one
    compiled graph (a kind of its own: the offset is traced in), every draft is rejected and the tokens
    are plain decoding's."""
    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))[:1]
    m = load_model(fixture_path(path))
    want = _gen(m, prompts, "off", 1, n=12)
    m.compile_steps("compiled", background=False)
    m.set_wrong_drafts(True)
    try:
        dec = SpecDecoder(m, SpecOptions(mode="on", n_draft=2))
        events = list(dec.stream(prompts, StopRule(max_tokens=12)))
    finally:
        m.set_wrong_drafts(False)
    assert [r.tokens for r in dec.results()] == want
    rounds = [e for e in events if e.k > 0]
    assert rounds and all(e.draft_s == 0 for e in rounds)             # drafted inside the round's call
    assert sum(e.accepted for e in rounds) == 0
    assert any(key[0] == "round" and key[-2] is True for key in m._steps._ready), m._steps._ready

    # the seed's gate: 4 plain steps queue 4 MTP entries, and the first round writes them inside its one
    # compiled call (step 1 over 5 rows) instead of a separate MTP pass before it
    m.set_wrong_drafts(True)
    try:
        dec = SpecDecoder(m, SpecOptions(mode="adaptive", n_draft=2))
        flushed = []
        real_flush = dec._flush_mtp
        dec._flush_mtp = lambda s: (flushed.append(len(s.mtp_queue)), real_flush(s))
        events = list(dec.stream(prompts, StopRule(max_tokens=12)))
    finally:
        m.set_wrong_drafts(False)
    assert [r.tokens for r in dec.results()] == want
    rounds = [e for e in events if e.k > 0]
    assert len(rounds) == 5 and all(e.draft_s == 0 for e in rounds)
    assert [e.k for e in events[:5]] == [0, 0, 0, 0, 2]
    assert not any(flushed), flushed                                  # no backlog written outside a round


@needs_cxx
def test_sampled_rounds_run_in_the_fused_round():
    """At temperature > 0 (the server's default sampling) a round still drafts and verifies in one compiled call:
    drafts are greedy whatever the sampling, and the rows are drawn from the call's logits (spec §3.3). Every
    emitted token takes one draw of the request's seed, so `on` emits plain sampling's tokens, in the server's
    batch and in `SpecDecoder`, and `draft_chain` (the two-call round) is never called."""
    from engine.sampling import SamplingParams
    from engine.scheduler.model_backend import ModelBackend
    from engine.scheduler.scheduler import Scheduler
    from engine.scheduler.types import GenerationRequest, RoundEvent, TextDelta
    from tests.engine.scheduler.scripted import CharText

    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))
    with torch.inference_mode(False):             # (the tests run in inference mode, a server's thread does not)
        m = load_model(fixture_path(path))
        m.compile_steps("compiled", background=False)

    def serve(mtp):
        with torch.inference_mode(False):
            sched = Scheduler(ModelBackend(m, frozenset(), 1, 128), CharText)
        try:
            req = GenerationRequest(prompt=tuple(prompts[1]), max_tokens=24, temperature=0.8, top_k=40, top_p=0.95,
                                    min_p=0.05, seed=11, ignore_eos=True, mtp=mtp, n_draft=3)
            evs = list(sched.submit(req))
        finally:
            sched.close()
        assert evs[-1].finish_reason == "length", evs[-1]
        toks = [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids]
        return toks, [e for e in evs if isinstance(e, RoundEvent) and e.k > 0]

    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)

    def gen(mode):
        dec = SpecDecoder(m, SpecOptions(mode=mode, n_draft=3))
        events = list(dec.stream(prompts[:1], StopRule(max_tokens=24), sp))
        return [r.tokens for r in dec.results()], [e for e in events if e.k > 0]

    def two_calls(*a, **kw):   # an Exception, not pytest's Failed: the server's thread reports it as an error
        raise AssertionError("a sampled round ran as two calls")

    plain, _ = serve("off")
    real_chain = m.draft_chain
    m.draft_chain = two_calls
    try:
        toks, rounds = serve("on")
        assert toks == plain and len(toks) == 24
        assert rounds and all(e.draft_s == 0 for e in rounds)          # drafted inside the round's call
        m.draft_chain = real_chain
        want, _ = gen("off")
        m.draft_chain = two_calls
        got, rounds = gen("on")
        assert got == want
        assert rounds and all(e.draft_s == 0 for e in rounds)
        assert sum(e.accepted for e in rounds) > 0
    finally:
        m.draft_chain = real_chain


@needs_cxx
def test_compiled_round_leaves_the_cache_past_step_one_alone():
    """A greedy round's draft steps 2..k keep their MTP keys and values out of the cache (scratch rows):
    the compiled round writes only step 1's rows, and its cost does not grow with the cache's size. When
    the chain wrote its scratch rows into the cache, the compiled graph rewrote the whole MTP buffer every
    round: on the demo model 16.1 ms a round against 2.2 with a server's 4 slots x 4096 tokens."""
    path, _ = MODELS["dense"]
    m = load_model(fixture_path(path))
    m.compile_steps("compiled", background=False)
    n_mtp, k = m.cfg.nextn_blocks[0], 3
    prompt = torch.arange(40, 52)[None]
    rounds = {}
    with torch.inference_mode():
        for n_ctx in (64, 1 << 16):
            cache = ModelCache(m.cfg, 1, n_ctx)
            out = m.forward(prompt, cache, logits="last")
            m.mtp_forward(prompt[:, 1:], out.hidden[:, :-1], cache, logits="none")
            cache.mtp_k[n_mtp][0, cache.mtp_lengths[0]:] = 7.0
            tok, hid = out.logits[:, -1:].argmax(-1), out.hidden[:, -1:]
            L, LM = cache.lengths[0], cache.mtp_lengths[0]

            def one_round(cache=cache, tok=tok, hid=hid, L=L, LM=LM, check=False):
                d, o, target = m.draft_and_verify(tok, hid, cache, [0], k)
                target.tolist()
                if check:
                    assert cache.mtp_lengths[0] == LM + 1               # step 1's row only
                    assert bool((cache.mtp_k[n_mtp][0, LM + 1:] == 7.0).all())
                cache.rollback(o.gdn_steps, [1])
                cache.truncate(0, L)
                cache.truncate_mtp(0, LM)
            one_round(check=True)
            rounds[n_ctx] = one_round
        times = {n: [] for n in rounds}
        for _ in range(15):
            for n, f in rounds.items():
                t0 = time.perf_counter()
                f()
                times[n].append(time.perf_counter() - t0)
    assert m._steps.n_eager_calls == 0
    small, big = (statistics.median(times[n]) for n in (64, 1 << 16))
    assert big < 2.0 * small, (small, big)


@needs_cxx
def test_background_mode_runs_eager_until_compiled(monkeypatch):
    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))[:1]
    eager = load_model(fixture_path(path))
    fast = load_model(fixture_path(path))
    fast.compile_steps("compiled", background=True)
    want = _gen(eager, prompts, "on", 2)
    first = _gen(fast, prompts, "on", 2)
    assert fast._steps.n_eager_calls > 0          # the first calls of each kind ran eager
    assert fast._steps.drain(timeout=600)
    assert fast._steps.kinds_ready > 0
    before, eager_before = fast._steps.n_compiled_calls, fast._steps.n_eager_calls
    # the graphs the worker traced take no float inputs: dynamo would convert each (norm eps, rope
    # theta) to a tensor on every call. torch keeps its dynamo settings per thread, and the worker
    # once traced without the steps' settings (15 conversions per demo-model decode step)
    tensorified = []
    as_tensor = torch._as_tensor_fullprec
    monkeypatch.setattr(torch, "_as_tensor_fullprec", lambda x: tensorified.append(x) or as_tensor(x))
    second = _gen(fast, prompts, "on", 2)
    monkeypatch.undo()
    assert tensorified == []
    assert first == want and second == want
    assert fast._steps.n_compiled_calls > before
    assert fast._steps.n_eager_calls == eager_before   # every kind of the second run was ready
    # decoding went on while the worker compiled, and nothing failed (a compiled call during another
    # thread's tracing would: "FX to symbolically trace a dynamo-optimized function")
    assert fast.steps_status[0] == "compiled", fast.steps_status
    fast._steps.close()


@needs_cxx
def test_a_ready_kind_runs_its_graph_directly_while_the_guards_pass(caplog):
    """After a kind's first call through dynamo, its calls run the guarded graph's code directly (the guards
    checked by the call, not by dynamo's frame hook): the same tokens and logits as through dynamo; where the
    guards fail the call goes through dynamo, which compiles a graph for it, and that one then runs directly."""
    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))[:1]
    eager = load_model(fixture_path(path))
    fast = load_model(fixture_path(path))
    fast.compile_steps("compiled", background=False)
    steps = fast._steps
    for mode, k in (("off", 1), ("on", 2)):
        assert _gen(fast, prompts, mode, k) == _gen(eager, prompts, mode, k), mode
    assert steps.n_direct_calls > 0
    assert steps.n_direct_calls == steps.n_compiled_calls - len(steps._entries)   # each kind's first call: dynamo
    assert all(len(e) == 1 for e in steps._entries.values()), steps._entries

    cache = ModelCache(fast.cfg, 1, 64)
    tok = torch.tensor([prompts[0]])
    fast.forward(tok, cache, logits="none")
    snap = [b.clone() for b in cache.buffers()]
    args = _main_args(fast, cache, tok[:, -1:], 0)
    lifted = steps_mod._shift("main", args, steps_mod._LIFT)     # as the graph sees them

    def once(via_dynamo: bool):
        for b, v in zip(cache.buffers(), snap, strict=True):
            b.copy_(v)
        return steps._fns[key](fast, *lifted) if via_dynamo else steps.main(*args)

    once(False)                      # the kind's first call (through dynamo)
    key = next(k for k in steps._entries if k[0] == "main" and k[3] == "last")
    # the row-products flag, read while tracing, is part of the kind: its graphs have no guard on it (another
    # thread may set it while it traces), while a flag of plain data otherwise stays guarded (see below)
    guards, frame, flag = steps._entries[key][0][0], {"model": fast, "args": lifted}, layers._row_products
    assert guards.check(frame)
    layers.set_row_products(not flag)
    try:
        assert guards.check(frame)
    finally:
        layers.set_row_products(flag)
    direct = steps.n_direct_calls
    got, want = once(False), once(True)
    assert steps.n_direct_calls == direct + 1
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    # a guard that fails (the thread count is part of dynamo's global state): no direct call, dynamo
    # compiles the kind's second graph, and later calls run it directly
    torch.set_num_threads(2)
    try:
        assert steps.n_calling_thread_traces == 0
        with caplog.at_level(logging.WARNING, logger="engine.model.steps"):
            got = once(False)
        assert steps.n_direct_calls == direct + 1 and len(steps._entries[key]) == 2
        # counted and logged with the guard that failed (the graph held was traced at one thread)
        assert steps.n_calling_thread_traces == 1
        [rec] = [r for r in caplog.records if "traced again in the calling thread" in r.getMessage()]
        assert "GLOBAL_STATE" in rec.getMessage() or "num_threads" in rec.getMessage(), rec.getMessage()
        assert torch.equal(got[2], want[2])
        once(False)
        assert steps.n_direct_calls == direct + 2
    finally:
        torch.set_num_threads(1)
    once(False)
    assert steps.n_direct_calls == direct + 3

    class Unreadable:                # guards that need more than the step's own frame
        def check(self, frame):
            raise KeyError("model")

    steps._entries[key] = [(Unreadable(), None)]
    got = once(False)                # through dynamo, and every later call too: nothing fails
    assert steps._direct is False and steps.n_direct_calls == direct + 3
    assert torch.equal(got[2], want[2]) and fast.steps_status[0] == "compiled"


@needs_cxx
def test_a_ready_kind_runs_compiled_while_the_worker_compiles_another():
    """While the worker compiles (it holds the lock), a ready kind's graph runs directly, whatever row-products
    flag the worker set for its own trace (the call leaves it as it is), and gives what the call under the lock
    gives. Eager steps beside a compile wait for the GIL at every op (docs/benchmarks.md, thirty-second session)."""
    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))[:1]
    fast = load_model(fixture_path(path))
    fast.compile_steps("compiled", background=True)
    steps = fast._steps
    cache = ModelCache(fast.cfg, 1, 64)
    tok = torch.tensor([prompts[0]])
    fast.forward(tok, cache, logits="none")
    snap = [b.clone() for b in cache.buffers()]
    args = _main_args(fast, cache, torch.tensor([prompts[0][-1:]]), 0)   # a fresh token tensor, as decoding passes

    def once():
        for b, v in zip(cache.buffers(), snap, strict=True):
            b.copy_(v)
        return steps.main(*args)

    try:
        assert once() is None                 # queued; eager meanwhile
        assert steps.drain(timeout=600)
        flag = layers._row_products
        assert steps._lock.acquire(timeout=60)  # as the worker does while it compiles another kind
        try:
            # the first call after the worker compiled the kind: the graph the worker's warm-up made
            first = once()
            assert first is not None and steps.n_direct_calls == 1
            compiled, eager, direct = steps.n_compiled_calls, steps.n_eager_calls, steps.n_direct_calls
            got = once()
            assert got is not None
            assert (steps.n_compiled_calls, steps.n_eager_calls, steps.n_direct_calls) == (compiled + 1, eager,
                                                                                           direct + 1)
            assert all(torch.equal(a, b) for a, b in zip(got[:3], first[:3], strict=True))
            layers.set_row_products(not flag)    # the worker traces a kind with the other flag
            try:
                got = once()
                assert got is not None and steps.n_eager_calls == eager and layers._row_products is (not flag)
                assert all(torch.equal(a, b) for a, b in zip(got[:3], first[:3], strict=True))
            finally:
                layers.set_row_products(flag)
            # a kind is traced with one value of the flag
            with pytest.raises(RuntimeError, match="with and without per-row products"):
                steps._call(next(iter(steps._ready)), args, (1, 1), not steps._flags[next(iter(steps._ready))])
        finally:
            steps._lock.release()
        want = once()
        assert all(torch.equal(a, b) for a, b in zip(first[:3], want[:3], strict=True))
        assert fast.steps_status[0] == "compiled"
    finally:
        steps.close()


def _dynamo_only(monkeypatch) -> None:
    """The steps' `torch.compile` with dynamo's own guards and specialisations but no inductor: its graphs
    run as traced (seconds, not a C++ build)."""
    real_compile = torch.compile

    def eager_backend(fn, dynamic=None, options=None, fullgraph=False):   # the steps' or a packed kernel's
        keep = {k: v for k, v in (options or {}).items() if k == "guard_filter_fn"}
        return real_compile(fn, dynamic=dynamic, backend="eager", options=keep or None, fullgraph=fullgraph)

    monkeypatch.setattr(torch, "compile", eager_backend)


def test_one_graph_serves_every_slot(monkeypatch):
    """Dynamo specialises the ints 0 and 1 (and an int index into a tensor): a graph traced at slot 2 served
    no call for slot 0 or 1, nor one for slot 3 (retraced in the decoding thread), so each kind compiled
    once per slot. A slot other than 0, the start and the key count reach the graph lifted (`_LIFT`): one
    background compile serves slots 1..3, with no retrace, and gives the eager step's logits; slot 0 (a
    constant of its graph, faster) and a start of 0 (key count 1) are kinds of their own, compiled in the
    background too. The warm-up
    call mirrors the caller's tensors (inference tensors or not: the guards check that). Dynamo traces
    for real (its guards are the point); its graph runs without inductor."""
    _dynamo_only(monkeypatch)
    path, _ = MODELS["dense"]
    model = load_model(fixture_path(path))
    model.compile_steps("compiled", background=True)
    steps = model._steps
    cache, twin = ModelCache(model.cfg, 5, 64), ModelCache(model.cfg, 5, 64)     # compiled / eager steps
    with torch.inference_mode(False):              # (the tests run in inference mode)
        tok = torch.tensor([[5]])                  # a caller's tensor that is not an inference tensor
    for c in (cache, twin):
        model.forward(torch.tensor([[1, 2, 3]] * 4), c, logits="none")     # slot 4 stays at start 0

    def step(slot):
        got = steps.main(*_main_args(model, cache, tok, slot))
        if got is not None:
            want = model._main(*_main_args(model, twin, tok, slot))
            torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
        else:                                      # as the caller runs it
            for c in (cache, twin):
                model._main(*_main_args(model, c, tok, slot))
        for c in (cache, twin):
            c.lengths[slot] += 1
        return got is not None

    try:
        assert not step(2)                         # queued, eager meanwhile
        assert steps.drain(timeout=120)
        assert [step(s) for s in (1, 2, 3)] == [True] * 3
        assert not step(0)                         # slot 0: a constant of its kind's graph
        assert steps.drain(timeout=120)
        assert step(0)
        assert not step(4)                         # start 0: its own kind
        assert steps.drain(timeout=120)
        cache.lengths[4] = twin.lengths[4] = 0
        assert step(4) and step(4)                 # starts 0 and 1 (the kind of every later start)
        assert sorted(k[1] for k in steps._ready) == [(False, 0), (False, 1), (True, 1)]
        # no retrace for any slot: one graph per kind, every compiled call run directly past its guards
        assert all(len(steps._entries[k]) == 1 for k in steps._ready), steps._entries
        assert steps.n_direct_calls == 6 and steps.n_foreground_compiles == 0
        for slot in (0, 3):
            args = _main_args(model, cache, tok, slot)
            lifted = steps_mod._shift("main", args, steps_mod._LIFT)
            assert lifted[4:6] == (args[4] + 2, (slot and slot + 2, args[5][1] + 2))
            assert steps_mod._shift("main", lifted, -steps_mod._LIFT) == args
    finally:
        steps.close()


def test_one_graph_serves_every_batch_size_of_a_kind(monkeypatch):
    """A kind of several sequences whose rows are too many for per-row products (B x T > ROW_PRODUCTS_MAX)
    has a dynamic batch size. With duck shaping a batch of 4 verifying 4 rows (T static) made B the
    constant 4, and a batch of 3 retraced in the decoding thread; so did a static mark left on the slots'
    index tensor (shared by every call for those slots) by a kind of fixed batch size. One graph serves
    B = 4 and 3, with the eager path's logits, in a thread other than the one that made the steps
    (dynamo's settings are per thread)."""
    import threading

    _dynamo_only(monkeypatch)
    model = load_model(fixture_path(MODELS["dense"][0]))
    model.compile_steps("compiled", background=False)
    cache, twin = ModelCache(model.cfg, 4, 64), ModelCache(model.cfg, 4, 64)
    rows = torch.tensor([[7, 8, 9, 10]])
    errors = []

    def run():
        try:
            with torch.inference_mode():
                for c in (cache, twin):
                    model.forward(torch.tensor([[1, 2, 3, 4, 5]] * 4), c, logits="none")
                    # plain steps of 3 and 4 sequences first: kinds of a fixed batch size, which mark their
                    # tensors' batch dim static, the slots' index tensor among them (one per slot list)
                    for B in (3, 4):
                        model.forward(rows[:, :1].expand(B, 1), c, list(range(B)), logits="last")
                for B in (4, 3, 4, 3):
                    got = model.forward(rows.expand(B, 4), cache, list(range(B)), logits="all", gdn_steps=True)
                    slots, slot_idx, positions, n_keys, _ = model._slots(twin, list(range(B)), B, 4, twin.lengths)
                    want = model._main(rows.expand(B, 4), twin, slot_idx, positions, n_keys, None, "all", 64, True)
                    for s in slots:
                        twin.lengths[s] += 4
                    torch.testing.assert_close(got.logits, want[2], rtol=1e-5, atol=1e-5)
        except BaseException as exc:   # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    steps = model._steps
    (key,) = [k for k in steps._ready if k[0] == "main" and k[2] == 4]
    assert key[1] is None and key[-1] == 0 and len(steps._entries[key]) == 1, steps._entries
    assert steps.n_foreground_compiles == 3 and steps.n_compiled_calls == 8   # both caches' plain steps


def test_one_graph_serves_every_length_of_an_mtp_cache_commit(monkeypatch):
    """A head-less MTP commit (prompt warm-up, the plain steps' MTP sync, accepted drafts) is one kind whose T
    is dynamic. With duck shaping a first commit of 2 rows gave a graph for T = 2 only, and a commit of 3 rows
    retraced it in the decoding thread. One graph serves T = 2, 3 and 40 (past STEP_MAX_T: the sync of a queue
    of plain steps runs compiled up to MTP_COMMIT_MAX_T rows) and writes the eager path's keys and values."""
    import engine.model.model as model_mod

    _dynamo_only(monkeypatch)
    model = load_model(fixture_path(MODELS["dense"][0]))
    model.compile_steps("compiled", background=False)
    steps = model._steps
    cache, twin = ModelCache(model.cfg, 1, 128), ModelCache(model.cfg, 1, 128)
    gen = torch.Generator().manual_seed(0)
    n = model.cfg.nextn_blocks[0]
    assert 40 > model_mod.STEP_MAX_T and 40 <= model_mod.MTP_COMMIT_MAX_T
    for T in (7, 2, 3, 40, 5):   # the first from start 0: a kind of its own (`test_one_graph_serves_every_slot`)
        x = torch.randint(0, model.cfg.n_vocab, (1, T), generator=gen)
        h = torch.randn(1, T, model.cfg.n_embd, generator=gen)
        start = cache.mtp_lengths[0]
        model.mtp_forward(x, h, cache, [0], logits="none")
        model._steps = None                        # the twin's commit runs the eager path
        try:
            model.mtp_forward(x, h, twin, [0], logits="none")
        finally:
            model._steps = steps
        for got, want in ((cache.mtp_k[n], twin.mtp_k[n]), (cache.mtp_v[n], twin.mtp_v[n])):
            torch.testing.assert_close(got[0, start:start + T], want[0, start:start + T], rtol=1e-5, atol=1e-5)
    assert cache.mtp_lengths == twin.mtp_lengths == [57]
    first, key = sorted((k for k in steps._ready if k[0] == "mtp"), key=str)
    assert first[1] == (True, 0) and key[1] == (True, 1) and not key[2]
    assert len(steps._entries[key]) == 1, steps._entries
    assert steps.n_foreground_compiles == 2 and steps.n_compiled_calls == 5
    assert steps.n_calling_thread_traces == 0


def test_commits_into_a_packed_mtp_block_run_in_padded_calls_of_one_graph(monkeypatch):
    """A packed matrix's product of up to SMALL_M rows fixes the row count in the graph, and a longer one breaks
    it: each new commit length was traced again in the decoding thread. A commit now runs in calls of one
    sequence and SMALL_M rows, each sequence's last padded (its padding rows written past the commit's end, not
    counted), through one graph per slot and start class, whatever the lengths and the callers' strides (a slice
    of a longer row included); one of more than COMMIT_PIECES_MAX such calls, and a call that would pad past the
    cache's end, run eager. Every row's key and value equals the eager path's."""
    import engine.model.model as model_mod
    from engine.kernels.fused import SMALL_M

    _dynamo_only(monkeypatch)
    model = load_model(fixture_path(MODELS["q4_k_m"][0]), packed=True, min_packed=0)
    n = model.cfg.nextn_blocks[0]
    dense = load_model(fixture_path(MODELS["dense"][0]))
    assert dense._commit_rows(n, ModelCache(dense.cfg, 1, 64), None, 1, 40) == 40 > model_mod.STEP_MAX_T
    model.compile_steps("compiled", background=False)
    steps = model._steps
    n_ctx = 150
    cache, twin = ModelCache(model.cfg, 3, n_ctx), ModelCache(model.cfg, 3, n_ctx)
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randint(0, model.cfg.n_vocab, (3, 200), generator=gen)
    h_all = torch.randn(3, 200, model.cfg.n_embd, generator=gen)
    longest = model_mod.COMMIT_PIECES_MAX * SMALL_M
    # (rows, slots): the first from start 0 (a kind of its own); 33 rows and 9 rows of 3 sequences (6 calls)
    # eager; the last 3 rows end at n_ctx: their padding would pass it, so eager too
    plan = [(7, [0]), (2, [0]), (3, [0]), (SMALL_M, [0]), (12, [0]), (longest, [0]), (1, [0]), (longest + 1, [0]),
            (5, [0, 1]), (4, [0, 1, 2]), (9, [0, 1, 2]), (21, [0]), (5, [0]), (3, [0])]
    for i, (T, slots) in enumerate(plan):
        if i == len(plan) - 1:
            cache.mtp_lengths[0] = twin.mtp_lengths[0] = n_ctx - T
        starts = [cache.mtp_lengths[s] for s in slots]
        # each sequence from its own start; one sequence's rows as a slice of a longer row (strides of 200)
        if len(slots) == 1:
            x, h = x_all[:1, starts[0]:starts[0] + T], h_all[:1, starts[0]:starts[0] + T]
        else:
            x = torch.stack([x_all[s, p:p + T] for s, p in zip(slots, starts, strict=True)])
            h = torch.stack([h_all[s, p:p + T] for s, p in zip(slots, starts, strict=True)])
        model.mtp_forward(x, h, cache, slots, logits="none")
        model._steps = None                        # the twin's commit runs the eager path
        try:
            model.mtp_forward(x, h, twin, slots, logits="none")
        finally:
            model._steps = steps
        assert cache.mtp_lengths == twin.mtp_lengths
        for got, want in ((cache.mtp_k[n], twin.mtp_k[n]), (cache.mtp_v[n], twin.mtp_v[n])):
            for s, p in zip(slots, starts, strict=True):
                torch.testing.assert_close(got[s, p:p + T], want[s, p:p + T], rtol=1e-5, atol=1e-5)
    assert cache.mtp_lengths[0] == n_ctx
    keys = sorted((k for k in steps._ready if k[0] == "mtp" and not k[2]), key=str)
    # slot 0 or another, start 0 or later (`_one`): one graph each
    assert sorted(k[1] for k in keys) == [(False, 0), (False, 1), (True, 0), (True, 1)]
    assert all(len(steps._entries[k]) == 1 for k in keys), steps._entries
    assert steps.n_calling_thread_traces == 0
    # 7 (1 call), 2, 3, 8, 12 (2), 32 (4), 5 x 2 sequences (2), 4 x 3 (3), 21 (3), 5: 19 calls of SMALL_M rows;
    # 1 row: a kind of its own
    assert steps.n_compiled_calls == 20 and steps.n_foreground_compiles == 5


def test_guard_filter_keeps_guards_on_data_and_drops_those_on_code():
    """A new graph keeps no guard on the model's modules, and of the guards on globals those on plain data
    (a module's flag or constant, which code may set at run time) but not those on code (modules,
    functions, classes, builtins, dtypes), which nothing rebinds while the app runs."""
    from types import SimpleNamespace

    def entry(value, is_global=True, nn_module=False, name="G['__import_engine_dot_kernels_dot_fused'].FLAG"):
        source = SimpleNamespace(is_unspecialized_nn_module=lambda: nn_module)
        return SimpleNamespace(value=value, is_global=is_global, name=name, orig_guard=SimpleNamespace(source=source))

    entries = [entry(True), entry(16), entry(0.5), entry("ATTN"), entry(None), entry((1, 2)), entry({}),
               entry(torch), entry(torch.cat), entry(ModelCache), entry(len), entry(torch.float32),
               entry(steps_mod._guard_filter.__code__),
               entry(True, name="G['__import_engine_dot_model_dot_layers']._row_products"),   # part of the kind
               entry(torch.zeros(1), is_global=False), entry(3, is_global=False),
               entry(torch.zeros(1), is_global=False, nn_module=True)]
    assert steps_mod._guard_filter(entries) == [True] * 7 + [False] * 7 + [True, True, False]


@needs_cxx
def test_a_graphs_kernels_and_host_code_compile_apart(monkeypatch):
    """On CPU a kind's kernels and its C++ host code are two translation units, the host code at
    -O2 (the kernels -O3): a kind of round of the demo model compiled in ~0.75x the time."""
    from torch._inductor import codecache, config
    if not (hasattr(config, "cpp_wrapper_build_separate") and hasattr(config.aot_inductor, "compile_wrapper_opt_level")):
        pytest.skip("this torch builds a graph's kernels and host code as one unit")
    built = []
    load = codecache.CppWrapperCodeCache.load_async.__func__

    def recording(cls, main_code, *args, **kwargs):
        built.append(kwargs.get("optimized_code") is not None)    # the kernels' own source, built apart
        return load(cls, main_code, *args, **kwargs)

    monkeypatch.setattr(codecache.CppWrapperCodeCache, "load_async", classmethod(recording))
    model = load_model(fixture_path(MODELS["dense"][0]))
    assert model.compile_steps("compiled", background=False)[0] == "compiled"
    _gen(model, [[1, 2, 3]], "off", 1, n=4)
    assert model._steps.n_compiled_calls > 0
    assert built and all(built), built


def _main_args(model, cache, tok, slot):
    slots, slot_idx, positions, n_keys, single = model._slots(cache, [slot], 1, 1, cache.lengths)
    return tok, cache, slot_idx, positions, n_keys, single, "last", 64, False



@needs_cxx
def test_a_kind_compiles_in_a_child_process_and_loads_here_from_inductors_cache(tmp_path, monkeypatch):
    """A background compile goes to a child process first (engine.model.compile_child), which loads the
    same model and compiles the kind into inductor's cache; this process then traces it and finds its
    graph there: no FX graph compiled here, the compiled step's logits those of the eager one. The child
    ends with the worker."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # empty: the child must compile
    monkeypatch.delenv(steps_mod._CHILD_ENV, raising=False)
    model = load_model(fixture_path(MODELS["dense"][0]))
    model.compile_steps("compiled", background=True)
    steps = model._steps
    assert steps._child_off is None
    cache = ModelCache(model.cfg, 1, 64)
    tok = torch.tensor([[5, 17, 99, 3]])
    model.forward(tok, cache, logits="none")
    snap = [b.clone() for b in cache.buffers()]
    args = _main_args(model, cache, tok[:, -1:], 0)
    misses, hits = counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
    try:
        assert steps.main(*args) is None                  # queued: it runs eager meanwhile
        assert steps.drain(600)
        assert steps.n_child_compiles == 1 and steps.n_child_cache_misses == 0
        assert counters["inductor"]["fxgraph_cache_miss"] == misses       # nothing compiled in this process
        assert counters["inductor"]["fxgraph_cache_hit"] > hits
        assert steps._child is None                       # the worker ended, and its child with it
        for b, v in zip(cache.buffers(), snap, strict=True):
            b.copy_(v)
        got = steps.main(*args)
        for b, v in zip(cache.buffers(), snap, strict=True):
            b.copy_(v)
        want = model._main(*args)
        assert got is not None and torch.allclose(got[2], want[2], rtol=1e-4, atol=1e-4)
    finally:
        steps.close()



@needs_cxx
def test_a_server_compiles_its_decode_step_before_the_first_request():
    """`ModelBackend.compile_ahead` (serve with compiled steps) makes one slot's decode step at slot 0 and at
    another on a scratch cache and waits for their kinds: both are ready before any request (no other kind
    is), and the slots' own cache is untouched."""
    from engine.scheduler.model_backend import ModelBackend

    model = load_model(fixture_path(MODELS["dense"][0]))
    model.compile_steps("compiled", background=True)
    backend = ModelBackend(model, frozenset(), 3, 64)
    try:
        assert backend.compile_ahead(600)
        ready = model._steps._ready
        assert sorted(k[1] for k in ready) == [(False, 1), (True, 1)], ready
        assert all(k[:5] == ("main", k[1], 1, "all", False) and k[-1] == 0 for k in ready), ready
        assert backend.cache.lengths == [0, 0, 0] and backend.cache.mtp_lengths == [0, 0, 0]
    finally:
        model._steps.close()

def test_a_compile_child_that_fails_or_dies_leaves_the_kind_to_this_process(monkeypatch):
    """A kind the child could not compile is compiled here; a child that dies (killed, out of memory) or
    cannot start turns the child off for good, with a warning, and every kind compiles here."""
    monkeypatch.delenv(steps_mod._CHILD_ENV, raising=False)
    model = load_model(fixture_path(MODELS["dense"][0]))
    steps = steps_mod.CompiledSteps(model, "test", background=True)
    warmed, answers = [], []
    steps._warm = lambda key, shape, args, fixed_rows: warmed.append(key)

    class Child:
        def __init__(self):
            self.closed = False

        def compile(self, job):
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        def kill(self):
            self.closed = True

        def close(self):
            self.closed = True

    monkeypatch.setattr(steps_mod, "_CompileChild", Child)
    cache = ModelCache(model.cfg, 1, 64)
    args = _main_args(model, cache, torch.tensor([[5]]), 0)
    keys = [("main", (True, 0), 1, logits, False, True, torch.float32, 0) for logits in ("last", "all", "none")]
    answers[:] = [{"ok": False, "error": "RuntimeError: no"}, EOFError("the child died")]
    try:
        for key in keys:
            steps._put((key, (1, 1), args, True))
        steps._start_worker()
        assert steps.drain(60)
    finally:
        steps.close()
    assert warmed == keys                                 # each compiled here, after the child
    assert steps.n_child_compiles == 0 and answers == []  # the third never went to a child
    assert steps._child_off.startswith("the compile child failed (EOFError")
    assert steps_mod._child_off(model, background=False) == "foreground compiles"
    monkeypatch.setattr(steps_mod, "_available_memory", lambda: 2 * steps_mod._CHILD_OVERHEAD)   # no room left
    assert "over half the memory available" in steps_mod._child_off(model, background=True)
    monkeypatch.setenv(steps_mod._CHILD_ENV, "0")
    assert steps_mod._child_off(model, background=True) == f"{steps_mod._CHILD_ENV}=0"


def test_closing_the_steps_ends_the_child_compile_at_once(monkeypatch):
    """`close()` (the app or server ending) kills a child in the middle of a compile: the worker, waiting for
    it, ends at once, and the kind is not compiled in this process instead."""
    import threading

    monkeypatch.delenv(steps_mod._CHILD_ENV, raising=False)
    model = load_model(fixture_path(MODELS["dense"][0]))
    steps = steps_mod.CompiledSteps(model, "test", background=True)
    warmed, entered, killed = [], threading.Event(), threading.Event()
    steps._warm = lambda key, shape, args, fixed_rows: warmed.append(key)

    class Child:
        def compile(self, job):
            entered.set()
            killed.wait(60)
            raise EOFError

        def kill(self):
            killed.set()

        def close(self):
            killed.set()

    monkeypatch.setattr(steps_mod, "_CompileChild", Child)
    args = _main_args(model, ModelCache(model.cfg, 1, 64), torch.tensor([[5]]), 0)
    steps._put((("main", (True, 1), 1, "all", False, True, torch.float32, 0), (1, 1), args, True))
    steps._start_worker()
    worker = steps._worker
    assert entered.wait(60)
    steps.close()
    worker.join(10)
    assert not worker.is_alive() and warmed == [] and steps._child is None
    assert steps._child_off is None                       # a kill by close() is not a failure

def test_inductors_plain_fx_trace_runs_when_the_steps_are_made(monkeypatch):
    """A plain `torch.fx` trace swaps `nn.Module.__call__` for the whole process while it runs, so an eager
    step in another thread fails (NameError) if it runs meanwhile; inductor does one such trace per
    process in its first lowering. CompiledSteps runs it in the thread that makes them, before any
    background compile, so the worker never does."""
    import threading

    import torch.fx._symbolic_trace as fx_trace
    from torch._inductor.loop_body import InterpreterShim

    plain = []
    trace = fx_trace.Tracer.trace

    def recording(self, root, concrete_args=None):
        if type(self) is fx_trace.Tracer:
            plain.append(threading.current_thread())
        return trace(self, root, concrete_args)

    # the hazard itself, in this torch: a module called while a plain trace is in progress
    def traced(x):
        plain_call.append(_try(torch.nn.Identity(), x))
        return x

    plain_call: list = []
    torch.fx.symbolic_trace(traced)
    assert isinstance(plain_call[0], NameError) and "not installed as a submodule" in str(plain_call[0])

    monkeypatch.setattr(fx_trace.Tracer, "trace", recording)
    InterpreterShim._dummy_gm.cache_clear()
    model = load_model(fixture_path(MODELS["dense"][0]))
    steps = steps_mod.CompiledSteps(model, "test", background=True)
    try:
        assert plain == [threading.current_thread()]
        assert InterpreterShim._dummy_gm.cache_info().currsize == 1
    finally:
        steps.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def test_compile_failure_falls_back_to_eager(monkeypatch):
    path, ref_path = MODELS["dense"]
    prompts = _prompts(get_ref(ref_path))[:1]
    monkeypatch.setattr(steps_mod, "_cxx", lambda: "/usr/bin/c++")
    eager = load_model(fixture_path(path))
    fast = load_model(fixture_path(path))
    fast.compile_steps("compiled", background=False)

    def broken(*a, **k):
        raise RuntimeError("no toolchain")

    fast._steps._fn = lambda key: broken     # every kind of call (main, mtp, chain) fails
    assert _gen(fast, prompts, "on", 3) == _gen(eager, prompts, "on", 3)
    path_, why = fast.steps_status
    assert path_ == "eager" and "torch.compile failed (RuntimeError: no toolchain)" in why


@pytest.mark.parametrize("on", [True, False])
def test_row_products_in_fixed_row_graphs(on):
    """matmul_weight in a graph traced with `set_row_products(True)`: one reduction per row (no library
    product), the same values within float32 rounding; traced without it, the library product."""
    import torch.nn.functional as F

    from engine.model import layers

    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    for rows in (1, 3, layers.ROW_PRODUCTS_MAX, layers.ROW_PRODUCTS_MAX + 1):
        x = torch.randn(1, rows, 32, generator=g)
        torch._dynamo.reset()
        graphs.clear()
        layers.set_row_products(on)
        try:
            y = torch.compile(layers.matmul_weight, backend=capture, dynamic=False, fullgraph=True)(x, w)
        finally:
            layers.set_row_products(False)
        targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        library = any("linear" in t for t in targets)
        assert library == (not on or rows > layers.ROW_PRODUCTS_MAX), targets
        assert y.shape == (1, rows, 48)
        assert torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.fixture
def traced_in(monkeypatch):
    """torch.compile with a backend that only records each traced graph and the thread that traced it
    (no inductor): a list of (graph module, thread name)."""
    import threading

    traced = []

    def capture(gm, _inputs):
        traced.append((gm, threading.current_thread().name))
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=capture, dynamic=kw.get("dynamic")))
    return traced


@pytest.mark.parametrize("kind", ["q8_0", "int8", "int8_dots"])
def test_every_packed_weight_a_draft_reads_has_static_sizes(traced_in, kind):
    """With Q8_0 draft weights a chain reads Q8_0 copies of the nextn block's matrices and of the output head
    (int8 ones with a scale per row with 'int8', as uint8 for the CPU's dot products with 'int8_dots', which
    the graph passes to that operator); the head is held outside any module (`DraftTwin.head`), and
    every such weight must still reach the traced graph with concrete sizes: a symbolic block size makes each
    draft's head product a loop of unknown bounds (demo model, one process, alternated per call: chain of 4
    drafts 0.668 -> 0.566 ms)."""
    from engine.kernels import PackedWeight, int8_dots

    if kind == "int8_dots" and not int8_dots.available():
        pytest.skip(f"int8 dot products {int8_dots.status()[1]}")
    model = load_model(fixture_path(MODELS["dense"][0]), packed=True, min_packed=0)
    model.compile_steps("compiled", background=False)
    model.set_draft_weights(kind)
    assert model.draft_heads() and all(isinstance(h, PackedWeight) for h in model.draft_heads())
    cache = ModelCache(model.cfg, 1, 64, mtp=True)
    with torch.inference_mode():
        toks = torch.tensor([[1, 2, 3, 4, 5]])
        out = model.forward(toks, cache, [0], logits="last")
        model.mtp_forward(toks, out.hidden, cache, [0], logits="none")
        model.draft_chain(torch.tensor([[6]]), out.hidden[:, -1:], cache, [0], 3)
        # each kind's first call compiled here, in the calling thread (no background worker): untimed calls
        first = model.untimed_calls
        assert first == model._steps.n_foreground_compiles == len(model._steps._ready) > 0
        cache.truncate_mtp(0, cache.mtp_lengths[0] - 1)
        model.draft_chain(torch.tensor([[6]]), out.hidden[:, -1:], cache, [0], 3)
        assert model.untimed_calls == first                      # a ready kind's call is timed
    assert any(key[0] == "chain" for key in model._steps._ready) and traced_in
    # the copies' quants: int8 blocks, the words layout's [N, K/32, 8] float32 (PackedWeight.as_words), or rows
    layout = {"int8": "q", "int8_dots": "qu"}.get(kind, "qw" if codegen.avx2() else "qs")
    assert all(layout in h.parts for h in model.draft_heads())

    rows = {w.shape[0] for mod in model.draft_modules() for w in vars(mod).values() if isinstance(w, PackedWeight)}
    rows |= {h.shape[0] for h in model.draft_heads()}

    def quants(t: torch.Tensor) -> bool:      # activations lead with the batch (1), a weight's parts with N
        first = t.shape[0]
        return t.dtype in (torch.int8, torch.uint8) or (t.dtype == torch.float32 and t.dim() == 3
                                                         and isinstance(first, int) and first in rows - {1})
    parts = [n.meta["example_value"] for gm, _ in traced_in for n in gm.graph.nodes
             if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
             and quants(n.meta["example_value"])]
    head_rows = model.draft_heads()[0].shape[0]
    # the words layout's 8 words, a block's 32 int8 quants, or a row's
    group = model.cfg.n_embd if kind.startswith("int8") else 8 if codegen.avx2() else 32
    assert any(t.shape[0] == head_rows and t.shape[-1] == group for t in parts), [tuple(t.shape) for t in parts]
    symbolic = [tuple(t.shape) for t in parts if not all(isinstance(d, int) for d in t.shape)]
    assert not symbolic, symbolic
    calls = {str(n.target) for gm, _ in traced_in for n in gm.graph.nodes if n.op == "call_function"}
    assert any("int8_dots" in c for c in calls) == (kind == "int8_dots"), sorted(calls)


@needs_cxx
def test_a_round_of_several_sequences_queues_only_the_padded_step1_length_along(monkeypatch):
    """Rounds of several sequences pad their step 1 to k + 1 rows (`Qwen35Model.step1_pads`: the last round's
    accepted drafts and the pending token), so a request of several sequences meets one kind of round per k.
    Another step-1 length (an unpadded round at the cache's end, a writer that pads nothing) queues that kind
    and the padded one along, not every length up to k + 1 (4 kinds of round for 2 sequences at k = 3, each a
    compile of its own as the rows take per-row products). The worker is not started: this checks the queue."""
    model = load_model(fixture_path(MODELS["dense"][0]), packed=True, min_packed=0)
    model.compile_steps("compiled", background=True)
    monkeypatch.setattr(model._steps, "_start_worker", lambda: None)
    k, B = 3, 2
    cache = ModelCache(model.cfg, B, 96, mtp=True)

    def rounds() -> set:
        return {key[2] for key in model._steps._queued if key[0] == "round"}

    with torch.inference_mode():
        toks = torch.arange(1, 20).repeat(B, 1)
        out = model.forward(toks, cache, [0, 1], logits="last")
        model.mtp_forward(toks, out.hidden, cache, [0, 1], logits="none")
        hid = out.hidden[:, -1:]
        model.draft_and_verify(torch.full((B, 1), 5), hid, cache, [0, 1], k)
        assert rounds() == {1, k + 1}
        pads = model.step1_pads(cache, [0, 1], [1, 3], k)
        assert pads == [k, k - 2]
        model.draft_and_verify(torch.full((B, k + 1), 5), hid.expand(B, k + 1, -1).contiguous(), cache, [0, 1], k,
                               pad=pads)
        assert rounds() == {1, k + 1}
        model.draft_and_verify(torch.full((B, 2), 5), hid.expand(B, 2, -1).contiguous(), cache, [0, 1], k)
    assert B * k <= steps_mod.ROW_PRODUCTS_MAX          # every length a kind of its own
    assert rounds() == {1, 2, k + 1}
    assert model._steps.n_compiled_calls == 0 and model._steps.kinds_ready == 0
    model._steps.close()


def test_every_step_one_length_of_a_round_runs_as_one_kind_the_worker_compiles(traced_in):
    """A fused round's step 1 takes T rows (the pending token and the queued MTP entries: 1..k+1 after a
    round). Each length traces as a graph of its own (its row counts are constants); padded to one length
    (`step1_pad`), every T runs as one kind, which the background worker compiles while the calls run eager
    (before the padding each T was a kind of its own, and before the worker compiled them, T = 3.. recompiled
    in the decoding thread, which waited: demo model 60-72 s each with an empty inductor cache)."""
    import threading

    model = load_model(fixture_path(MODELS["dense"][0]), packed=True, min_packed=0)
    model.compile_steps("compiled", background=True)
    k = 3
    cache = ModelCache(model.cfg, 1, 96, mtp=True)
    with torch.inference_mode():
        toks = torch.arange(1, 20)[None]
        out = model.forward(toks, cache, [0], logits="last")
        model.mtp_forward(toks, out.hidden, cache, [0], logits="none")
        P, PM, snap = cache.lengths[0], cache.mtp_lengths[0], cache.snapshot_gdn(0)

        def round_of(T: int) -> bool:
            n = model._steps.n_compiled_calls
            pad = model.step1_pad(cache, 0, T, k)
            hidden = torch.stack([out.hidden[0, -1]] * (T + pad))[None]    # contiguous, as the decoder's
            model.draft_and_verify(torch.full((1, T + pad), 5), hidden, cache, [0], k, pad=pad)
            assert cache.mtp_lengths[0] == PM + T
            cache.truncate(0, P)
            cache.truncate_mtp(0, PM)
            cache.restore_gdn(0, snap)
            return model._steps.n_compiled_calls > n

        assert not round_of(1)                                           # eager; queues the padded length
        assert model._steps.drain(600)
        main = threading.current_thread().name
        before = [name for _, name in traced_in].count(main)
        assert [round_of(T) for T in range(1, k + 2)] == [True] * (k + 1)
        threads = [name for _, name in traced_in]
        assert threads.count(main) == before, threads                   # nothing traced in this thread
    rounds = {key[2] for key in model._steps._ready if key[0] == "round"}
    assert rounds == {model.step1_rows(k)} and model.step1_rows(k) >= k + 1, model._steps._ready
    model._steps.close()


def test_the_gil_changes_hands_often_while_a_worker_compiles():
    """While the worker compiles, the interpreter's switch interval is short (each eager op of the decoding
    thread waits for the GIL after it, and at the default 5 ms a request running eager beside a compile
    paused for seconds); nested or shared by workers, it comes back to what it was when the last one ends."""
    import sys

    def short() -> bool:     # the interpreter keeps the interval in microseconds
        return sys.getswitchinterval() == pytest.approx(steps_mod._COMPILE_SWITCH_S, rel=1e-3)

    saved = sys.getswitchinterval()
    assert saved > 2 * steps_mod._COMPILE_SWITCH_S
    with steps_mod._GilHandoff():
        assert short()
        with steps_mod._GilHandoff():
            assert short()
        assert short()
    assert sys.getswitchinterval() == saved

    model = load_model(fixture_path(MODELS["dense"][0]))
    steps = steps_mod.CompiledSteps(model, "test", background=True)
    seen = []
    steps._warm = lambda key, shape, args, fixed_rows: seen.append((key, short()))
    steps._child_off = "the test replaces _warm"   # no compile child either
    try:
        steps._put((("main", None, 1, "all", False), (1, 1), (), False))
        steps._start_worker()
        assert steps.drain(60)
    finally:
        steps.close()
    assert seen == [(("main", None, 1, "all", False), True)]
    assert sys.getswitchinterval() == saved


def test_the_compile_worker_ends_when_its_queue_is_empty():
    """Each thread that runs a parallel region keeps OpenMP threads of its own while it lives (see
    engine.threads): the background compiler's thread ends once nothing is queued, and the next kind queued
    starts another."""
    import threading

    model = load_model(fixture_path(MODELS["dense"][0]))
    steps = steps_mod.CompiledSteps(model, "test", background=True)
    seen = []
    steps._warm = lambda key, shape, args, fixed_rows: seen.append((key, threading.current_thread()))
    steps._child_off = "the test replaces _warm"   # no compile child either
    try:
        for n in (1, 2):
            steps._put((("main", None, n, "all", False), (1, 1), (), False))
            steps._start_worker()
            assert steps.drain(60)
            worker = seen[-1][1]
            worker.join(10)
            assert not worker.is_alive() and steps._worker is None
    finally:
        steps.close()
    assert [key for key, _ in seen] == [("main", None, 1, "all", False), ("main", None, 2, "all", False)]
    assert seen[0][1] is not seen[1][1] and seen[0][1].name == "mtpchat-compile"


def test_the_worker_compiles_plain_steps_first_then_the_kinds_in_the_order_met():
    """Plain decode steps carry every request while the rest compile, so their kinds go first; the others
    keep the order they were met in; `drain()` waits for all of them, and `close()` skips what is left."""
    import threading

    model = load_model(fixture_path(MODELS["dense"][0]))
    steps = steps_mod.CompiledSteps(model, "test", background=True)
    seen, go = [], threading.Event()
    steps._warm = lambda key, shape, args, fixed_rows: go.wait(60) and seen.append(key)
    steps._child_off = "the test replaces _warm"   # no compile child either
    mtp, verify = ("mtp", None, False, "none", 4), ("main", None, 4, "all", True)
    plain, plain2 = ("main", None, 1, "all", False), ("main", None, 1, "all", False, 2)
    rounds = [("round", None, t, 3, 4) for t in (1, 2)]
    try:
        for key in (mtp, rounds[0], verify, plain, rounds[1], plain2):
            steps._put((key, (1, 1), (), False))
        steps._start_worker()
        go.set()
        assert steps.drain(60)
        assert seen == [plain, plain2, mtp, rounds[0], verify, rounds[1]]
        go.clear()
        steps._put((mtp, (1, 1), (), False))
        steps._put((plain, (1, 1), (), False))
        steps._start_worker()           # waits in the first warm-up until `go`
        steps.close()
        go.set()
        assert steps.drain(60)
        assert seen[6:] in ([plain], [])   # the one compiling when close() came finishes; the rest is skipped
    finally:
        steps.close()


# run in a fresh process: a thread of this one that ran parallel regions with several threads (the main
# thread, in an earlier test) would slow the decoding thread's steps, which is what the test checks for
_DECODING_THREAD = """
import json, os, statistics, threading, time
import torch
from engine.model import ModelCache, load_model
from engine.resources import default_model_path
from engine.threads import in_passing_thread

torch.set_num_threads(len(os.sched_getaffinity(0)))     # as the commands do, before anything else

def build():      # the demo model: the fixtures' steps are too small for inductor to split over threads
    m = load_model(default_model_path(), packed=True, min_packed=0)
    m.compile_steps("compiled", background=True)
    return m

model = in_passing_thread(build)
times = {}

def decode():
    cache = ModelCache(model.cfg, 1, 512)
    tok = torch.tensor([[5]])
    with torch.inference_mode():
        model.forward(torch.arange(1, 20)[None], cache, [0], logits="last")
        model.forward(tok, cache, [0], logits="all")           # queues the plain step's kind
        assert model._steps.drain(600)
        for n in (len(os.sched_getaffinity(0)), 1):           # every thread, then one
            torch.set_num_threads(n)
            ts = []
            for _ in range(120):
                t = time.perf_counter()
                model.forward(tok, cache, [0], logits="all")
                ts.append(time.perf_counter() - t)
                cache.truncate(0, 19)
            times[n] = statistics.median(ts[20:])

t = threading.Thread(target=decode, name="decoding")
t.start()
t.join()
model._steps.close()
print(json.dumps({"times": times, "compiled": model._steps.n_compiled_calls}))
"""


@needs_cxx
def test_a_compiled_step_in_a_decoding_thread_is_not_slowed_by_other_threads_openmp_teams():
    """The server's and `chat`'s set-up (load, compile in the background) and their decoding (the scheduler's
    thread) run in different threads. While another thread that ran parallel regions lived (the main thread
    after loading, the compile worker), the decoding thread's compiled steps took ~6x as long as with one
    thread (demo model, 2 vCPUs): OpenMP stopped spinning between parallel regions. Set up in a passing
    thread, with the worker gone once its queue is empty, a step with all threads costs at most 2x a
    one-thread step (on one CPU both are one-thread steps)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _DECODING_THREAD], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    times = {int(n): t for n, t in doc["times"].items()}
    assert doc["compiled"] >= 200, doc
    assert max(times.values()) <= 2.0 * times[1], times


@needs_cxx
@pytest.mark.parametrize("background", [False, True])
def test_compiled_kinds_leave_no_trace_state_alive(background):
    """A server meets dozens of kinds of call; each compile used to leave its traced graph (nodes, example
    FakeTensors, stack traces) alive through the compiled function, its ShapeEnv through ShapeEnv's
    class-level method caches and through the FakeTensors of its `tracked_fakes` (sizes held from C++), and
    its generated C++ source and printed graphs (8.6 MiB a kind, then 7.4). After each kind compiles none of
    them stays reachable, and the compiled kinds still give plain decoding's tokens."""
    import gc

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def alive() -> dict:
        gc.collect()
        return {id(o): o for o in gc.get_objects() if type(o) is ShapeEnv or (isinstance(o, torch.fx.GraphModule)
                and any("example_value" in n.meta for n in o.graph.nodes))}

    def texts() -> dict:
        """The generated code that compiled graphs, their wrappers or their modules hold (inductor's names)."""
        found = {}
        for o in gc.get_objects():
            try:
                d = o if isinstance(o, dict) else None if isinstance(o, type) else vars(o)
            except Exception:      # no __dict__, or one that refuses to be read (pydantic's BaseModel)
                continue
            if isinstance(d, dict):
                found.update((id(d[k]), k) for k in steps_mod._GRAPH_TEXTS + steps_mod._MODULE_SOURCES
                             if isinstance(d.get(k), str) and len(d[k]) > 1000)
        return found

    before, before_texts = alive(), texts()      # other compiles in this process (other tests' kernels) are not the steps'
    ref = get_ref(MODELS["dense"][1])
    model = load_model(fixture_path(MODELS["dense"][0]))
    model.compile_steps("compiled", background=background)
    prompts = _prompts(ref)[:2]
    want = _gen(model, prompts, "off", 1)
    for _ in range(2):                      # background: the second pass runs the kinds compiled meanwhile
        got = _gen(model, prompts, "on", 2)
        if background:
            assert model._steps.drain(600)
    assert got == want and model._steps.kinds_ready >= 3 and model._steps.n_compiled_calls > 0
    left = [type(o).__name__ for i, o in alive().items() if i not in before]
    assert left == []
    assert [k for i, k in texts().items() if i not in before_texts] == []
    cached = {name: v.cache_info().currsize for name, v in vars(ShapeEnv).items() if hasattr(v, "cache_info")}
    assert cached and not any(cached.values()), cached
