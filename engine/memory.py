"""Memory one sequence needs beyond the weights: KV cache and Gated DeltaNet state (spec/qwen35-gguf.md §7).

Pure arithmetic on `ModelConfig` in Python ints; no tensors are allocated. The engine keeps its KV
cache in float32 on CPU and bfloat16 on CUDA, and its recurrent state (conv + delta) in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from engine.config import ModelConfig

# Bytes per KV element (spec §7: q8_0 = 34/32, q4_0 = 18/32).
KV_ELEMENT_BYTES: dict[str, Fraction] = {
    "f32": Fraction(4), "f16": Fraction(2), "bf16": Fraction(2),
    "q8_0": Fraction(34, 32), "q4_0": Fraction(18, 32),
}
STATE_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def engine_kv_dtype(device_type: str) -> str:
    """The KV dtype the engine uses on a device: float32 on CPU (the reference), bfloat16 on CUDA."""
    return "bf16" if device_type == "cuda" else "f32"


@dataclass(frozen=True)
class SequenceMemory:
    n_ctx: int
    kv_dtype: str
    attn_blocks: int          # A = main attention blocks + MTP blocks (when counted)
    gdn_blocks: int           # G
    kv_bytes: int             # A · n_ctx · 2 · Hkv · D · s_kv
    conv_state_bytes: int     # G · (Kc − 1) · C · s_conv
    delta_state_bytes: int    # G · Hv · Dk · Dv · 4

    @property
    def state_bytes(self) -> int:
        return self.conv_state_bytes + self.delta_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def kv_bytes(cfg: ModelConfig, n_ctx: int, kv_dtype: str = "f16", *, with_mtp: bool = True) -> int:
    """KV cache bytes of one sequence at `n_ctx` (K after norm+RoPE and V, Hkv·D each per token)."""
    blocks = len(cfg.attn_layers) + (cfg.n_nextn if with_mtp else 0)
    b = blocks * n_ctx * 2 * cfg.n_head_kv * cfg.head_dim * KV_ELEMENT_BYTES[kv_dtype]
    return int(-(-b.numerator // b.denominator))


def sequence_memory(cfg: ModelConfig, n_ctx: int, kv_dtype: str = "f32", *, with_mtp: bool = True,
                    conv_dtype: str = "f32") -> SequenceMemory:
    if n_ctx < 0:
        raise ValueError(f"n_ctx must be non-negative, got {n_ctx}")
    g = len(cfg.gdn_layers)
    conv = g * (cfg.ssm_conv_kernel - 1) * cfg.conv_channels * STATE_ELEMENT_BYTES[conv_dtype]
    delta = g * cfg.ssm_dt_rank * cfg.ssm_d_state * cfg.ssm_head_v_dim * 4  # always float32
    return SequenceMemory(
        n_ctx=n_ctx, kv_dtype=kv_dtype,
        attn_blocks=len(cfg.attn_layers) + (cfg.n_nextn if with_mtp else 0), gdn_blocks=g,
        kv_bytes=kv_bytes(cfg, n_ctx, kv_dtype, with_mtp=with_mtp),
        conv_state_bytes=conv, delta_state_bytes=delta,
    )
