"""Quantize float32 tensors into GGUF blocks (Q8_0, Q4_K, Q6_K) with torch, for random-weight models.

gguf-py quantizes Q8_0 (numpy, slow at 10⁸ weights) but has no Q4_K/Q6_K quantizer, so the block
packing is written here; tests check it against gguf-py's `quantize` (Q8_0, bitwise) and `dequantize`
(all three). A simple min/max fit, not llama.cpp's search: the weights are random anyway.
Never used to quantize a user's model.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

QK8_0 = 32
QK_K = 256


def _round_away(x: torch.Tensor) -> torch.Tensor:
    # ggml's roundf: halves away from zero (gguf-py np_roundf), not torch's half-to-even
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32, K % 32 == 0 -> uint8 [..., K/32 * 34]: per block f16 d, 32 int8."""
    *lead, k = x.shape
    b = x.reshape(-1, k // QK8_0, QK8_0).float()
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_away(b * inv).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return out.reshape(*lead, k // QK8_0 * 34)


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32, K % 256 == 0 -> uint8 [..., K/256 * 144] (ggml block_q4_K).

    Per super-block: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins for 8 sub-blocks of 32,
    128 bytes of 4-bit quants; weight = d·sc·q − dmin·m.
    """
    *lead, k = x.shape
    b = x.reshape(-1, k // QK_K, 8, 32).float()           # [nb, 8 sub-blocks, 32]
    lo = b.amin(-1).clamp(max=0)                           # [nb, 8] (min ≤ 0, as ggml)
    hi = b.amax(-1)
    scale = (hi - lo) / 15
    mins = -lo
    d = (scale.amax(-1) / 63).to(torch.float16)            # [nb]
    dmin = (mins.amax(-1) / 63).to(torch.float16)
    df, dminf = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
    sc = torch.where(df > 0, _round_away(scale / df.clamp(min=1e-30)), torch.zeros_like(scale)).clamp(0, 63)
    m = torch.where(dminf > 0, _round_away(mins / dminf.clamp(min=1e-30)), torch.zeros_like(mins)).clamp(0, 63)
    eff_scale = (df * sc).unsqueeze(-1)                    # [nb, 8, 1]
    eff_min = (dminf * m).unsqueeze(-1)
    q = torch.where(eff_scale > 0, _round_away((b + eff_min) / eff_scale.clamp(min=1e-30)),
                    torch.zeros_like(b)).clamp(0, 15).to(torch.uint8)
    sc8, m8 = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.empty(*sc8.shape[:-1], 12, dtype=torch.uint8)
    # ggml get_scale_min_k4 layout: j < 4 plain 6 bits; j ≥ 4 low nibbles + the top 2 bits of j-4
    scales[..., 0:4] = (sc8[..., 0:4] & 63) | ((sc8[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (m8[..., 0:4] & 63) | ((m8[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc8[..., 4:8] & 15) | ((m8[..., 4:8] & 15) << 4)
    # quants: 4 chunks of 64 weights = sub-blocks (2j, 2j+1) -> low / high nibble of 32 bytes
    qq = q.reshape(*q.shape[:-2], 4, 2, 32)
    qs = (qq[..., 0, :] | (qq[..., 1, :] << 4)).reshape(*q.shape[:-2], 128)
    out = torch.cat([d.view(torch.uint8).reshape(-1, k // QK_K, 2),
                     dmin.view(torch.uint8).reshape(-1, k // QK_K, 2), scales, qs], dim=-1)
    return out.reshape(*lead, k // QK_K * 144)


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32, K % 256 == 0 -> uint8 [..., K/256 * 210] (ggml block_q6_K).

    Per super-block: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales (sub-blocks of 16),
    f16 d; weight = d·scale·(q − 32).
    """
    *lead, k = x.shape
    b = x.reshape(-1, k // QK_K, 16, 16).float()
    amax_idx = b.abs().argmax(-1, keepdim=True)
    vmax = torch.gather(b, -1, amax_idx).squeeze(-1)       # signed value of largest magnitude
    sub_scale = vmax / -32                                  # as ggml: q range [-32, 31]
    max_abs_scale_idx = sub_scale.abs().argmax(-1, keepdim=True)
    max_scale = torch.gather(sub_scale, -1, max_abs_scale_idx).squeeze(-1)
    iscale = torch.where(max_scale != 0, -128 / max_scale, torch.zeros_like(max_scale))
    d = torch.where(max_scale != 0, 1 / iscale, torch.zeros_like(max_scale)).to(torch.float16)
    sc = _round_away(iscale.unsqueeze(-1) * sub_scale).clamp(-128, 127)
    eff = (d.float().unsqueeze(-1) * sc).unsqueeze(-1)     # [nb, 16, 1]
    q = torch.where(eff != 0, _round_away(b / torch.where(eff != 0, eff, torch.ones_like(eff))),
                    torch.zeros_like(b)).clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(*b.shape[:-2], 2, 4, 32)  # [nb, half, quarter, 32]
    ql = torch.cat([(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4),
                    (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)], dim=-1)   # [nb, 2, 64]
    qh = ((q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4)
          | ((q[..., 3, :] >> 4) << 6))                                          # [nb, 2, 32]
    nb = b.shape[:-2]
    out = torch.cat([ql.reshape(*nb, 128), qh.reshape(*nb, 64),
                     sc.to(torch.int8).view(torch.uint8).reshape(*nb, 16),
                     d.view(torch.uint8).reshape(*nb, 2)], dim=-1)
    return out.reshape(*lead, k // QK_K * 210)


QUANTIZERS = {T.Q8_0: quantize_q8_0, T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


def pack(x: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """float32 [..., K] -> the tensor's GGUF bytes (uint8, last dim = bytes per row)."""
    if ggml_type == T.F32:
        return x.float().contiguous().view(torch.uint8)
    if ggml_type == T.F16:
        return x.to(torch.float16).contiguous().view(torch.uint8)
    if ggml_type == T.BF16:
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    return QUANTIZERS[ggml_type](x.contiguous())
