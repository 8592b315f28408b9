"""Fused dequantize-and-multiply over packed GGUF blocks, written once as tensor expressions.

`matmul` picks, per call: for a few rows (decode, MTP verify: M ≤ SMALL_M) a reduction over the
packed weight that inductor compiles into one C++ loop reading each weight byte once for all M rows;
for many rows (prefill) a dequantize-a-slice-then-GEMM loop whose temporaries stay in cache.
Without a working C++ compiler (or with MTPCHAT_KERNELS=eager) the same expressions run eagerly,
slice by slice, so memory stays compact. `status()` says which path runs and why.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import torch
from gguf import GGMLQuantizationType as T

from engine.kernels import codegen

log = logging.getLogger(__name__)

SMALL_M = 8                 # rows up to which the fused reduction runs (decode + verify of ≤ 7 drafts)
SLICE_WEIGHTS = 1 << 20     # weights dequantized at a time on the slice path (4 MiB of float32)

_lock = threading.Lock()
# inductor's operator that writes its input to a buffer (set by `load_realize` before tracing; None
# where this torch lacks it): compiled weight reductions read their activations through it
realize = None
_state: dict = {"mode": None, "reason": "", "compiled": {}}
# Q8_0 products of a file's blocks sum 4 groups of 8 per block (_q8_0_groups_product): set by `prepare`
_q8_0_groups = False


# -- the math, once -------------------------------------------------------------------------------

def dequant_view(t: T, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Packed parts of rows [N, ...blocks] -> float32 weights [N, K/32, 32] (one expression, so a
    compiler fuses it into the product; eagerly it is materialised for a slice of rows only)."""
    if t == T.Q8_0 and "qw" in p:   # the words layout (PackedWeight.as_words): element 8j + i of a block
        wi = p["qw"].view(torch.int32)                                          # [N, K/32, 8]
        q = torch.stack([_word_byte(wi, j) for j in range(4)], dim=-2)           # [N, K/32, 4, 8]
        return q.flatten(-2).float() * p["d"].float()
    if t == T.Q8_0:   # qs [N, K/32, 32] int8, d [N, K/32, 1] f16
        return p["qs"].float() * p["d"].float()
    if t == T.Q4_K:
        return _q4_k_weights(p).reshape(p["qs"].shape[0], -1, 32)
    if t == T.Q6_K:   # planes j of elements 128h + 32j + l -> [N, K/256, half, 4, 32]
        n = p["ql"].shape[0]
        q = torch.stack(_q6_k_planes(p), dim=-2).view(n, -1, 2, 4, 2, 16)
        sc = (p["d"].float().view(n, -1, 1, 1, 1) * p["sc"].float()).unsqueeze(-1)  # [N, B, half, 4, 2, 1]
        return (sc * q).reshape(n, -1, 32)
    if t in (T.BF16, T.F16):
        w = p["w"]
        return w.float().view(w.shape[0], -1, 32) if w.shape[-1] % 32 == 0 else w.float().unsqueeze(-1)
    if t == T.I8:     # a draft copy's rows (PackedWeight.int8_rows_of): q [N, K] int8, d [N, 1] float32
        q = p["q"].float() if "q" in p else p["qu"].to(torch.int16).float() - 128   # qu = q + 128 (as_int8_dots)
        w = q * p["d"]
        return w.view(w.shape[0], -1, 32) if w.shape[-1] % 32 == 0 else w.unsqueeze(-1)
    raise ValueError(f"no packed kernel for {t.name}")


def _rows_of(p: dict[str, torch.Tensor], idx) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in p.items()}


def dequant_rows(t: T, p: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` (any shape of ids) of a 2-D packed weight -> float32 [*idx.shape, K]."""
    idx = torch.as_tensor(idx, device=next(iter(p.values())).device)
    flat = idx.reshape(-1)
    w = dequant_view(t, _rows_of(p, flat))
    return w.reshape(*idx.shape, -1)


def dequant_gathered(t: T, p: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Experts `idx` [N, k] of a 3-D packed weight -> float32 [N, k, out, in] (an expression: inside a
    compiled step it fuses into the product that reads it)."""
    sel = {key: v[idx] for key, v in p.items()}                   # [N, k, out, ...blocks]
    lead = idx.shape + next(iter(sel.values())).shape[idx.dim():idx.dim() + 1]
    flat = {key: v.flatten(0, idx.dim()) for key, v in sel.items()}
    return dequant_view(t, flat).reshape(*lead, -1)


def small_m_product(t: T, x: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, M small -> [M, N]: one reduction per row over the same dequantized view,
    so a compiler fuses them into one pass over the weight."""
    p = _parts_dict(t, parts)
    if "qw" in p:
        return _q8_0_words_product(x, p["qw"], p["d"])
    if t == T.I8:
        # one scale per row, applied once to the row's sum: the reduction over K is int8 -> float times the
        # activation only (a Q8_0 block's scale is a third multiply per weight): a draft step's products 0.75x
        # Q8_0's time alone, a draft row ~7 % cheaper in a chain (AVX-512 Xeon, docs/benchmarks.md, 35th session)
        q = p["q"]
        return torch.stack([(q.float() * x[m]).sum(-1) for m in range(x.shape[0])], dim=0) * p["d"].view(1, -1)
    if t == T.Q8_0 and _q8_0_groups:   # AVX2 (measured there); AVX-512's 16 lanes would span two blocks' scales
        qs = p["qs"]
        return _q8_0_groups_product(x, lambda j: qs[..., 8 * j:8 * j + 8], p["d"])
    if t == T.Q4_K:
        return _q4_k_product(x, p)
    if t == T.Q6_K:
        return _q6_k_product(x, p)
    w = dequant_view(t, p)  # [N, K/32, 32]
    g = w.shape[-1]
    return torch.stack([(w * x[m].view(1, -1, g)).sum((-1, -2)) for m in range(x.shape[0])], dim=0)


# The K-quants' products: the weight every row's reduction reads must stay a cheap expression of few inputs.
# Inductor writes out an expression that several reductions read once it reads more than 4 inputs
# (`realize_reads_threshold`): with the scales and minimums decoded in it, a product of 2-8 rows (an MTP
# verification, a commit) wrote the whole dequantized matrix as float32 and read it back, and its rows' sums
# differed in the last bits from the same row's product alone. So the per-sub-block scales (and Q4_K's
# minimums) are decoded first into small buffers (one value per 16 or 32 weights), and the weight reads them
# and its quants only.

def _q4_k_weights(p: dict[str, torch.Tensor], keep=lambda v: v) -> torch.Tensor:
    """A Q4_K weight [N, K/256, 8, 32] (sub-block c of 32 along dim 2): s * q - m per sub-block.
    qs [N, K/256, 4, 32] bytes (low nibble: sub-block 2c, high: 2c+1), d/dmin [N, K/256, 1], sc/mn [N, K/256, 8].
    Nibbles by masks, no shifts (CPUs have no 8-bit vector shift; ATen emulates one with shuffles): a high
    nibble stays 16x its value, and its sub-block's scale takes the 1/16 (exact: powers of 2).
    keep: applied to the scales s and minimums m, one value per sub-block (`realized` in a product)."""
    qs, n, dev = p["qs"], p["qs"].shape[0], p["qs"].device
    unit = torch.tensor([1.0, 1 / 16] * 4, device=dev).view(8)                 # sub-blocks 2c, 2c+1
    s = keep(p["d"].float() * p["sc"].float() * unit).unsqueeze(-1)          # d·sc per sub-block
    m = keep(p["dmin"].float() * p["mn"].float()).unsqueeze(-1)              # dmin·m per sub-block
    masks = torch.tensor([15, 240], dtype=torch.uint8, device=dev).view(2, 1)
    return s * (qs.unsqueeze(-2) & masks).reshape(n, -1, 8, 32).float() - m


def _q6_k_planes(p: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """A Q6_K weight's quants (value - 32, float32) as four planes j, each [N, K/256, half, 32] holding
    elements 128h + 32j + l. ql [N, K/256, half, j&1, 32] (low nibble: j < 2, high: j >= 2), qh
    [N, K/256, half, 32] (bits 2j, 2j+1). Bit fields by constant masks and exact power-of-2 factors, no 8-bit
    shifts (see `_q4_k_weights`)."""
    ql, qh = p["ql"], p["qh"]
    planes = []
    for j in range(4):
        lo = (ql[..., j % 2, :] & (15 if j < 2 else 240)).float()
        if j >= 2:
            lo = lo * (1 / 16)
        hi = (qh & (3 << 2 * j)).float() * (16.0 / (1 << 2 * j))        # bits 2j, 2j+1 -> value << 4
        planes.append(lo + hi - 32)
    return planes


def _q4_k_product(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """small_m_product of a Q4_K weight: scales and minimums decoded first (dequant_view's values, summed in
    the same order)."""
    w = _q4_k_weights(p, keep=realized)                                  # [N, K/256, 8, 32]
    xv = x.view(x.shape[0], -1, 8, 32)
    return torch.stack([(w * xv[m]).sum((-1, -2, -3)) for m in range(x.shape[0])], dim=0)


def _q6_k_product(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """small_m_product of a Q6_K weight plane by plane (`_q6_k_planes`): no table of masks indexed per
    element. Scales decoded first."""
    n = p["ql"].shape[0]
    s = realized(p["d"].float().view(n, -1, 1, 1, 1) * p["sc"].float())    # [N, K/256, half, j, 2]
    xv = x.view(x.shape[0], -1, 2, 4, 2, 16)                             # [M, K/256, half, j, 2, 16]
    planes = [s[..., j, :].unsqueeze(-1) * q.view(n, -1, 2, 2, 16)        # [N, K/256, half, 2, 16]
              for j, q in enumerate(_q6_k_planes(p))]
    rows = []
    for m in range(x.shape[0]):
        acc = None
        for j in range(4):
            term = (planes[j] * xv[m, :, :, j]).sum((-1, -2, -3, -4))
            acc = term if acc is None else acc + term
        rows.append(acc)
    return torch.stack(rows, dim=0)


def _q8_0_words_product(x: torch.Tensor, qw: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """small_m_product of a Q8_0 weight in the words layout: the 4 bytes j of a block's 8 words are its
    elements 8j..8j+7. Inductor loads the words as float32 (full vector loads) and shifts them as int32 lanes."""
    wi = qw.view(torch.int32)                                   # [N, K/32, 8]
    return _q8_0_groups_product(x, lambda j: _word_byte(wi, j), d)


def _q8_0_groups_product(x: torch.Tensor, group, d: torch.Tensor) -> torch.Tensor:
    """small_m_product of a Q8_0 weight whose elements 8j..8j+7 of every block are `group(j)` [N, K/32, 8]:
    each group multiplies 8 contiguous activations, and the block scale multiplies the 4 groups' sum once,
    in a reduction whose vectors of 8 lanes each hold one block (no horizontal sum per block)."""
    xv = x.view(x.shape[0], d.shape[-2], 4, 8)                  # [M, K/32, j, i]: element 32b + 8j + i
    rows = []
    for m in range(x.shape[0]):
        acc = None
        for j in range(4):
            term = group(j).float() * xv[m, :, j]
            acc = term if acc is None else acc + term
        rows.append((acc * d).sum((-1, -2)))
    return torch.stack(rows, dim=0)


def _word_byte(wi: torch.Tensor, j: int) -> torch.Tensor:
    """Byte j (0 = lowest) of each int32 word, sign-extended: the words layout's quants 8j..8j+7 of a block."""
    return (wi << (24 - 8 * j)) >> 24


_PART_NAMES = {T.Q8_0: ("qs", "d"), T.Q4_K: ("qs", "d", "dmin", "sc", "mn"), T.Q6_K: ("ql", "qh", "sc", "d"),
               T.BF16: ("w",), T.F16: ("w",), T.I8: ("q", "d")}
Q8_0_WORDS = ("qw", "d")   # a Q8_0 weight in the words layout (PackedWeight.as_words)
INT8_DOTS = ("qu", "d")     # int8 rows for the CPU's 8-bit dot products (PackedWeight.as_int8_dots)


def part_names(t: T, p: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The names of a packed weight's parts in the order compiled functions take them."""
    if t == T.I8 and "qu" in p:
        return INT8_DOTS
    return Q8_0_WORDS if t == T.Q8_0 and "qw" in p else _PART_NAMES[t]


def _parts_dict(t: T, parts: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Positional parts -> names; a Q8_0 weight's words (float32) tell its layout from its quants (int8)."""
    words = t == T.Q8_0 and parts[0].dtype == torch.float32
    dots = t == T.I8 and parts[0].dtype == torch.uint8
    return dict(zip(Q8_0_WORDS if words else INT8_DOTS if dots else _PART_NAMES[t], parts, strict=True))


def sliced_product(t: T, p: dict[str, torch.Tensor], x: torch.Tensor, dequant=None) -> torch.Tensor:
    """x [M, K] -> [M, N] by dequantizing SLICE_WEIGHTS weights at a time and a GEMM per slice.
    dequant: a compiled `dequant_view` for type t (one pass over the slice) or None (eager ops)."""
    n, k = next(iter(p.values())).shape[0], x.shape[-1]  # all parts lead with the N rows
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    step = max(1, SLICE_WEIGHTS // k)
    names = part_names(t, p)
    for r0 in range(0, n, step):
        sl = {key: v[r0:r0 + step] for key, v in p.items()}
        w = (dequant_view(t, sl) if dequant is None else dequant(*(sl[m] for m in names))).reshape(-1, k)
        torch.matmul(x, w.T, out=out[:, r0:r0 + w.shape[0]])
    return out


# -- dispatch -------------------------------------------------------------------------------------

def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def status() -> tuple[str, str]:
    """('compiled' | 'eager', why). Decided once per process, on first use."""
    with _lock:
        if _state["mode"] is None:
            forced = os.environ.get("MTPCHAT_KERNELS", "").strip().lower()
            cxx = _compiler()
            if forced == "eager":
                _state.update(mode="eager", reason="MTPCHAT_KERNELS=eager")
            elif cxx is None:
                _state.update(mode="eager", reason="no C++ compiler on PATH (torch.compile's CPU backend needs one)")
            else:
                _state.update(mode="compiled", reason=f"torch.compile (inductor C++) with {cxx}")
        return _state["mode"], _state["reason"]


def prepare() -> None:
    """Before anything is traced: inductor's realize operator looked up, its partial byte loads made direct
    on AVX2 (engine.kernels.codegen), the Q8_0 product chosen (a traced function must not ask: dynamo
    cannot trace inductor's ISA probe, and a full graph that breaks falls back to eager kernels)."""
    global _q8_0_groups
    load_realize()
    codegen.install()
    _q8_0_groups = codegen.avx2()


def load_realize() -> None:
    """Look up inductor's realize operator once (importing it registers it), before any tracing."""
    global realize
    if realize is None:
        try:
            import torch._inductor.test_operators  # noqa: F401
            realize = torch.ops._inductor_test.realize
        except (ImportError, AttributeError, RuntimeError):
            log.info("inductor's realize operator is missing: compiled products may redo their input's work")


def realized(x: torch.Tensor) -> torch.Tensor:
    """x, written to a buffer before a weight reduction of a compiled graph reads it. Inductor otherwise
    inlines the elementwise work that made x (an RMSNorm: its rsqrt, scale, weight) into the reduction
    and redoes it for every weight row: a Q8_0 6144x1024 product after a norm ran 0.58 ms instead of
    0.25 (2 threads); the demo's verification of 4 rows 1.65 ms instead of 1.08."""
    return x if realize is None else realize(x)


def _fall_back(exc: BaseException) -> None:
    with _lock:
        _state.update(mode="eager", reason=f"torch.compile failed ({type(exc).__name__}: {str(exc)[:200]})")
    log.warning("compiled kernels unavailable, using the eager path: %s", exc)


_M_BUCKETS = (1, 2, 3, 4, 5, 8)  # row counts compiled (decode, verify of 1-4 drafts, up to SMALL_M)


def _own_code(fn, name: str):
    """`fn` with a code object of its own: dynamo's recompile limit counts per code object."""
    code = fn.__code__.replace(co_name=name)
    renamed = type(fn)(code, fn.__globals__, name)
    renamed.__kwdefaults__ = fn.__kwdefaults__
    return renamed


def _compiled(t: T, m: int):
    key = (t, m)
    fn = _state["compiled"].get(key)
    if fn is None:
        def product(x, *parts, _t=t):
            return small_m_product(_t, x, *parts)
        prepare()
        fn = torch.compile(_own_code(product, f"packed_{t.name.lower()}_m{m}"), dynamic=True, fullgraph=True)
        _state["compiled"][key] = fn
    return fn


def _compiled_dequant(t: T):
    """dequant_view of type t as one compiled pass (int8 -> float32 times the block scale, written
    once), for the slices of prefill products: the eager form's separate convert and multiply took a
    third of a 0.8B Q8_0 prefill. Shapes dynamic only after a second slice size is seen."""
    key = (t, "dequant")
    fn = _state["compiled"].get(key)
    if fn is None:
        def dequant(*parts, _t=t):
            return dequant_view(_t, _parts_dict(_t, parts))
        prepare()
        fn = torch.compile(_own_code(dequant, f"dequant_{t.name.lower()}"), fullgraph=True)
        _state["compiled"][key] = fn
    return fn


def matmul(t: T, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> x @ W.T [M, N] float32 for a packed 2-D weight."""
    m = x.shape[0]
    if "qu" in p:   # the CPU's 8-bit dot products (engine.kernels.int8_dots), any number of rows: C++ already,
        # so a compiled step calls it from its host code and an eager one directly
        return torch.ops.mtpchat.int8_dots(x.float().contiguous(), p["qu"], p["d"].view(-1))
    if torch.compiler.is_compiling():
        # inside a compiled step (engine/model/steps.py): traced into the step's own graph
        if m <= SMALL_M:
            return small_m_product(t, realized(x), *(p[n] for n in part_names(t, p)))
        return _many_rows_outside_graph(t, p, x)
    if m <= SMALL_M:
        mode, _ = status()
        if mode == "compiled" and not _other_thread_traces():
            bucket = next(b for b in _M_BUCKETS if b >= m)
            xb = x if bucket == m else torch.cat([x, x.new_zeros(bucket - m, x.shape[1])])
            try:
                y = _compiled(t, bucket)(xb.contiguous(), *(p[n] for n in part_names(t, p)))
                return y if bucket == m else y[:m]
            except Exception as exc:  # no working toolchain at run time: same math, eagerly
                _fall_back(exc)
    return _many_rows(t, p, x)


def _other_thread_traces() -> bool:
    """True while a `torch.fx` trace runs anywhere in the process (its flag is process-wide): a compiled
    function called meanwhile raises "Detected that you are using FX to symbolically trace a
    dynamo-optimized function". The background compile of engine/model/steps.py traces so (make_fx) while
    the decode thread runs eager steps, whose products then take the eager math for that call instead of
    turning compiled kernels off for the rest of the process."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def _many_rows(t: T, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if status()[0] == "compiled" and not _other_thread_traces():
        try:
            return sliced_product(t, p, x, _compiled_dequant(t))
        except Exception as exc:  # no working toolchain at run time: same math, eagerly
            _fall_back(exc)
    return sliced_product(t, p, x)


# many rows inside a compiled step: run outside its graph (a graph break), not unrolled slice by slice
_many_rows_outside_graph = torch.compiler.disable(_many_rows)


def reset() -> None:
    """Forget the decision and compiled kernels (tests switch paths with MTPCHAT_KERNELS)."""
    with _lock:
        _state.update(mode=None, reason="", compiled={})
