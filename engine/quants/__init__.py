"""GGUF quantization types: bit-exact torch dequantization and matmul over packed blocks.

`dequantize(raw, ggml_type)` turns packed blocks into float32; `SUPPORTED` is the set of types the
engine loads (spec/qwen35-gguf.md §3.8); `matmul` multiplies by a packed weight a row tile at a time.
"""

from engine.quants.dequant import FLOAT_TYPES, SUPPORTED, QuantType, dequantize, is_supported

__all__ = ["FLOAT_TYPES", "SUPPORTED", "QuantType", "dequantize", "is_supported"]
