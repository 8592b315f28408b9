"""Dequantization of GGUF blocks in torch, bit-exact with gguf-py's `gguf.quants.dequantize` in float32.

Each function takes packed blocks as a uint8 tensor [n_blocks, type_size] (CPU or CUDA) and returns
float32 [n_blocks, block_size]. The arithmetic mirrors the reference operation by operation (same
products, same order, one rounding each), so results are identical, not merely close. Never fuse
these ops (an FMA would round once instead of twice and break equality).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K
from gguf.constants import GGMLQuantizationType as T

# Non-linear 4-bit grid of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl).
_IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block -> float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 2, m]: low nibbles, then high nibbles (ggml's 4-bit order)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 8, m]: bit j of every byte in plane j."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(8, 1)
    return (b.unsqueeze(-2) >> shifts) & 1


def _crumbs(b: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 4, m]: 2-bit fields at shifts 0, 2, 4, 6."""
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(4, 1)
    return (b.unsqueeze(-2) >> shifts) & 3


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_all(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an fp32: shift the bits, exactly as gguf-py does.
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).reshape(n, 32).to(torch.float32) - 8
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).reshape(n, 32).to(torch.float32)
    return (d * q) + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bit j = high bit of element j."""
    return _bits(qh).transpose(-1, -2).reshape(qh.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qh = _q5_high(b[:, 2:6])
    ql = _nibbles(b[:, 6:22]).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.float32) - 16
    return d * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    qh = _q5_high(b[:, 4:8])
    ql = _nibbles(b[:, 8:24]).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (d * q) + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # [scales 16][qs 64][d 2][dmin 2]
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _crumbs(b[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # [hmask 32][qs 64][scales 12][d 2]
    n = b.shape[0]
    hmask, qs, sc = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = _nibbles(sc[:, 0:8]).reshape(n, 16)
    high = _crumbs(sc[:, 8:12]).reshape(n, 16)
    scales = (low | (high << 4)).to(torch.float32) - 32
    dl = (d * scales).reshape(n, 16, 1)
    ql = _crumbs(qs.reshape(n, 2, 32)).reshape(n, 16, 16).to(torch.int16)
    qh = (_bits(hmask).reshape(n, 16, 16) ^ 1).to(torch.int16)  # a set bit means "no offset"
    q = (ql - (qh << 2)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (Q4_K / Q5_K)."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scale, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # [d 2][dmin 2][scales 12][qs 128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # [d 2][dmin 2][scales 12][qh 32][qs 128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48]).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # [ql 128][qh 64][scales 16 x int8][d 2]
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b, 208)
    dl = (d * scales).reshape(n, 16, 1)
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _crumbs(b[:, 128:192].reshape(n, 2, 32)).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.float32) - 32).reshape(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def _grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(_IQ4NL_VALUES, dtype=torch.float32, device=device)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    idx = _nibbles(b[:, 2:18]).reshape(n, 32).to(torch.int64)
    return d * _grid(b.device)[idx]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # [d 2][scales_h 2 (u16)][scales_l 4][qs 128]
    n = b.shape[0]
    d = _f16(b, 0)
    sh = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    shifts = torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)
    high = (sh.unsqueeze(-1) >> shifts) & 3                                    # [n, 8]
    low = _nibbles(b[:, 4:8]).transpose(-1, -2).reshape(n, 8).to(torch.int32)  # sub-block j: byte j//2, nibble j%2
    scales = ((low | (high << 4)) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 8, 1)
    idx = _nibbles(b[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32).to(torch.int64)
    return (dl * _grid(b.device)[idx]).reshape(n, QK_K)


@dataclass(frozen=True)
class QuantType:
    ggml_type: T
    block_size: int     # elements per block
    type_size: int      # bytes per block
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]

    @property
    def name(self) -> str:
        return self.ggml_type.name


_FUNCS = {
    T.F32: _f32, T.F16: _f16_all, T.BF16: _bf16,
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
}

# spec/qwen35-gguf.md §3.8: the minimum set. Anything else is refused at load, naming type and tensor.
SUPPORTED: dict[T, QuantType] = {
    t: QuantType(t, *GGML_QUANT_SIZES[t], fn) for t, fn in _FUNCS.items()
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def is_supported(ggml_type: T) -> bool:
    return ggml_type in SUPPORTED


def dequantize(raw: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """Packed bytes (uint8, any shape whose total is a whole number of blocks) -> float32, flat.

    Raises KeyError for a type outside SUPPORTED (the loader refuses those before this is reached).
    """
    qt = SUPPORTED[ggml_type]
    blocks = raw.reshape(-1, qt.type_size)
    if ggml_type in FLOAT_TYPES:
        return qt.dequantize_blocks(blocks.reshape(-1)).reshape(-1)
    return qt.dequantize_blocks(blocks).reshape(-1)
