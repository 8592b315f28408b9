"""The compiled decode step: `torch.compile` over the whole cached forward of a few tokens (a decode
step, a verification of k+1 rows, a chain of k MTP drafts, an MTP cache commit, a round's chain and
verification together), so a small model's
step runs as a handful of fused C++ (CPU) or Triton (CUDA) kernels instead of hundreds of eager
operations.

Shapes are dynamic (cache lengths and positions are symbolic; T too where it varies), so one graph
serves every step of a kind; each kind (one or several sequences, T, which logits, per-step GDN states,
the chain's k) compiles once, which takes seconds to a minute. So by default (`background=True`) a
kind's first calls run eagerly while a worker thread compiles it on a small scratch cache of the same
layout; later calls of that kind run compiled. Where it can, the worker first has a child process compile
the kind (engine.model.compile_child, the same model loaded again) and then loads it from inductor's cache:
the compile's Python work then takes no GIL from the decoding thread, and its heap goes with the child.
`foreground` compiles on first use instead (blocking).
Each kind gets a code object of its own, so a call checks one graph's guards only. On CPU the graph's
host code is C++ too (inductor's `cpp_wrapper`). Without a toolchain (no C++ compiler on PATH for CPU,
no Triton for CUDA), with MTPCHAT_STEPS=eager, or after any compile failure the eager path runs the
same math.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import importlib.util
import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import types
from multiprocessing.connection import Connection

import torch

from engine.errors import InputError, MtpchatError
from engine.kernels import fused
from engine.model.layers import ROW_PRODUCTS_MAX, set_row_products
from engine.spec.modes import STEP_MODES

log = logging.getLogger(__name__)

# a single sequence's draft step 1 is padded to at least this many rows: the adaptive gate's 4 baseline
# plain steps (spec §5.1) and the pending token (`CompiledSteps.step1_rows`)
STEP1_MIN_ROWS = 5
_RECOMPILE_LIMIT = 64      # per code object (one per kind of call; shape specialisations recompile)
_SCRATCH_START = 23        # scratch cache length before a warm-up call (not 0/1, not a model dimension)
_ids = itertools.count()
# whether this thread (context) has the dynamo settings below: torch keeps `torch._dynamo.config`
# assignments in context variables, so a value set in the thread that loaded the model does not reach
# the compile worker or an app's decode thread (each thread starts with the defaults)
_SETTINGS_SET: contextvars.ContextVar[bool] = contextvars.ContextVar("mtpchat_dynamo_settings", default=False)


def _dynamo_settings() -> None:
    """Apply the steps' dynamo settings in the calling thread, once (before it traces or calls a step).

    - the model's float attributes (norm eps, rope theta) are constants: traced as such, not as graph
      inputs converted to float64 tensors on every call (15 per decode step of the demo model; with the
      setting made only where the model was loaded, the background worker traced them as inputs)
    - a higher recompile limit per code object (one per kind of call; shape specialisations recompile)"""
    if _SETTINGS_SET.get():
        return
    cfg = torch._dynamo.config
    if getattr(cfg, "recompile_limit", _RECOMPILE_LIMIT) < _RECOMPILE_LIMIT:
        cfg.recompile_limit = _RECOMPILE_LIMIT
    cfg.specialize_float = True
    _SETTINGS_SET.set(True)


def _tracing(key: tuple):
    """The settings a call of kind `key` traces under. A kind of several sequences with a dynamic batch size
    (`_fixed_batch` 0) traces without duck shaping: with it the batch size, equal to a static size when
    traced, became that constant. 4 sequences verifying 4 rows each (T is static) gave a graph for B = 4
    only, and a batch of 3 then retraced it in the decoding thread, every other request waiting. So does an
    MTP kind of T > 1 (cache commits: T is dynamic): traced at T = 2 its graph served T = 2 only, and the next
    commit of another length retraced it in the decoding thread (1-6 s on the demo model; forty-fifth session).
    The other kinds keep it: without it the demo model's rounds (one sequence, k = 3) ran 1.4-5.2 % slower
    (paired, both orders; thirty-eighth session)."""
    if (key[1] is None and key[-1] == 0) or (key[0] == "mtp" and not key[2]):
        try:
            from torch.fx.experimental import _config as fx_config
        except ImportError:   # another torch: its default (a batch size may then retrace)
            return contextlib.nullcontext()
        if hasattr(fx_config, "use_duck_shape"):
            return fx_config.patch(use_duck_shape=False)
    return contextlib.nullcontext()


# While a worker compiles, the interpreter hands the GIL to a waiting thread after this long instead of
# its default 5 ms. Each eager torch op of the decoding thread releases the GIL and then waits for the
# worker's tracing to give it back: at 5 ms the first demo-model request, eager beside the compile, took
# 37-71 s with pauses of 10-16 s between rounds, at 10 us 9.5-11 s with pauses under 5 s (2 vCPUs; the
# twenty-second session in docs/benchmarks.md)
_COMPILE_SWITCH_S = 1e-5
# the compile worker's queue order (`CompiledSteps._put`): plain steps, other kinds, `drain()`'s events, then
# `close()`'s end (the kinds still queued are skipped once it is called, and every waiting `drain()` returns)
_PLAIN, _OTHER, _DRAIN, _CLOSE = range(4)
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


class _GilHandoff:
    """Context: the short GIL switch interval while any worker compiles (nested and shared by workers)."""

    def __enter__(self):
        global _switch_users, _switch_saved
        with _switch_lock:
            if _switch_users == 0:
                _switch_saved = sys.getswitchinterval()
                sys.setswitchinterval(min(_switch_saved, _COMPILE_SWITCH_S))
            _switch_users += 1
        return self

    def __exit__(self, *exc):
        global _switch_users
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)
        return False


def _cxx() -> str | None:
    from engine.kernels.fused import _compiler
    return _compiler()


def choose(mode: str, device: torch.device | str) -> tuple[str, str]:
    """('compiled' | 'eager', why) for a requested mode on a device. MTPCHAT_STEPS=eager|compiled
    overrides 'auto'; 'compiled' without a toolchain is an InputError."""
    if mode not in STEP_MODES:
        raise InputError(f"steps: one of {', '.join(STEP_MODES)}, got {mode!r}")
    forced = os.environ.get("MTPCHAT_STEPS", "").strip().lower()
    if mode == "auto" and forced in ("compiled", "eager"):
        mode = forced
        origin = f"MTPCHAT_STEPS={forced}"
    else:
        origin = f"steps={mode}"
    if mode == "eager":
        return "eager", origin
    device = torch.device(device)
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return _unavailable(mode, "no Triton (torch.compile's CUDA backend needs it)")
        return "compiled", "torch.compile (inductor, Triton)"
    if device.type != "cpu":
        return _unavailable(mode, f"no compiled step for device {device.type}")
    cxx = _cxx()
    if cxx is None:
        return _unavailable(mode, "no C++ compiler on PATH (torch.compile's CPU backend needs one)")
    return "compiled", f"torch.compile (inductor C++, {_vec_isa()} vectors) with {cxx}"


def _vec_isa() -> str:
    """The vector instructions inductor's C++ uses on this CPU, named for the status line (a virtual machine
    can hide AVX-512 from a CPU that has it, and its kernels then run at half the width)."""
    from engine.kernels import codegen
    isa = codegen.vec_isa()
    if isa is None:      # a torch without this helper: the path still works, the width is just not named
        return "unknown"
    return isa.upper() or "no SIMD"


def min_packed(mode: str, device: torch.device | str) -> int | None:
    """The smallest matrix `load_model(packed=True)` should keep packed for steps run in `mode`: every one
    (0) when they will be compiled on CPU, where a packed product is traced into the step's graph and costs
    no call of its own (tiny Q8_0 fixture, 1 thread, same process: plain step 0.87 -> 0.60 ms, round of
    k = 3 3.24 -> 2.13 ms, the same logits); else None (the size threshold of engine.kernels.packed)."""
    if torch.device(device).type != "cpu":
        return None
    try:
        path, _ = choose(mode, device)
    except InputError:
        return None               # 'compiled' without a toolchain: the caller's compile_steps says so
    return 0 if path == "compiled" else None


def _unavailable(mode: str, why: str) -> tuple[str, str]:
    if mode == "compiled":
        raise InputError(f"steps: compiled steps are not available here: {why}")
    return "eager", why


def _fresh(fn, name: str):
    """A copy of `fn` with a code object of its own (dynamo keeps compiled entries per code object)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


# what a compiled function keeps "for convenience" (torch's aot_module_simplified): bound methods of dynamo's
# traced GraphModule, whose nodes keep their example FakeTensors and stack traces
_TRACE_CONVENIENCES = ("zero_grad", "named_parameters", "named_buffers")
# the texts a compiled graph keeps for its cache entry and for debugging (inductor's CompiledFxGraph, and
# each wrapper's copy of its attributes by functools.wraps): the generated code (with cpp_wrapper the whole C++
# source, 0.2-0.9 MB a kind) and two printed graphs. Written to the FX graph cache when the kind compiled;
# a loaded graph runs its callable and never reads them again
_GRAPH_TEXTS = ("source_code", "runnable_graph_str", "inductor_post_grad_graph_str",
                "inductor_provenance_mapping_str", "inductor_provenance_stack_traces_str")
# the C++ source a loaded graph's Python module holds as globals, read once to build or load its library
_MODULE_SOURCES = ("cpp_wrapper_src", "kernel_src")


def _compile_wrapper(v) -> bool:
    """Whether a closure cell's value is part of a compiled function's chain of wrappers (a function, or an
    object of torch's compile stack such as a CompiledFxGraph), not data of the traced program."""
    if isinstance(v, types.FunctionType):
        return True
    mod = type(v).__module__ or ""
    return mod.startswith(("torch._inductor", "torch._functorch", "torch._dynamo")) and hasattr(v, "__dict__")


def _drop_trace_leftovers() -> None:
    """Release what torch keeps of a finished compile that no compiled call reads, after each kind compiles.

    Each kind compiled kept 8.6 MiB (the f32 fixture, one process), and a 4-slot server meets ~50 kinds over
    its first minutes (docs/benchmarks.md, thirty-seventh and thirty-ninth sessions). Holders of dead state:
    - dynamo installs each compiled function as a global of the traced function's module (this one); the
      function carries bound methods of the traced GraphModule (`_TRACE_CONVENIENCES`), so every graph's
      nodes, their FakeTensors and stack traces stayed alive;
    - ShapeEnv's methods are memoized by class-level caches keyed by the instance;
    - each ShapeEnv's `tracked_fakes` (the traced inputs' FakeTensors, read when the guards were made) and
      its fake-tensor dispatch cache: the FakeTensors' symbolic sizes are held from C++, so every ShapeEnv
      (its sympy expressions, its dispatch cache) stayed alive through them;
    - the generated code and printed graphs (`_GRAPH_TEXTS`, `_MODULE_SOURCES`, the FX cache key's debug
      lines): ~1.5 MiB a kind;
    - AOTAutograd's tracker of random-number state, whose last state is FakeTensors of the last trace;
    - torch's "mega-cache" (`torch.compiler.save_cache_artifacts`, which mtpchat does not call) keeps the
      pickled bytes of every FX-graph and AOTAutograd cache entry the process wrote or read: ~1.9 MiB a kind;
      and each compiled function its AOTAutograd entry's bytes again, for serializing it (`_unserializable`):
      ~0.4 MiB a kind.
    The compiled code, its guards and its kernels are untouched; the rest only memoizes or was read while
    compiling. Under dynamo's compile lock, so no dynamo trace in any thread is using what is dropped (every
    ShapeEnv of the process is emptied: mtpchat traces through dynamo only)."""
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:
        compile_lock = contextlib.nullcontext()
    with compile_lock:
        _drop_wrapper_state()
        _drop_shape_envs()
        _drop_rng_tracker()
        _drop_cache_artifacts()
    _trim_heap()


def _drop_rng_tracker() -> None:
    """AOTAutograd's `PhiloxStateTracker` keeps the last trace's seed and offset as class attributes: FakeTensors,
    and through their mode that trace's ShapeEnv. A kind compiled from an empty cache (traced by AOTAutograd here,
    not loaded) kept one ShapeEnv alive that way (forty-first and forty-second sessions, both AMD EPYCs). Each
    AOTAutograd trace resets the tracker before it starts; so does this, after one ends."""
    try:
        from torch._decomp.decompositions_for_rng import PhiloxStateTracker
    except ImportError:
        return
    if callable(getattr(PhiloxStateTracker, "reset", None)):
        PhiloxStateTracker.reset()


def _drop_cache_artifacts() -> None:
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return
    if callable(getattr(CacheArtifactManager, "clear", None)):
        CacheArtifactManager.clear()


def _malloc_trim():
    """glibc's `malloc_trim`, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def _trim_heap() -> None:
    """Give the pages a compile freed back to the system. glibc keeps freed memory in its arenas (the worker
    thread's among them) for reuse, so a compile from scratch, whose lowering peaks at tens of MiB, left the
    process that much larger: 14 kinds compiled from an empty inductor cache (f32 fixture) +216.5 MiB, with a
    trim after each +191.7 (one run each; ~0.1 ms a trim; docs/benchmarks.md, thirty-ninth session). What is
    still in use stays."""
    if _TRIM is not None:
        _TRIM(0)


def _drop_wrapper_state() -> None:
    # every compiled function, each time: what a walk drops is gone, and ids kept from an earlier walk could
    # name new objects once those they named died
    stack = [f for name, f in list(globals().items()) if name.startswith("__compiled_fn")]
    seen: set[int] = set()
    while stack:
        f = stack.pop()
        attrs = getattr(f, "__dict__", None)
        if attrs is None or id(f) in seen:
            continue
        seen.add(id(f))
        for name in _TRACE_CONVENIENCES:
            attrs.pop(name, None)
        for name in _GRAPH_TEXTS:         # a field of the graph's dataclass, or a functools.wraps copy of it
            if isinstance(attrs.get(name), str):
                attrs[name] = ""
        if isinstance(attrs.get("_fx_graph_cache_debug_lines"), list):   # the cache key's printed inputs
            attrs["_fx_graph_cache_debug_lines"] = []
        for name in ("serialize_fn", "serialize"):   # a SerializableCompiledFunction's, and copies of it
            if isinstance(attrs.get(name), types.FunctionType):
                attrs[name] = _unserializable
        stack.extend(v for v in (attrs.get("__wrapped__"), attrs.get("_torchdynamo_orig_callable"),
                                 attrs.get("compiled_fn")) if v is not None)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:            # an empty cell
                continue
            if _compile_wrapper(v):
                stack.append(v)
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:
        return
    for mod in list(getattr(PyCodeCache, "modules", ())):
        for name in _MODULE_SOURCES:
            mod.__dict__.pop(name, None)


def _unserializable():
    raise RuntimeError("mtpchat's compiled steps dropped this graph's serialized form after compiling it "
                       "(engine.model.steps._drop_trace_leftovers)")


def _drop_shape_envs() -> None:
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
    except ImportError:
        return
    for v in vars(ShapeEnv).values():
        if callable(getattr(v, "cache_clear", None)):
            v.cache_clear()
    for o in gc.get_objects():
        if type(o) is ShapeEnv:
            if isinstance(getattr(o, "tracked_fakes", None), list):
                o.tracked_fakes.clear()
            if isinstance(getattr(o, "fake_tensor_cache", None), dict):
                o.fake_tensor_cache.clear()
    if callable(getattr(FakeTensorMode, "cache_clear", None)):
        FakeTensorMode.cache_clear()


# Dynamo specialises the ints 0 and 1: a graph traced at slot 2 served no call for slot 0 or 1 (and one more
# specialisation, since mended, gave every slot a graph of its own), so a 4-slot server compiled each kind of
# call for one sequence up to four times (thirty-eighth session). The step functions' int arguments that
# carry a start or a key count reach a graph lifted by _LIFT, never 0 or 1, and the step lowers them again
# inside the graph (a subtraction on a symbol); so does a slot other than 0, so one graph serves slots 1 and
# up. Slot 0, a one-user app's, stays a constant of its graph: with the slot a symbol the demo model's rounds
# (k = 3) ran ~3 % slower (0.951 / 0.988, paired, both orders), its plain steps as fast (0.986 / 1.016).
_LIFT = 2
# per kind, the positions in the step's arguments of `n_keys` and of `single` (slot, start) or None
_SLOT_INTS = {"main": (4, 5), "mtp": (5, 6), "chain": (5, 6), "round": (5, 6, 8, 9)}


def _shift(kind: str, args: tuple, by: int) -> tuple:
    """args with their start and key-count ints, and a slot other than 0, moved by `by` (+_LIFT before a
    compiled call, -_LIFT in the step function)."""
    out = list(args)
    for i in _SLOT_INTS[kind]:
        v = out[i]
        # (traced, a key count is a SymInt, not an int: the tuple is the test)
        out[i] = None if v is None else (v[0] + by if v[0] else 0, v[1] + by) if isinstance(v, tuple) else v + by
    return tuple(out)


def _main_step(model, *args):
    # T is fixed per graph, so a verification's per-token delta-rule loop (T <= RECURRENT_MAX_T) unrolls
    # into one graph: the demo model verifies 4 rows in 1.42 plain steps this way, 1.64 with the chunked
    # form (same process, interleaved), and the recurrence is the one plain decoding runs
    return model._main(*_shift("main", args, -_LIFT))


def _mtp_step(model, *args):
    return model._mtp(*_shift("mtp", args, -_LIFT))


def _chain_step(model, *args):
    return model._chain(*_shift("chain", args, -_LIFT))


def _round_step(model, *args):
    return model._round(*_shift("round", args, -_LIFT))


_STEPS = {"main": _main_step, "mtp": _mtp_step, "chain": _chain_step, "round": _round_step}


def _weights_static(model) -> None:
    """Give the packed weights' tensors static shapes in the traces. They are plain tensor attributes,
    not parameters, so `dynamic=True` made their sizes symbols: the Q8_0 block size 32 became a loop
    bound the C++ compiler could not unroll or vectorize for (0.8B shape: 52 ms a step, 2 threads)."""
    from engine.kernels import PackedWeight
    weights = [v for mod in [*model.modules(), *model.draft_modules()] for v in vars(mod).values()]
    # the draft heads too (held outside any module): unmarked, a Q8_0 head's blocks per row and block size
    # were symbols, so each draft's head product ran loops of unknown bounds with a masked tail
    for v in [*weights, *model.draft_heads()]:
        if isinstance(v, PackedWeight):
            for t in v.parts.values():
                torch._dynamo.mark_static(t)


def _one(single) -> tuple[bool, int] | None:
    """A single-sequence call's slot and start classes as its kind keeps them, None for several sequences:
    whether the slot is 0 (a constant of its graph) or another (one graph serves them all: `_LIFT`), and
    whether the start is 0 or later. A start of 0 can make the key count 1, a size-1 dimension that
    broadcasts, which a graph traced at a later start guards against; such a call (a one-token prompt's
    first step) is a kind of its own, compiled in the background rather than retraced in the caller's
    thread."""
    return None if single is None else (single[0] == 0, min(single[1], 1))


def _fixed_batch(single, B: int, T: int) -> int:
    """B when a call of several sequences has few enough rows (B x T) for per-row products, else 0.
    Such a kind is compiled for its B (at most ROW_PRODUCTS_MAX kinds): with the library's small-M product
    a server's batch of 2 demo-model plain steps cost 2-5 single steps, with per-row products 1.2."""
    return B if single is None and B * T <= ROW_PRODUCTS_MAX else 0


def _step1_rows(t: int, B: int, row_products: bool) -> int | bool:
    """A chain's or round's step-1 length as its kind of call holds it. Step 1 writes t - 1 cache rows per
    sequence; where they take per-row products (B x (t - 1) <= ROW_PRODUCTS_MAX in a graph traced with them)
    their count is a constant of the graph, so t is part of the kind; else one graph serves every t > 1."""
    return t if row_products and B * (t - 1) <= ROW_PRODUCTS_MAX else t == 1


# values a global guard keeps checking: plain data a module may set at run time (a flag, a constant);
# guards on anything else global are guards on code
_GUARDED_GLOBAL_VALUES = (bool, int, float, str, bytes, type(None), tuple, list, dict, set, frozenset)
# the row-products flag is part of each kind (`_call` checks that a kind keeps one value) and each kind has a
# code object of its own, so its graphs need no guard on it: the worker sets it while it traces, and a ready
# kind's graph runs beside that whatever the flag then is (`_call`)
_ROW_PRODUCTS_GUARD = "_dot_model_dot_layers']._row_products"


def _guard_filter(entries) -> list[bool]:
    """Which of a new graph's guards to keep: none on the model's modules (they never change after
    loading), and of the guards on globals only those on plain data. The others check that a module,
    function, class or builtin a graph reached through a global (`torch.cat`, `fused.realize`, the
    identity of `engine.kernels.fused` as several modules import it, a function's `__code__`) is still
    the same object: code, which nothing rebinds while the app runs. Those were most of a round's
    guards, several of them Python lambdas: checking a fused round's guards took 88 -> 56 us on the
    demo model (AMD EPYC), a plain step's 26 -> 18 us."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [k and (not e.is_global or (isinstance(e.value, _GUARDED_GLOBAL_VALUES)
                                       and not e.name.endswith(_ROW_PRODUCTS_GUARD)))
            for k, e in zip(keep, entries, strict=True)]


def _mark_batch(key: tuple, args: tuple) -> None:
    """For a kind compiled for one batch size (every key ends with it: B > 0, else 0), make the leading
    dim of its per-sequence tensors static when tracing (dynamic=True would make B a symbol, and per-row
    products need it fixed), and for a kind of any batch size dynamic; later calls pass the graph's size
    guards as they are."""
    B = key[-1]
    for a in args:
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            continue
        if B > 0 and a.shape[0] == B:
            torch._dynamo.mark_static(a, 0)
        elif B == 0 and 0 in getattr(a, "_dynamo_static_indices", ()):
            # a mark left by a kind of fixed batch size on a tensor calls share (the slots' index tensor, one
            # per slot list): traced with it, a dynamic-batch kind's graph was made for that B only, and a
            # call of another B retraced it in the decoding thread (thirty-eighth session)
            a._dynamo_static_indices = a._dynamo_static_indices - {0}


def _guarded_entries(fn) -> list[tuple[object, types.FunctionType]]:
    """The graphs dynamo holds for one compiled kind, in its lookup order: (guards, the entry's code as a
    function of the step's own arguments). Calling an entry's code runs the graph as dynamo would after its
    guards pass, without dynamo's frame hook and the wrappers around it: a compiled call of the demo model's
    plain step 470 -> 430 us on the AMD EPYC (guards checked, same process; 410 us unchecked). Empty where
    this torch keeps its entries otherwise: every call then goes through dynamo."""
    listing = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    listing = getattr(listing, "_debug_get_cache_entry_list", None)
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    if listing is None or not isinstance(orig, types.FunctionType):
        return []
    out = []
    try:
        for entry in listing(orig.__code__):
            guards, code = entry.guard_manager, entry.code
            if not hasattr(guards, "check") or code.co_freevars or code.co_argcount != orig.__code__.co_argcount:
                return []
            out.append((guards, types.FunctionType(code, orig.__globals__, orig.__name__, orig.__defaults__)))
    except (AttributeError, TypeError) as exc:
        log.info("dynamo's compiled entries not usable directly (%s): compiled calls go through dynamo", exc)
        return []
    return out


def _fx_trace_once() -> None:
    """Run inductor's one plain `torch.fx.symbolic_trace` of the process now, in this thread.

    While `torch.fx.Tracer.trace` runs it replaces `torch.nn.Module.__call__` for the whole process, and
    a module called from another thread then goes through the tracer, which rejects modules outside the
    traced root (NameError "module is not installed as a submodule"). Inductor traces this way once per
    process (`loop_body.InterpreterShim._dummy_gm`, cached) during its first lowering: in the background
    worker that caught the decode thread's eager step running at the same moment (`mtpchat bench
    --wrong-drafts` failed so, twice). Done here, before any worker starts, it never happens there; the
    worker's other traces (make_fx's tracer) let other threads' module calls through unchanged."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except (ImportError, AttributeError) as exc:   # another torch: nothing of the kind to run first
        log.info("inductor's first fx trace not found (%s): background compiles may race eager steps", exc)


# -- a child process that compiles (engine.model.compile_child) ------------------------------------------
_CHILD_ENV = "MTPCHAT_COMPILE_CHILD"   # 0: every kind compiles in the process that runs it
# a child loads the model again and holds a compile's state (torch alone ~220 MiB; 0.5-0.75 GiB in all while
# it compiled a 4-slot server's kinds of the f32 fixture): it runs only where the file and this much more fit in
# half the memory available
_CHILD_OVERHEAD = 1 << 30


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _child_off(model, background: bool) -> str | None:
    """Why kinds cannot compile in a child process for this model, None where they can: background
    compiles of a model on CPU loaded from a file (`Qwen35Model.recipe`) that fits in memory a second time,
    with room for a compile (`_CHILD_OVERHEAD`)."""
    if os.environ.get(_CHILD_ENV, "1").strip() == "0":
        return f"{_CHILD_ENV}=0"
    if not background:
        return "foreground compiles"
    if getattr(sys, "frozen", False):   # a bundled app: its executable is not a Python that runs `-m`
        return "a frozen build"
    recipe = getattr(model, "recipe", None)
    if recipe is None or model.device.type != "cpu":
        return "a model not loaded from a file on CPU"
    try:
        size = os.path.getsize(recipe["path"])
    except OSError as exc:
        return f"its file is not readable ({exc.strerror})"
    avail = _available_memory()
    if avail is not None and size + _CHILD_OVERHEAD > avail / 2:
        return (f"the file ({size / 2**20:.0f} MiB) and a compile's 1 GiB are over half the memory available "
                f"({avail / 2**20:.0f} MiB)")
    return None


def _cache_and_single(kind: str, args: tuple) -> tuple:
    """A step's cache and its single sequence's (slot, start) or None, where a `kind` of step takes them
    (`main` has no hidden rows before the cache)."""
    return (args[1], args[5]) if kind == "main" else (args[2], args[6])


def _fx_cache_misses() -> int:
    """Inductor's FX graph cache misses so far in this process (graphs it compiled rather than loaded)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return counters["inductor"]["fxgraph_cache_miss"]


class _CompileChild:
    """`python -m engine.model.compile_child` with a pipe each way; `compile(job)` waits for its answer
    (the calling thread holds no GIL meanwhile). Its stdout is discarded; its stderr is this process's."""

    def __init__(self):
        import engine
        root = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        to_child, from_parent = os.pipe()
        from_child, to_parent = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.model.compile_child", str(to_child),
                                          str(to_parent)], pass_fds=(to_child, to_parent), env=env,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except BaseException:
            for fd in (from_parent, from_child):
                os.close(fd)
            raise
        finally:
            os.close(to_child)
            os.close(to_parent)
        self._send = Connection(from_parent, readable=False)
        self._recv = Connection(from_child, writable=False)

    def compile(self, job: dict) -> dict:
        self._send.send(job)
        return self._recv.recv()

    def kill(self) -> None:
        """End the child at once (a compile in progress is dropped): a `compile` waiting for it gets EOFError.
        Its pipes stay open for the thread that may be reading them, which then calls `close`."""
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        """End the child, wait for it and close the pipes (by the thread that uses them)."""
        self.kill()
        self.proc.wait()
        for c in (self._send, self._recv):
            c.close()


class CompiledSteps:
    """The compiled `_main` / `_mtp` / `_chain` of one model. `main(*args)` / `mtp(*args)` / `chain(*args)`
    take the arguments of `Qwen35Model._main` / `_mtp` / `_chain` and return the result, or None when this
    kind of call is not compiled (yet): the caller then runs the eager method."""

    def __init__(self, model, why: str, *, background: bool = True):
        _dynamo_settings()
        fused.prepare()
        _fx_trace_once()
        _weights_static(model)
        self.model, self.why, self.background = model, why, background
        self._cpu = model.device.type == "cpu"
        self._fns: dict[tuple, object] = {}    # kind of call -> its compiled function
        self._flags: dict[tuple, bool] = {}    # kind of call -> whether it is traced with per-row products
        # held by a compilation and by every compiled call: dynamo refuses a compiled call while another
        # thread traces ("FX to symbolically trace a dynamo-optimized function"), so while the worker
        # compiles, the decode thread runs eager instead of waiting
        self._lock = threading.Lock()
        self._ready: set[tuple] = set()        # kinds of call compiled and warm
        self._queued: set[tuple] = set()
        # (priority, order, job): plain steps first (see `_put`), else in the order the kinds were met
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()   # a worker leaves when the queue is empty; a job then starts one
        self._atexit = False
        self._failed: str | None = None
        self._closed = False
        # kind -> its graphs as `_guarded_entries` gives them, read after the kind's first call through dynamo
        self._entries: dict[tuple, list] = {}
        self._direct = True                    # False once an entry's guards could not be checked here
        self.n_compiled_calls = 0
        self.n_direct_calls = 0                # compiled calls that ran an entry directly (its guards passed)
        self.n_eager_calls = 0                 # calls that ran eager because their kind was not ready
        self.n_foreground_compiles = 0         # first calls of a kind compiled in the calling thread (blocking)
        # calls of a ready kind that none of its graphs' guards passed, so dynamo traced it again in the calling
        # thread (the decoding thread: every request waits for that compile); logged with the failed guards
        self.n_calling_thread_traces = 0
        # a child process that compiles each kind first (engine.model.compile_child), so this process loads
        # it from inductor's cache; None while none runs, and why not where it cannot (`_child_off`)
        self._child: _CompileChild | None = None
        self._child_off = _child_off(model, background)
        self.n_child_compiles = 0              # kinds the child compiled (or loaded) before this process did
        self.n_child_cache_misses = 0          # of those, kinds whose graph this process still had to compile

    # -- state -------------------------------------------------------------------------------------
    def status(self) -> tuple[str, str]:
        if self._failed is not None:
            return "eager", self._failed
        how = "compiled in the background, eager until ready" if self.background else "compiled on first use"
        return "compiled", f"{self.why}; {how}"

    @property
    def kinds_ready(self) -> int:
        return len(self._ready)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued kind is compiled (or failed). True when nothing is pending."""
        if self._worker is None or not self._worker.is_alive():
            return True
        done = threading.Event()
        self._put(done, _DRAIN)
        self._start_worker()
        return done.wait(timeout)

    # -- calls -------------------------------------------------------------------------------------
    # A kind of call has a fixed row count when it serves one sequence (B = 1) and its T is part of its
    # key, or several sequences with B x T <= ROW_PRODUCTS_MAX and B part of its key (a server's batch of
    # plain steps, of rounds with B x (k+1) such rows and their chains' steps 2..k); its weight multiplies
    # then run as per-row products (engine.model.layers.matmul_weight).

    def main(self, tokens, cache, slot_idx, positions, n_keys, single, logits, chunk, gdn_steps):
        B, T = tokens.shape
        batch = _fixed_batch(single, B, T)
        key = ("main", _one(single), T, logits, bool(gdn_steps), cache.n_slots == 1, cache.kv_dtype, batch)
        return self._call(key, (tokens, cache, slot_idx, positions, n_keys, single, logits, chunk, gdn_steps),
                          tokens.shape, (single is not None and T <= ROW_PRODUCTS_MAX) or batch > 0)

    def mtp(self, tokens, hidden, cache, slot_idx, positions, n_keys, single, logits, n):
        # the MTP graph is dynamic in T (> 1); the main one specialises T (the verification's length)
        B, T = tokens.shape
        batch = _fixed_batch(single, B, T) if T == 1 else 0
        key = ("mtp", _one(single), T == 1, logits, n, cache.n_slots == 1, cache.kv_dtype, batch)
        return self._call(key, (tokens, hidden, cache, slot_idx, positions, n_keys, single, logits, n),
                          tokens.shape, (single is not None and T == 1) or batch > 0)

    def chain(self, tokens, hidden, cache, slot_idx, positions, n_keys, single, k, n):
        # k is fixed per graph (the chain unrolls); so is the first step's length T for one sequence with
        # T <= ROW_PRODUCTS_MAX (T = 1 + the queued entries: a few kinds), else it is dynamic
        B, T = tokens.shape
        fixed = single is not None and T <= ROW_PRODUCTS_MAX
        batch = _fixed_batch(single, B, 1)       # several sequences: steps 2..k have B rows

        # the draft vocabulary and weights and wrong drafts are part of the kind (the traced graph reads them; module guards
        # are off); so is T wherever step 1's rows take per-row products (`_step1_rows`)
        def key(t: int) -> tuple:
            return ("chain", _one(single), _step1_rows(t, B, fixed or batch > 0), k, n, cache.n_slots == 1,
                    cache.kv_dtype, self.model.draft_vocab, self.model.draft_weights, self.model.wrong_drafts, batch)

        # the lengths a round's step 1 usually has (the last round's accepted drafts + the pending token)
        # compile together, so a request does not meet a new kind of chain at every new acceptance count: for
        # one sequence they are one length, padded (`step1_rows`)
        def siblings() -> list:
            ts = [self.step1_rows(k)] if B == 1 else range(1, k + 2)
            return [(key(t), (B, t)) for t in ts if 0 < t <= ROW_PRODUCTS_MAX and t != T] if fixed else []

        return self._call(key(T), (tokens, hidden, cache, slot_idx, positions, n_keys, single, k, n), tokens.shape,
                          fixed or batch > 0, siblings)

    def round(self, tokens, hidden, cache, slot_idx, c_pos, c_keys, c_single, m_pos, m_keys, m_single, k, n, chunk):
        # a chain then a verification of k+1 rows in one graph, one kind per k and step-1 length T: with
        # per-row products (one sequence with k+1 <= ROW_PRODUCTS_MAX rows, or several whose B x (k+1) rows fit
        # them, as a batch of plain steps is) the verification's rows have the plain step's numerics, and
        # every product's row count is traced as a constant, step 1's T - 1 cache rows included. So each T
        # is a graph of its own, and a kind per T makes it one the worker compiles: with T symbolic in the
        # key, each new T recompiled in the decode thread while it waited (demo model, k = 4: T = 3, 4, 5
        # each stalled it 60-72 s with an empty inductor cache, ~4.4 s with a warm one). Callers pad step 1 to
        # one length per k (one sequence: `step1_rows`; several: k + 1), so a request meets one such kind per k
        B, T = tokens.shape
        batch = _fixed_batch(c_single, B, k + 1)
        fixed = (c_single is not None and k + 1 <= ROW_PRODUCTS_MAX) or batch > 0

        def key(t: int) -> tuple:
            # a backlog too long for per-row products takes the library product: one graph for every such t
            return ("round", _one(c_single), _step1_rows(t, B, fixed), k, n, cache.n_slots == 1, cache.kv_dtype,
                    self.model.draft_vocab, self.model.draft_weights, self.model.wrong_drafts, batch)

        # the length step 1 usually has (the last round's accepted drafts + the pending token, padded: for one
        # sequence to `step1_rows`, for several to k + 1, `Qwen35Model.step1_pads`) compiles along; a longer
        # one (a plain-step backlog) or an unpadded one (rows at the cache's end) is queued when it first comes
        def siblings() -> list:
            ts = [self.step1_rows(k)] if B == 1 else [k + 1]
            return [(key(t), (B, t)) for t in ts if t > 0 and key(t) != key(T)] if fixed else []

        return self._call(key(T), (tokens, hidden, cache, slot_idx, c_pos, c_keys, c_single, m_pos, m_keys, m_single,
                                   k, n, chunk), tokens.shape, fixed, siblings)

    @staticmethod
    def step1_rows(k: int) -> int:
        """The length one sequence's chain (or round) of k drafts pads its step 1 to (see
        `Qwen35Model.step1_pad`), 0 for none. Where step 1's rows take per-row products its length is part of
        the kind, a graph of its own: padded, a chain of k drafts is one kind instead of one per count of
        queued entries (the last round's accepted drafts, 0..k). At least STEP1_MIN_ROWS rows, so the
        adaptive gate's baseline steps ride along in its first round. A padding row costs its keys and
        values only (a `write_kv` row)."""
        n = max(k + 1, STEP1_MIN_ROWS)
        return n if n <= ROW_PRODUCTS_MAX else 0

    def _call(self, key, args, shape, fixed_rows: bool, siblings=list):
        """siblings() -> [(key, shape)]: kinds to queue along with this one (called only when queueing)."""
        if self._failed is not None:
            return None
        if self._flags.setdefault(key, fixed_rows) != fixed_rows:
            raise RuntimeError(f"compiled steps: kind {key[:4]} called with and without per-row products")
        if key not in self._ready and self.background:
            if key not in self._queued and not self._closed:
                for kk, sh in [(key, tuple(shape)), *siblings()]:
                    if kk not in self._queued and kk not in self._ready:
                        self._queued.add(kk)
                        self._put((kk, sh, args, fixed_rows))
                self._start_worker()
            self.n_eager_calls += 1
            return None
        fn = self._fn(key)
        # Without the lock (the worker holds it while it compiles another kind) a ready kind's graph still runs
        # directly, which needs neither dynamo's frame hook nor the lock, where its guards pass; else the call
        # runs eager. The row-products flag is then the worker's, for its trace (see `_ROW_PRODUCTS_GUARD`).
        # Eager steps beside a compile wait for the GIL at every torch op while the worker runs Python
        # (dynamo, inductor's lowering): the demo model's plain step took 4.5 ms (median; p90 41 ms) eager
        # beside a compile against 0.55 ms compiled alone, and 1.2 ms (p90 2.4 ms) as a compiled call beside
        # it (2-vCPU Xeon, docs/benchmarks.md, thirty-second session).
        locked = self._lock.acquire(blocking=not self.background)
        try:
            if locked:
                _dynamo_settings()       # a first call in this thread may trace (foreground) or retrace
                set_row_products(fixed_rows and self._cpu)
            lifted = _shift(key[0], args, _LIFT)
            out = self._run_entry(key, lifted)
            if out is None and locked:   # through dynamo, which may trace: the marks count only then
                known = self._entries.get(key)
                _mark_batch(key, args)
                t0 = time.perf_counter()
                with _tracing(key):
                    out = fn(self.model, *lifted)
                # the graphs dynamo now holds (a first call, or a recompile: its guards had failed); not read
                # again where this torch gave none usable or they could not be checked
                if self._direct and (known is None or known):
                    self._entries[key] = _guarded_entries(fn)
                    if known and len(self._entries[key]) > len(known):
                        self._traced_here(key, known, lifted, time.perf_counter() - t0)
            if out is None:              # beside a compile, where no graph's guards passed
                self.n_eager_calls += 1
                return None
            if key not in self._ready and not self.background:
                self.n_foreground_compiles += 1
                _drop_trace_leftovers()
            self._ready.add(key)
            self.n_compiled_calls += 1
            return out
        except MtpchatError:
            raise
        except Exception as exc:   # no working toolchain at run time: the eager path runs the same math
            self._fail(exc)
            return None
        finally:
            if locked:
                self._lock.release()

    def _traced_here(self, key: tuple, known: list, args: tuple, seconds: float) -> None:
        """Count and log a ready kind traced again in the calling thread: none of its graphs' guards passed
        (`known`, checked again here for their reasons), so dynamo compiled another graph while the caller
        waited."""
        self.n_calling_thread_traces += 1
        frame = {"model": self.model, "args": args}
        why = []
        for guards, _ in known:
            try:
                why.append("; ".join(p.split("  #")[0] for p in guards.check_verbose(frame).verbose_code_parts))
            except Exception as exc:   # guards of another torch: the count and the time still tell
                why.append(f"(unreadable: {type(exc).__name__})")
        log.warning("compiled step %s traced again in the calling thread (%.1f s): no graph's guards passed: %s",
                    key, seconds, " | ".join(why))

    def _run_entry(self, key: tuple, args: tuple):
        """The result of the first of the kind's graphs whose guards pass for these arguments (the one
        dynamo would run), or None: then the call goes through dynamo, which recompiles where none passes.
        The frame the guards see is the step function's: `model` and the tuple `args` (lifted, `_LIFT`)."""
        entries = self._entries.get(key)
        if entries and self._direct:
            frame = {"model": self.model, "args": args}
            for guards, run in entries:
                try:
                    passed = guards.check(frame)
                except Exception as exc:   # guards that read more than this frame: dynamo runs every call
                    log.info("compiled entries not checkable directly (%s): compiled calls go through dynamo", exc)
                    self._direct = False
                    return None
                if passed:
                    self.n_direct_calls += 1
                    return run(self.model, *args)
        return None

    def _fn(self, key: tuple):
        """The compiled function of one kind of call. Each kind gets a code object of its own, so a
        call checks the guards of its one graph only (dynamo tries a code object's graphs in turn:
        with every kind on one code object, the lookup cost ~90 us per call on the demo model)."""
        fn = self._fns.get(key)
        if fn is None:
            step = _STEPS[key[0]]
            # the model's modules never change after loading and each model has code objects of its
            # own, so guards on module parameters are dropped (about 5 % of a small model's step); so are
            # the guards on code (see `_guard_filter`)
            opts = {}
            if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
                opts["guard_filter_fn"] = _guard_filter
            if self.model.device.type == "cpu":
                # the graph's host code as C++ instead of Python: verifications ~10 % faster, steps ~4 %
                opts["cpp_wrapper"] = True
                # intermediate buffers as slices of one pool allocated per call, not one allocation each
                # (a k = 3 round of the demo model made ~210, now 12): rounds ~8 % faster on the AMD EPYC,
                # compiling ~4 % slower (docs/benchmarks.md, twenty-first session)
                opts["memory_planning"] = True
                # the kernels and the graph's host code as two translation units, the host code at -O2 (inductor's
                # default for it, -O1, made rounds ~2 % slower), not one unit at -O3: from an empty cache a kind of
                # round of the demo model compiled in ~0.75x the time (61-66 s against 80-90 s side by side, host at
                # -O1; -O2 took 1.04x -O1), its rounds as fast (2-vCPU Xeon, docs/benchmarks.md, thirty-third session)
                from torch._inductor import config as inductor_config
                # the kernels built with -ffp-contract=fast (inductor's default is off): a product's
                # multiply and add, and a K-quant weight's s * q - m, become one fused multiply-add.
                # Q4_K_M and Q8_0 fixtures: plain steps ~0.93x and verifications of 5 rows ~0.91x the
                # time, the F32 demo as fast (one process, alternating; AMD EPYC Zen 4, docs/benchmarks.md,
                # forty-eighth session). One rounding instead of two moves logits by ~1e-6; a row's sum is
                # contracted alike in a plain step and in a verification (tests/engine/model/test_steps.py)
                if getattr(inductor_config.cpp, "enable_floating_point_contract_flag", None) is not None:
                    opts["cpp.enable_floating_point_contract_flag"] = "fast"
                if hasattr(inductor_config, "cpp_wrapper_build_separate") and hasattr(
                        inductor_config.aot_inductor, "compile_wrapper_opt_level"):   # an option unknown fails the compile
                    opts["cpp_wrapper_build_separate"] = True
                    opts["aot_inductor.compile_wrapper_opt_level"] = "O2"
            fn = torch.compile(_fresh(step, f"mtpchat_{key[0]}_step_{next(_ids)}"), dynamic=True, options=opts or None)
            self._fns[key] = fn
        return fn

    # -- background compilation ---------------------------------------------------------------------
    # A worker leaves as soon as the queue is empty, and the next queued kind starts another. On CPU the
    # OpenMP runtime (libgomp) gives every thread that runs a parallel region threads of its own, kept until
    # that thread ends; while the worker's (made by its warm-up calls) were alive beside the decoding
    # thread's, more threads than CPUs were managed, so libgomp stopped letting idle ones spin between
    # parallel regions, and each of a step's regions woke its threads from sleep: the demo model's compiled
    # plain step took 3.1 ms instead of 0.47 on the 2-vCPU AMD EPYC (docs/benchmarks.md, thirty-first session)
    def _start_worker(self) -> None:
        with self._worker_lock:
            if self._worker is not None:
                return
            # not a daemon: interpreter shutdown while inductor compiles aborts the process, so at exit
            # the queue is dropped and the compilation in progress is waited for
            self._worker = threading.Thread(target=self._work, name="mtpchat-compile")
            register = getattr(threading, "_register_atexit", None)
            if register is not None and not self._atexit:
                register(self.close)
                self._atexit = True
            self._worker.start()

    def _put(self, job, priority: int | None = None) -> None:
        """Queue a job. Kinds of plain decode step (one token, `main`) come first: they carry every request
        while the rest compile (a round whose kind is not ready runs eager, and `auto` measures it slow), so
        on a cold start `serve --mtp auto` reached its compiled plain step after the MTP kinds its first
        request met: ~50 s of eager steps on the 2-vCPU Xeon (docs/benchmarks.md, thirty-second session)."""
        if priority is None:
            key = job[0]
            priority = _PLAIN if key[0] == "main" and key[2] == 1 and not key[4] else _OTHER
        self._jobs.put((priority, next(self._order), job))

    def _next_job(self):
        """The next queued job, or None when there is none or `close()` asked (the worker then ends; see
        `_start_worker`; after `close()` a later worker skips what is left)."""
        child = None
        with self._worker_lock:
            job = None if self._jobs.empty() else self._jobs.get()[2]
            if job is None:
                self._worker = None
                # the child's compile state and model copy go with the worker (the next kind starts another);
                # taken here, under the lock, so no next worker has made its own child yet
                child, self._child = self._child, None
        if child is not None:
            child.close()
        return job

    def close(self) -> None:
        """Drop the kinds still queued and end the compile child (its compile in progress is dropped); a
        compile in this process finishes. The worker then exits."""
        self._closed = True
        self._put(None, _CLOSE)
        child = self._child
        if child is not None:   # the worker, waiting for it, gets EOFError and closes it
            child.kill()

    def _work(self) -> None:
        _dynamo_settings()
        while True:
            job = self._next_job()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            key, shape, args, fixed_rows = job
            if self._failed is not None or self._closed:
                continue
            try:
                apart = self._compile_apart(key, shape, args, fixed_rows)
                if self._closed:      # `close()` ended the child's compile of it: this one is dropped too
                    continue
                misses = _fx_cache_misses()
                with torch.inference_mode(), _GilHandoff():
                    self._warm(key, shape, args, fixed_rows)
                if apart and _fx_cache_misses() > misses:
                    self.n_child_cache_misses += 1
                    log.info("compiled step %s: the child's graph was not in the cache here", key[:5])
                self._ready.add(key)
                log.info("compiled step ready: %s", key[:5])
            except Exception as exc:
                self._fail(exc)

    def _compile_apart(self, key, shape, args, fixed_rows: bool) -> bool:
        """Have the child compile this kind (writing inductor's cache) before `_warm` traces it here. False
        where it did not: no child for this model (`_child_off`), arguments it cannot rebuild, or a failure,
        which is logged; `_warm` then compiles the kind here, as without a child."""
        if self._child_off is not None or self._closed:
            return False
        try:
            job = self._child_job(key, shape, args, fixed_rows)
        except (IndexError, AttributeError, TypeError, ValueError) as exc:   # arguments not laid out as a step's
            log.info("compile child: %s not sent (%s: %s)", key[:5], type(exc).__name__, exc)
            return False
        if job is None:
            return False
        try:
            if self._child is None:
                self._child = _CompileChild()
                if self._closed:      # `close()` came while it started: it is closed with the worker
                    return False
            answer = self._child.compile(job)
        except Exception as exc:   # it could not start, died (killed, out of memory) or could not take the job
            if not self._closed:
                self._child_off = f"the compile child failed ({type(exc).__name__}: {exc})"
                log.warning("%s: kinds compile in this process from now on", self._child_off)
            child, self._child = self._child, None
            if child is not None:
                child.close()
            return False
        if not answer.get("ok"):
            log.info("compile child: %s not compiled there (%s); compiling it here", key[:5], answer.get("error"))
            return False
        self.n_child_compiles += 1
        log.info("compile child: %s compiled in %.1f s", key[:5], answer["seconds"])
        return True

    def _child_job(self, key, shape, args, fixed_rows: bool) -> dict | None:
        """What the child needs to make the same call as `_warm` will (`compile_child._fake_args`), or None
        where an argument is not plain data it can rebuild."""
        m, kind = self.model, key[0]
        cache, single = _cache_and_single(kind, args)
        # what `_warm` reads past the slots and positions (a round's own verification positions it makes)
        rest = tuple(args[6:]) if kind == "main" else (None, None, None, *args[10:]) if kind == "round" \
            else tuple(args[7:])
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in rest):
            return None
        return {"recipe": m.recipe, "draft": (m.draft_vocab, m.draft_weights, m.wrong_drafts),
                "threads": torch.get_num_threads(), "key": key, "shape": tuple(shape), "fixed_rows": fixed_rows,
                "cache": (cache.n_slots, cache.kv_dtype, cache.has_mtp, cache.buffers()[0].is_inference()),
                "single": None if single is None else (int(single[0]), int(single[1])),
                "tokens_inference": args[0].is_inference(),
                "hidden": None if kind == "main" else (args[1].dtype, args[1].is_inference()), "rest": rest}

    def _warm(self, key, shape, args, fixed_rows: bool) -> None:
        """Run the kind of call `key` once on a scratch cache shaped like the real one (same slots and
        dtypes, a short context), so the real calls find the compiled graph."""
        from engine.model.cache import ModelCache

        m = self.model
        kind = key[0]
        real, single = _cache_and_single(kind, args)
        B, T = shape
        # made like the real cache (an inference tensor or not: guards check the dispatch keys)
        with torch.inference_mode(real.buffers()[0].is_inference()):
            scratch = ModelCache(m.cfg, real.n_slots, _SCRATCH_START + T + 16, device=real.device,
                                 kv_dtype=real.kv_dtype, mtp=real.has_mtp)
        # the graph serves every slot and start of its classes (`_one`)
        slots = [single[0]] if single is not None else list(range(B))
        start = 0 if single is not None and single[1] == 0 else _SCRATCH_START
        lengths = [start] * real.n_slots
        k = args[10] if kind == "round" else args[7] if kind == "chain" else 1
        rows = T + k - 1                          # a chain's positions cover all its steps
        slots, slot_idx, positions, n_keys, single_s = m._slots(scratch, slots, B, rows, lengths)
        # a copy: the model's index tensor for these slots is the callers' too, and `_mark_batch` in the
        # decoding thread may mark it meanwhile
        slot_idx = slot_idx.clone()
        # the caller's tokens and hidden rows may be inference tensors or not: the guards check the dispatch keys
        with torch.inference_mode(args[0].is_inference()):
            tokens = torch.zeros(shape, dtype=torch.long, device=m.device)
        if kind != "main":
            with torch.inference_mode(args[1].is_inference()):
                hidden = torch.zeros(B, T, m.cfg.n_embd, dtype=args[1].dtype, device=m.device)
        if kind == "main":
            rest = args[6:]
            call = (tokens, scratch, slot_idx, positions, n_keys, single_s, *rest)
        else:
            call = (tokens, hidden, scratch, slot_idx, positions, n_keys, single_s, *args[7:])
            if kind == "round":
                # the verification starts where step 1's pending row is: T - 1 rows after the chain's start
                main = m._slots(scratch, slots, B, k + 1, [x + T - 1 for x in lengths])
                call = (*call[:7], *main[2:], *args[10:])
        _mark_batch(key, call)
        with self._lock:
            set_row_products(fixed_rows and self._cpu)
            fn = self._fn(key)
            with _tracing(key):
                fn(m, *_shift(kind, call, _LIFT))
            # its graph, for calls while the worker compiles the next kinds (`_call`)
            if self._direct:
                self._entries[key] = _guarded_entries(fn)
            _drop_trace_leftovers()   # under the lock: no trace runs in another thread meanwhile

    def _fail(self, exc: BaseException) -> None:
        if self._closed:        # interpreter shutdown stopped a compilation: nothing to report
            return
        self._failed = f"torch.compile failed ({type(exc).__name__}: {str(exc)[:200]})"
        log.warning("compiled steps unavailable, using the eager path: %s", exc, exc_info=exc)
