"""Products of float activations by int8 weight rows on the CPU's 8-bit dot-product instructions.

MTP drafts multiply by int8 copies of the nextn block and the output head with one scale per row
(`PackedWeight.int8_rows_of`). Inductor compiles that product into a loop that converts every weight
byte to a float and multiplies it: ~5 products a cycle on an AVX-512 Xeon. AVX-512 VNNI's `vpdpbusd`
sums 64 byte products into 16 int32 lanes in one instruction; `int8_dots.cpp` quantizes each activation
row to int8 (its own scale, ggml's rounding) and multiplies by those instructions, 16 weight rows at a
time. Drafts are only proposals, so the rounding of the activations can change a draft (never the
output). A 2,048 x 256 product of one row: measured in docs/benchmarks.md (thirty-sixth session).

The C++ is built once per torch version with torch's extension builder (a C++ compiler and ninja, as
inductor needs) into mtpchat's cache folder, and loaded as the operator `torch.ops.mtpchat.int8_dots`,
which compiled steps call from their C++ host code. `available()` says whether it runs here and why not:
no VNNI, no toolchain, a failed build, or MTPCHAT_INT8_DOTS=off. Where it does not, draft products stay
inductor's (`fused.small_m_product`). The operator runs AVX-512 VNNI (16 weight rows a block) where the CPU
has it, else AVX-VNNI, the 256-bit form of the same instruction on CPUs without AVX-512 (8 rows a block);
MTPCHAT_INT8_DOTS=avx2 takes the narrower form on a CPU that has both (tests, benches).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_dots.cpp")
_lock = threading.Lock()
_state: dict = {"ok": None, "reason": ""}


def build_dir() -> Path:
    """Where the operator's build lives: beside inductor's cache (resources.compile_cache_dir), one folder
    per torch version (an extension is tied to the torch it was built against) and source (two mtpchat
    versions on one machine do not rebuild over each other's library)."""
    import hashlib

    from engine.resources import compile_cache_dir
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return compile_cache_dir().parent / "kernels" / f"torch-{torch.__version__}" / source


def available() -> bool:
    """Whether `torch.ops.mtpchat.int8_dots` runs here: built (on first call; ~10 s once on the 2-vCPU Xeon,
    then loaded from the cache) and checked against the integers it must compute. Decided once per process."""
    with _lock:
        if _state["ok"] is None:
            ok, reason = _load()
            _state.update(ok=ok, reason=reason)
            log.info("int8 dot products: %s", reason)
        return _state["ok"]


def status() -> tuple[bool, str]:
    """(available, why), for status lines; decides as `available` does."""
    ok = available()
    return ok, _state["reason"]


ISA_NAMES = {"avx512": "AVX-512 VNNI", "avx2": "AVX-VNNI (256-bit)"}


def _load() -> tuple[bool, str]:
    asked = os.environ.get("MTPCHAT_INT8_DOTS", "").strip().lower()
    if asked in ("off", "0", "no"):
        return False, "off (MTPCHAT_INT8_DOTS)"
    if asked not in ("", "avx512", "avx2"):
        return False, f"off (MTPCHAT_INT8_DOTS={asked!r}: expected off, avx512 or avx2)"
    forms = _cpu_forms()
    if not forms:
        return False, "not used: this CPU reports neither AVX-512 VNNI nor AVX-VNNI"
    if asked and asked not in forms:
        return False, f"off (MTPCHAT_INT8_DOTS={asked}: this CPU reports no {ISA_NAMES[asked]})"
    try:
        from torch.utils import cpp_extension
        if not cpp_extension.is_ninja_available():
            # the `ninja` wheel (a dependency) puts it beside this Python, which need not be on PATH
            beside = Path(sys.executable).parent
            if (beside / "ninja").is_file() or (beside / "ninja.exe").is_file():
                os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"
        if not cpp_extension.is_ninja_available():
            return False, "not built: ninja is not on PATH (pip install ninja)"
        if not hasattr(torch.ops.mtpchat, "int8_dots"):
            _build_and_load(cpp_extension)
        _register_fake()
        isa = torch.ops.mtpchat.int8_dots_isa(asked)     # the widest form the CPU runs, or the one asked for
        if not _self_check():
            return False, "not used: the built operator's products differ from their reference"
    except Exception as exc:   # no compiler, headers missing, a read-only cache: inductor's products stay
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return False, f"not built: {first[:200]}"
    return True, f"{ISA_NAMES.get(isa, isa)} (built in {build_dir()})"


def _build_and_load(cpp_extension) -> None:
    """Build (or find built) and load the operator. Processes take turns on a lock the system releases when
    its holder ends, however it ends; the holder first removes the lock file torch's builder leaves behind
    when a build is killed midway (`FileBaton`), on which every later build would otherwise wait forever."""
    import fcntl

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "mtpchat-build.lock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        cpp_extension.load(name="mtpchat_int8_dots", sources=[str(SOURCE)], build_directory=str(folder),
                           extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)


def _cpu_forms() -> set[str]:
    """The operator's forms the CPU reports the instructions for, as Linux's /proc/cpuinfo names them:
    'avx512' (AVX-512 F/BW/VL with VNNI), 'avx2' (AVX2 and FMA with AVX-VNNI, a separate flag: Ice Lake has
    the first only, Alder Lake the second only). Elsewhere unknown, so none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    forms = set()
                    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
                        forms.add("avx512")
                    if {"avx2", "fma", "avx_vnni"} <= flags:
                        forms.add("avx2")
                    return forms
    except OSError:
        pass
    return set()


_fake_registered = False


def _register_fake() -> None:
    """Shapes for tracing (compiled steps trace the operator without running it)."""
    global _fake_registered
    if not _fake_registered:
        torch.library.register_fake("mtpchat::int8_dots")(
            lambda x, w, d: x.new_empty(x.shape[0], w.shape[0]))
        _fake_registered = True


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's activation rounding, in torch: x [M, K] float32 -> (int8 [M, K], scale [M, 1])."""
    from engine.kernels.packed import _int8_symmetric
    return _int8_symmetric(x)


def reference(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """What `int8_dots(x, w, d)` returns, computed in torch: the integer sums exactly (int64), then
    float(sum) * scale * d in float32, in the operator's order."""
    xq, xs = quantize_rows(x.float())
    q = w.to(torch.int64) - 128
    s = xq.to(torch.int64) @ q.T                                  # [M, N], exact
    return (s.to(torch.float32) * xs) * d.view(1, -1)


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g)
    w = torch.randint(0, 256, (37, 200), dtype=torch.uint8, generator=g)
    d = torch.rand(37, generator=g)
    return torch.equal(torch.ops.mtpchat.int8_dots(x, w, d), reference(x, w, d))


def int8_dots(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, w [N, K] uint8 (int8 + 128), d [N] float32 -> [M, N] float32 (see the module)."""
    return torch.ops.mtpchat.int8_dots(x, w, d)
