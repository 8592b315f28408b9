"""Weights as stored in the GGUF: packed blocks kept as-is, with `dense()` and a blockwise `matmul`.

TEMPORARY minimal version (numpy dequantization through gguf-py); the quant issue replaces the
internals with torch dequantization while keeping this interface.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.gguf import GGUFFile, TensorInfo


class QuantWeight:
    """One GGUF tensor: `ggml_type`, PyTorch-order `shape`, packed `raw` bytes (uint8 tensor)."""

    def __init__(self, info: TensorInfo, raw: torch.Tensor):
        self.name = info.name
        self.ggml_type = info.ggml_type
        self.shape = info.shape
        self.raw = raw

    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        arr = dequantize(self.raw.cpu().numpy(), self.ggml_type)
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(self.shape)
        return t.to(dtype=dtype, device=device or self.raw.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ W.T [..., out] for a 2-D weight (out, in)."""
        return x @ self.dense(x.dtype, x.device).T


def load_weights(f: GGUFFile, device: torch.device | str = "cpu") -> dict[str, QuantWeight]:
    out = {}
    for name, info in f.tensors.items():
        raw = torch.from_numpy(f.tensor_bytes(name)).to(device)
        out[name] = QuantWeight(info, raw)
    return out


__all__ = ["QuantWeight", "load_weights", "GGMLQuantizationType"]
