"""Inductor's C++ loads of a few bytes, without a trip through the stack on AVX2.

A compiled product of a quantized weight converts 8 or 16 packed bytes at a time into float vectors.
Inductor writes that as `Vectorized<int8_t>::loadu(ptr, 8)` (or `<uint8_t>`, or 16), and on AVX2 ATen
serves such a partial load by filling a 32-byte stack buffer with 1s, copying the bytes over it with
`memcpy` and loading the buffer back: the reload waits on the narrower stores (no store forwarding),
every time. A Q8_0 product of 2048 x 1024 weights, one row, one thread, ran 3.4-3.5 ms that way against
0.36-0.38 ms with direct loads, 0.19 ms for the float32 GEMV (AMD EPYC with AVX-512 hidden by its VM; Q4_K
2.9 -> 0.75 ms, Q6_K 4.6 -> 1.6 ms). AVX-512 builds use masked loads and are not affected.

`install()` rewrites exactly those load lines into an SSE load of the 8 or 16 bytes placed in the low lanes
of a vector whose other lanes are 1: the same value ATen's copy builds, with no store in between. It
changes code generation only where inductor picks AVX2, and adds a key to inductor's graph cache so that
kernels generated before it are not reused. The key holds in every thread, and a kernel is rewritten only
where its graph is keyed so (see `_set_in_every_thread`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed: dict = {}
# part of inductor's graph-cache key while the rewrite is installed: raise it whenever `byte_load` writes
# different code, so that kernels cached with the older form are not reused
REWRITE_VERSION = 1
_KEY = f"mtpchat-byte-loads-{REWRITE_VERSION}"
_OPTION = "post_grad_custom_post_pass"   # inductor's option whose uuid() its graph-cache key includes

# `at::vec::Vectorized<int8_t>::loadu(<address>, 8)`, the count written as `8`, `8L` or `static_cast<int64_t>(8)`
_PARTIAL_BYTE_LOAD = re.compile(
    r"^(at::vec::Vectorized<u?int8_t>)::loadu\((.+), (?:static_cast<int64_t>\((8|16)L?\)|(8|16)L?)\)$")


def byte_load(line: str) -> str | None:
    """The direct form of an AVX2 partial load of 8 or 16 bytes (`Vectorized<int8_t or uint8_t>::loadu(p, n)`)
    written by inductor, or None for any other line. Lanes n..31 are 1, as in ATen's own partial load."""
    m = _PARTIAL_BYTE_LOAD.match(line)
    if m is None:
        return None
    vec, address, n = m.group(1), m.group(2), m.group(3) or m.group(4)
    p = f"reinterpret_cast<const __m128i*>({address})"
    # bytes 8..15 of the low half are 1 too when only 8 are loaded
    low = f"_mm_or_si128(_mm_loadl_epi64({p}), _mm_set_epi64x(0x0101010101010101LL, 0))" if n == "8" \
        else f"_mm_loadu_si128({p})"
    return f"{vec}(_mm256_inserti128_si256(_mm256_set1_epi8(1), {low}, 0))"


@functools.cache
def vec_isa() -> str | None:
    """The vector instructions inductor's C++ uses on this CPU, as inductor names them ('avx2', 'avx512 ...',
    '' for none): what the CPU reports, not its model (a virtual machine can hide AVX-512 from a CPU that has
    it). None with a torch that does not have this helper."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        return str(pick_vec_isa() or "")
    except Exception:
        return None


def avx2() -> bool:
    """Whether inductor generates AVX2 code here (its C++ vectors 8 floats wide); False where unknown, which
    leaves its code generation alone."""
    return vec_isa() == "avx2"


def avx512() -> bool:
    """Whether inductor generates AVX-512 code here (its C++ vectors 16 floats wide)."""
    return (vec_isa() or "").startswith("avx512")


def install() -> bool:
    """Rewrite inductor's partial byte loads from now on, in this process, where it generates AVX2 code.
    Idempotent; True when active. Nothing changes on other vector instruction sets, where this torch's
    code generator does not have the method it wraps, or with MTPCHAT_BYTE_LOADS=aten (ATen's loads, to
    compare)."""
    with _lock:
        if "original" in _installed:
            return True
        if os.environ.get("MTPCHAT_BYTE_LOADS", "").strip().lower() == "aten" or not avx2():
            return False
        try:
            from torch._inductor import config
            from torch._inductor.codegen import cpp
            from torch._inductor.custom_graph_pass import CustomGraphPass
        except ImportError as exc:
            log.info("inductor's C++ code generator not found (%s): partial byte loads left as they are", exc)
            return False
        original = getattr(cpp.CppVecKernel, "_get_vec_load_line", None)
        if original is None or config.post_grad_custom_post_pass is not None:
            log.info("partial byte loads left as they are: this inductor has no hook for them, or a post-grad "
                     "pass of its own")
            return False

        def load_line(self, var, index, dtype, load_mask=None):
            line = original(self, var, index, dtype, load_mask)
            if load_mask is None and dtype in (torch.int8, torch.uint8) and _keyed(config):
                return byte_load(line) or line
            return line

        class _CacheKey(CustomGraphPass):
            """Changes no graph; its uuid keeps kernels generated without the rewrite out of the graph cache."""

            def __call__(self, graph) -> None:
                return None

            def uuid(self) -> str:
                return _KEY

        cpp.CppVecKernel._get_vec_load_line = load_line
        _set_in_every_thread(config, _OPTION, _CacheKey())
        _installed.update(original=original, cls=cpp.CppVecKernel, config=config)
        return True


def _keyed(config) -> bool:
    """Whether the graph being compiled in this thread is keyed as rewritten (the code must follow its key: a
    thread with an option of its own, set by `config.patch` or an assignment, keeps ATen's loads)."""
    uuid = getattr(getattr(config, _OPTION, None), "uuid", None)
    return callable(uuid) and uuid() == _KEY


def _set_in_every_thread(config, name: str, value) -> None:
    """Set one of inductor's options for every thread. torch 2.13 keeps an assignment to an option per thread
    (a context variable): made where the model was loaded, the graph-cache key did not reach the compile
    worker's thread, while the rewrite did. So on AVX2 a kind that the compile child had put in the cache
    missed there when the worker traced it (the child keys it in its own main thread) and was compiled a
    second time, in this process (forty-second session, an AMD EPYC of AVX2). Every thread reads the
    option's default unless it assigned its own; a torch with plain module options takes the assignment."""
    entry = getattr(config, "_config", {}).get(name)
    if entry is not None and hasattr(entry, "default") and hasattr(entry, "user_override"):
        entry.default = value
    setattr(config, name, value)


def uninstall() -> None:
    """Undo `install` (tests compare both code generations in one process). For the calling thread and threads
    started later: inductor gives a thread that read the key a copy of its own, which it keeps."""
    with _lock:
        if "original" in _installed:
            _installed["cls"]._get_vec_load_line = _installed["original"]
            _set_in_every_thread(_installed["config"], _OPTION, None)
            _installed.clear()


def installed() -> bool:
    return "original" in _installed
