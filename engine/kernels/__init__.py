"""Compact-weight kernels for the hot path (see packed.py and fused.py)."""

from engine.kernels.fused import status
from engine.kernels.packed import PACKED_TYPES, PackedWeight, worth_packing

__all__ = ["PACKED_TYPES", "PackedWeight", "status", "worth_packing"]
