"""y = x @ W.T with W kept as packed GGUF blocks, without materialising the whole dense W.

The fallback dequantizes W a tile of output rows at a time (each tile bounded to `TILE_ELEMENTS`
elements) and multiplies; fused kernels (a dequant-GEMV on CUDA, later) plug in through
`register_matmul(ggml_type, device_type)` and receive the same arguments, so callers never change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from engine.quants.dequant import SUPPORTED, dequantize

TILE_ELEMENTS = 1 << 22  # 4 Mi weights per dequantized tile: 16 MiB in float32

# kernel(x [..., in], raw uint8 [rows * row_bytes], ggml_type, (rows, in)) -> [..., rows]
MatmulKernel = Callable[[torch.Tensor, torch.Tensor, GGMLQuantizationType, tuple[int, int]], torch.Tensor]
_KERNELS: dict[tuple[GGMLQuantizationType, str], MatmulKernel] = {}


def register_matmul(ggml_type: GGMLQuantizationType, device_type: str) -> Callable[[MatmulKernel], MatmulKernel]:
    """Decorator: use `fn` for x @ W.T when W has `ggml_type` and x lives on `device_type` ("cpu", "cuda")."""
    def deco(fn: MatmulKernel) -> MatmulKernel:
        _KERNELS[(ggml_type, device_type)] = fn
        return fn
    return deco


def find_matmul(ggml_type: GGMLQuantizationType, device_type: str) -> MatmulKernel | None:
    return _KERNELS.get((ggml_type, device_type))


def row_bytes(ggml_type: GGMLQuantizationType, n_cols: int) -> int:
    qt = SUPPORTED[ggml_type]
    return n_cols // qt.block_size * qt.type_size


def dequantize_rows(raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_cols: int, start: int, stop: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [start, stop) of a packed 2-D weight -> dense [stop - start, n_cols] in `dtype`."""
    rb = row_bytes(ggml_type, n_cols)
    tile = raw[start * rb:stop * rb]
    return dequantize(tile, ggml_type).view(stop - start, n_cols).to(dtype)


def tiled_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType,
                 shape: tuple[int, int], tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """x [..., in] @ W.T -> [..., out], W (out, in) packed; at most one tile of W is dense at a time."""
    n_out, n_in = shape
    if ggml_type == _native(x.dtype) and raw.device == x.device:
        return x @ raw.view(x.dtype).view(n_out, n_in).T  # float weight in x's dtype: a view, no copy
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    step = max(1, tile_elements // max(1, n_in))
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        w = dequantize_rows(raw, ggml_type, n_in, r0, r1, x.dtype).to(x.device)
        out[..., r0:r1] = x @ w.T
    return out


def _native(dtype: torch.dtype) -> GGMLQuantizationType | None:
    return {torch.float32: GGMLQuantizationType.F32, torch.float16: GGMLQuantizationType.F16,
            torch.bfloat16: GGMLQuantizationType.BF16}.get(dtype)


def matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType,
           shape: tuple[int, int]) -> torch.Tensor:
    kernel = find_matmul(ggml_type, x.device.type)
    if kernel is not None:
        return kernel(x, raw, ggml_type, shape)
    return tiled_matmul(x, raw, ggml_type, shape)
