"""Weights as stored in the GGUF: packed blocks kept as-is (CPU or GPU), with `dense()` and a tiled `matmul`.

`QuantWeight.raw` holds the tensor's bytes exactly as in the file (uint8, owned by us, never a map
of the file). Dequantization is bit-exact with gguf-py (engine.quants). `matmul` never needs the
whole dense matrix: it goes through engine.quants.matmul, where fused kernels can be registered.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.errors import ModelFileError
from engine.gguf import TensorInfo
from engine.quants import SUPPORTED
from engine.quants.dequant import dequantize
from engine.quants.matmul import TILE_ELEMENTS, dequantize_rows, row_bytes
from engine.quants.matmul import matmul as packed_matmul

_NATIVE = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
           GGMLQuantizationType.BF16: torch.bfloat16}


class QuantWeight:
    """One GGUF tensor: `ggml_type`, PyTorch-order `shape`, packed `raw` bytes (1-D uint8 tensor)."""

    def __init__(self, info: TensorInfo, raw: torch.Tensor):
        if info.ggml_type not in SUPPORTED:
            raise ValueError(f"{info.name}: type {info.ggml_type.name} is not supported")
        if raw.dtype != torch.uint8 or raw.numel() != info.n_bytes:
            raise ValueError(f"{info.name}: expected {info.n_bytes} packed bytes, got {raw.numel()} {raw.dtype}")
        self.name = info.name
        self.ggml_type = info.ggml_type
        self.shape = tuple(info.shape)
        self.raw = raw.reshape(-1)

    def __repr__(self) -> str:
        return f"QuantWeight({self.name!r}, {self.ggml_type.name}, {list(self.shape)}, {self.raw.device})"

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def n_bytes(self) -> int:
        return self.raw.numel()

    @property
    def n_rows(self) -> int:
        """Rows of the weight seen as a matrix [n_rows, shape[-1]] (all leading dims flattened)."""
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n

    def to(self, device: torch.device | str) -> QuantWeight:
        info = TensorInfo(self.name, self.ggml_type, self.shape, self.n_bytes, 0)
        return QuantWeight(info, self.raw.to(device))

    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, dequantized (float32 math, then cast to `dtype`), shape `self.shape`.

        A float tensor asked for in its own dtype on its own device is returned as a view of `raw`
        (no copy; do not modify it in place). Quantized tensors are dequantized a row tile at a time,
        so the float32 temporary never exceeds one tile.
        """
        device = torch.device(device) if device is not None else self.raw.device
        if _NATIVE.get(self.ggml_type) == dtype and device == self.raw.device:
            return self.raw.view(dtype).view(self.shape)
        n_cols = self.shape[-1]
        out = torch.empty(self.n_rows, n_cols, dtype=dtype, device=device)
        step = max(1, TILE_ELEMENTS // n_cols)
        for r0 in range(0, self.n_rows, step):
            r1 = min(self.n_rows, r0 + step)
            out[r0:r1] = dequantize_rows(self.raw, self.ggml_type, n_cols, r0, r1).to(device=device, dtype=dtype)
        return out.view(self.shape)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense rows `ids` of a 2-D weight (an embedding lookup): [*ids.shape, shape[-1]], on raw's device."""
        n_cols = self.shape[-1]
        rb = row_bytes(self.ggml_type, n_cols)
        flat = ids.reshape(-1).to(self.raw.device, torch.long)
        packed = self.raw.view(self.n_rows, rb)[flat]
        return dequantize(packed, self.ggml_type).view(*ids.shape, n_cols).to(dtype)

    def expert(self, i: int) -> QuantWeight:
        """Slice i of a 3-D weight [X, rows, cols] as a 2-D weight sharing the same bytes."""
        if len(self.shape) != 3 or not 0 <= i < self.shape[0]:
            raise IndexError(f"{self.name}: no expert {i} in shape {list(self.shape)}")
        per = self.n_bytes // self.shape[0]
        info = TensorInfo(f"{self.name}[{i}]", self.ggml_type, self.shape[1:], per, 0)
        return QuantWeight(info, self.raw[i * per:(i + 1) * per])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ W.T [..., out] for a 2-D weight (out, in), one dequantized row tile at a time."""
        if len(self.shape) != 2:
            raise ValueError(f"{self.name}: matmul needs a 2-D weight, shape is {list(self.shape)}")
        return packed_matmul(x, self.raw, self.ggml_type, (self.shape[0], self.shape[1]))


def load_weights(f, device: torch.device | str = "cpu", names=None) -> dict[str, QuantWeight]:
    """Owned copies of the tensors of `f` (a GGUFFile, or anything with `.tensors` and `.tensor_bytes`).

    Unsupported types are refused naming the tensor and the type. With a GGUFFile the file is read
    once, in offset order, checking that it did not change since its header was checked (A6).
    """
    wanted = list(f.tensors) if names is None else list(names)
    path = getattr(f, "path", "<memory>")
    for name in wanted:
        t = f.tensors[name].ggml_type
        if t not in SUPPORTED:
            raise ModelFileError(path, f"{name}: type {GGMLQuantizationType(t).name} is not supported")
    source = f.read_tensors(wanted) if hasattr(f, "read_tensors") else ((n, f.tensor_bytes(n)) for n in wanted)
    out = {}
    for name, arr in source:
        raw = torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
        out[name] = QuantWeight(f.tensors[name], raw.to(device) if torch.device(device).type != "cpu" else raw)
    return out


__all__ = ["QuantWeight", "load_weights", "GGMLQuantizationType"]
