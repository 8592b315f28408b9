"""Compact weights on the hot path: GGUF weights kept in (nearly) their file size, multiplied without
ever materialising a dequantized copy of the whole matrix.

A Q8_0 weight stays int8 quants (a view of the file bytes) + float32 block scales (36 bytes per
32 weights), Q4_K stays nibbles + 6-bit scales (~0.56 bytes / weight), Q6_K stays its 210-byte
blocks, BF16 stays bf16. `PackedWeight.matmul` runs the fused
dequantize-and-multiply of `engine.kernels.fused` (torch.compile'd when a C++ compiler works,
else the eager form with the same math). Never modifies its inputs; never prints.
"""

from __future__ import annotations

import sys

import torch
from gguf import GGMLQuantizationType as T

from engine.kernels import fused

PACKED_TYPES = (T.Q8_0, T.Q4_K, T.Q6_K, T.BF16, T.F16)
# Below this many weights a matrix stays dense float32 where products run as calls of their own (eager
# steps): one packed call costs ~0.1 ms of Python and dispatch (torch.compile wrappers), about what
# reading a 512K-weight float32 matrix (2 MiB) costs. Inside compiled steps a packed product is part of
# the step's graph and costs no call, so there every matrix is packed (engine.model.steps.min_packed).
PACKED_MIN_WEIGHTS = 1 << 19


def worth_packing(ggml_type: T, shape: tuple[int, ...], min_weights: int | None = None) -> bool:
    """Whether load_model(packed=True) keeps this weight packed (else: dense float32). min_weights:
    the smallest matrix packed (default PACKED_MIN_WEIGHTS)."""
    n = 1
    for d in shape:
        n *= d
    floor = PACKED_MIN_WEIGHTS if min_weights is None else min_weights
    return ggml_type in PACKED_TYPES and len(shape) >= 2 and n >= floor


def _k_scales(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml get_scale_min_k4: [..., 12] packed bytes -> 6-bit scales, mins [..., 8] (uint8)."""
    lo, mid, hi = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def _rows(w, r: int, n: int) -> torch.Tensor:
    """Rows r .. r + n - 1 of a 2-D weight: a float tensor's slice, or a packed weight's rows dequantized."""
    if isinstance(w, PackedWeight):
        return w[torch.arange(r, min(r + n, w.shape[0]), device=w.device)]
    return w[r:r + n]


def _int8_symmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] float32 -> (q int8 [..., n], d [..., 1]) with d = max|x| / 127 over the last dim and q = x / d
    rounded half away from zero (0 where d is 0), as ggml's reference Q8_0 quantizer does per block."""
    d = x.abs().amax(-1, keepdim=True) / 127
    y = x * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (y.sign() * (y.abs() + 0.5).floor()).to(torch.int8), d


class PackedWeight:
    """One 2-D `(N, K)` or 3-D `(X, N, K)` weight in a compact form; behaves like the weight tensor
    where the model uses it: `.matmul(x)` (x [..., K] -> [..., N] float32), `w[token_ids]` (rows of a
    2-D weight, float32, for embeddings), `w[expert]` (one expert of a 3-D weight), `.dtype` (the
    activation dtype, float32), `.shape`, `.device`, `.dense()`."""

    def __init__(self, name: str, ggml_type: T, shape: tuple[int, ...], parts: dict[str, torch.Tensor]):
        self.name = name
        self.ggml_type = ggml_type
        self.shape = torch.Size(shape)
        self.parts = parts

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, name: str, ggml_type: T, shape: tuple[int, ...], raw: torch.Tensor) -> PackedWeight:
        """raw: the tensor's GGUF bytes (contiguous uint8); the parts are views of it where possible."""
        *lead, K = shape
        # Views into the file's bytes where the layout allows (no copy: resident size = file size);
        # parts keep the leading dims of `shape`, then the block dims.
        if ggml_type == T.Q8_0:
            b = raw.view(*lead, K // 32, 34)
            # scales widened to float32 once (+4 bytes per 32 weights): converting an f16 scalar per
            # block inside the kernel cost a third of its speed (9.1 -> 12.1 G weights/s, 1 thread)
            parts = {"qs": b[..., 2:].view(torch.int8), "d": b[..., :2].view(torch.float16).float()}
        elif ggml_type == T.Q4_K:
            b = raw.view(*lead, K // 256, 144)
            sc, mn = _k_scales(b[..., 4:16])
            parts = {"qs": b[..., 16:].unflatten(-1, (4, 32)), "d": b[..., 0:2].view(torch.float16),
                     "dmin": b[..., 2:4].view(torch.float16), "sc": sc, "mn": mn}
        elif ggml_type == T.Q6_K:
            b = raw.view(*lead, K // 256, 210)
            parts = {"ql": b[..., :128].unflatten(-1, (2, 2, 32)), "qh": b[..., 128:192].unflatten(-1, (2, 32)),
                     "sc": b[..., 192:208].view(torch.int8).unflatten(-1, (2, 4, 2)),
                     "d": b[..., 208:210].view(torch.float16)}
        elif ggml_type == T.BF16:
            parts = {"w": raw.view(torch.bfloat16).view(*lead, K)}
        elif ggml_type == T.F16:
            parts = {"w": raw.view(torch.float16).view(*lead, K)}
        else:
            raise ValueError(f"{name}: {ggml_type.name} has no packed form")
        return cls(name, ggml_type, tuple(shape), parts)

    @classmethod
    def q8_0_of(cls, name: str, w: torch.Tensor, rows_at_once: int = 1 << 14) -> PackedWeight:
        """A Q8_0 copy of a float 2-D weight [N, K] (K a multiple of 32), block by block as ggml's reference
        quantizer writes it (gguf-py's `quants.quantize` gives the same bytes): d = max|x| / 127 kept as
        float16, q = x * (1 / d) rounded half away from zero (0 where d is 0). Rows are converted a slice at
        a time, so a large head needs no float32 copy of itself; `w` may be a 2-D packed weight too (a
        quantized file's), whose rows are dequantized a slice at a time."""
        if w.ndim != 2 or w.shape[1] % 32:
            raise ValueError(f"{name}: Q8_0 needs a 2-D weight with rows a multiple of 32, got {tuple(w.shape)}")
        N, K = w.shape
        qs = torch.empty(N, K // 32, 32, dtype=torch.int8, device=w.device)
        d = torch.empty(N, K // 32, 1, dtype=torch.float32, device=w.device)
        for r in range(0, N, rows_at_once):
            rows = _rows(w, r, rows_at_once)
            q, dr = _int8_symmetric(rows.float().reshape(-1, K // 32, 32))
            qs[r:r + rows_at_once] = q
            d[r:r + rows_at_once] = dr.half().float()
        return cls(name, T.Q8_0, (N, K), {"qs": qs, "d": d})

    @classmethod
    def int8_rows_of(cls, name: str, w: torch.Tensor, rows_at_once: int = 1 << 14) -> PackedWeight:
        """An int8 copy of a float 2-D weight [N, K] with one float32 scale per row (type I8, parts `q` and
        `d`): d = max|row| / 127, q = x / d rounded half away from zero (0 where d is 0). Not a GGUF form
        (ggml's I8 has no scale): MTP drafts multiply by it (`Qwen35Model.set_draft_weights('int8')`), where
        an approximate product is allowed. Rows are converted a slice at a time; `w` may be a 2-D packed
        weight too (a quantized file's), whose rows are dequantized a slice at a time."""
        if w.ndim != 2:
            raise ValueError(f"{name}: int8 rows need a 2-D weight, got {tuple(w.shape)}")
        N, K = w.shape
        q = torch.empty(N, K, dtype=torch.int8, device=w.device)
        d = torch.empty(N, 1, dtype=torch.float32, device=w.device)
        for r in range(0, N, rows_at_once):
            q[r:r + rows_at_once], d[r:r + rows_at_once] = _int8_symmetric(_rows(w, r, rows_at_once).float())
        return cls(name, T.I8, (N, K), {"q": q, "d": d})

    def as_int8_dots(self) -> PackedWeight:
        """This int8-rows weight (`int8_rows_of`) in the form `engine.kernels.int8_dots` multiplies: the quants
        with their top bit flipped (`qu`, uint8 = q + 128, the unsigned operand of the CPU's 8-bit dot
        products), the scales `d` unchanged. A copy; other weights as they are."""
        if self.ggml_type != T.I8 or "q" not in self.parts:
            return self
        qu = (self.parts["q"].view(torch.uint8) ^ 0x80).contiguous()
        return PackedWeight(self.name, T.I8, tuple(self.shape), {"qu": qu, "d": self.parts["d"]})

    def as_words(self) -> PackedWeight:
        """This Q8_0 weight in the words layout (a copy): each block's 32 quants as 8 little-endian 32-bit
        words whose byte j of word i is element 8j + i, stored as float32 bit patterns (`qw`, never used as
        numbers; the scales `d` unchanged). Compiled CPU products read them as full float vectors and take
        the bytes out by shifts (fused.small_m_product): a 2048 x 256 product of one row 84 us against
        883 us for int8 quants on an AVX2 CPU. Other weights, and on a big-endian machine, this weight."""
        if self.ggml_type != T.Q8_0 or "qs" not in self.parts or sys.byteorder != "little":
            return self
        qs = self.parts["qs"]
        *lead, nb, _ = qs.shape
        il = qs.reshape(*lead, nb, 4, 8).transpose(-1, -2).reshape(*lead, nb, 32).contiguous()
        return PackedWeight(self.name, self.ggml_type, tuple(self.shape),
                            {"qw": il.view(torch.int32).view(torch.float32), "d": self.parts["d"]})

    # -- tensor-like surface ----------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    def __getitem__(self, idx):
        if self.ndim == 3 and isinstance(idx, int):
            return PackedWeight(f"{self.name}[{idx}]", self.ggml_type, tuple(self.shape[1:]),
                                {k: v[idx] for k, v in self.parts.items()})
        if self.ndim != 2:
            raise TypeError(f"{self.name}: index a 3-D packed weight by one expert number")
        return fused.dequant_rows(self.ggml_type, self.parts, idx)

    def first_rows(self, n: int) -> PackedWeight:
        """The first n rows of a 2-D weight, still packed (views of the same bytes)."""
        if self.ndim != 2:
            raise TypeError(f"{self.name}: first_rows of a {self.ndim}-D packed weight")
        n = min(n, self.shape[0])
        return PackedWeight(f"{self.name}[:{n}]", self.ggml_type, (n, self.shape[1]),
                            {k: v[:n] for k, v in self.parts.items()})

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.ndim == 3:
            return torch.stack([self[i].dense(dtype) for i in range(self.shape[0])])
        rows = torch.arange(self.shape[0], device=self.device)
        return fused.dequant_rows(self.ggml_type, self.parts, rows).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x @ W.T [..., N] float32."""
        lead = x.shape[:-1]
        y = fused.matmul(self.ggml_type, self.parts, x.reshape(-1, x.shape[-1]).float())
        return y.reshape(*lead, self.shape[-2])

    def __repr__(self) -> str:
        return f"PackedWeight({self.name}, {self.ggml_type.name}, {tuple(self.shape)}, {self.nbytes:,} B)"
