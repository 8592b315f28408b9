"""Shared building blocks of the Qwen3.5 forward pass: the one weight-multiply entry point, RMSNorm,
partial NeoX RoPE and the SwiGLU FFN (spec/qwen35-gguf.md §4.2, §4.3 step 4, §4.5).

Every weight multiply of the model goes through `Linear` so a packed-weight kernel can replace it
in one place. Functions here never modify their inputs (the training path runs them under autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import PackedWeight, fused

ROW_PRODUCTS_MAX = 8   # rows multiplied as separate dot products in a compiled CPU graph (see below)
_row_products = False  # set by engine.model.steps around compiled calls whose row count is fixed


def set_row_products(on: bool) -> None:
    """Say whether the graph about to be traced has a fixed, small number of rows per weight
    multiply (engine.model.steps sets it per kind of compiled call, before tracing: a kind's graphs are
    traced with one value, so they need no guard on it)."""
    global _row_products
    _row_products = on


def in_row_products_graph() -> bool:
    """True while tracing a compiled CPU step with a fixed, small row count (`set_row_products`): there
    small products are written as reductions that inductor fuses into the step's loops instead of library
    calls (each a call of its own from the compiled graph)."""
    return _row_products and torch.compiler.is_compiling()


def matmul_weight(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T -> [..., out] in float32. The single place a weight multiplies an
    activation: activations are cast to the weight's dtype (bf16 on CUDA), results come back float32.
    A `PackedWeight` (load_model(packed=True)) runs its fused dequantize-and-multiply kernel.

    Inside a compiled CPU step with a fixed row count (`set_row_products`), a float32 weight
    multiplies each of up to ROW_PRODUCTS_MAX rows as its own reduction over `in`: inductor fuses
    them into one loop that reads each weight row once for all rows, where the library's small-M
    matrix product packs the whole weight on every call (demo-sized weights, 1 thread: 1 row
    0.38 ms against 0.46, 4 rows 0.62 against 1.11; docs/benchmarks.md)."""
    if isinstance(weight, PackedWeight):
        return weight.matmul(x)   # realizes x itself when compiling
    if weight.dtype == torch.float32 and weight.dim() == 2 and in_row_products_graph():
        y = _row_products_of(fused.realized(x), weight)
        if y is not None:
            return y
    y = F.linear(x.to(weight.dtype), weight)
    return y if y.dtype == torch.float32 else y.float()


def _row_products_of(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    lead = x.shape[:-1]
    if not all(isinstance(d, int) for d in lead):
        return None         # a symbolic row count outside dynamo: the library product
    rows = 1
    for d in lead:
        # under dynamo a symbolic size passes as an int and `range(rows)` below makes it a constant of the
        # graph (a guard on its value): the kinds that trace this (engine.model.steps) fix every row count
        rows *= d
    if rows > ROW_PRODUCTS_MAX:
        return None
    xr = x.float().reshape(rows, x.shape[-1])
    y = torch.stack([(weight * xr[i]).sum(-1) for i in range(rows)])
    return y.reshape(*lead, weight.shape[0])


class Linear(nn.Module):
    """A bias-free projection holding one dense weight `(out, in)` (GGUF `ne[in, out]`)."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_weight(x, self.weight)


class RMSNorm(nn.Module):
    """rms(x, w) = x / sqrt(mean(x^2) + eps) * w, in float32; `w` used as stored (+1 already in the file)."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int -> cos, sin [..., rope_dim/2] float32 with angle p * theta^(-2i/R)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.int64, device=positions.device)
                                .float() / rope_dim))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first R dims of each head, pairing dim i with i + R/2; the rest pass.
    x [B, T, heads, D]; cos/sin [B, T, R/2]."""
    half = cos.shape[-1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c, rest], dim=-1)


class SwiGLU(nn.Module):
    """Dense FFN: (silu(b Wg^T) * (b Wu^T)) Wd^T (spec §4.5). Tensors ffn_gate, ffn_up, ffn_down."""

    # a draft copy's gate and up rows as one weight [2 n_ff, in] (Qwen35Model.set_draft_weights('int8_dots')):
    # one operator call instead of two; None in the model itself
    draft_gate_up = None

    def __init__(self, n_embd: int, n_ff: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.ffn_gate = Linear(n_embd, n_ff, dtype, device)
        self.ffn_up = Linear(n_embd, n_ff, dtype, device)
        self.ffn_down = Linear(n_ff, n_embd, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.draft_gate_up is not None:
            gate, up = matmul_weight(x, self.draft_gate_up).chunk(2, dim=-1)
            return self.ffn_down(F.silu(gate) * up)
        return self.ffn_down(F.silu(self.ffn_gate(x)) * self.ffn_up(x))
