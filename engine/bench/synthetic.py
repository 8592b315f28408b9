"""Random-weight models of the real Qwen3.5/3.6 shapes (spec/qwen35-gguf.md §8), for speed benchmarks.

`build_synthetic` returns a `GGUFFile` like `open_gguf` does, so config and weights load through
the same code path as a real file; `write_gguf` writes it with the converter's names and keys so
an outside engine (ik_llama.cpp) runs the very same bytes. Never used for quality: the weights
are noise with sane magnitudes (norms 1, `ssm_a` < 0, dt bias ≈ 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter

from engine.bench.packing import QK_K, pack
from engine.errors import InputError
from engine.gguf import GGUFFile, TensorInfo

N_VOCAB = 248320


@dataclass(frozen=True)
class Shape:
    """One row of spec §8 (plus `tiny`, the fixtures' dimensions, for fast tests)."""
    arch: str
    n_embd: int          # E
    n_main: int          # Lm
    n_mtp: int           # M
    n_head: int          # H
    n_head_kv: int       # Hkv
    ssm_n_group: int     # Hk
    ssm_dt_rank: int     # Hv
    n_ff: int = 0        # F (dense)
    n_expert: int = 0    # X
    n_expert_used: int = 0
    n_ff_exp: int = 0    # Fe
    n_ff_shexp: int = 0  # Fs
    tied: bool = True
    n_vocab: int = N_VOCAB
    head_dim: int = 256  # D
    rope_dim: int = 64   # R
    ssm_d_state: int = 128  # Dk = Dv
    conv_kernel: int = 4
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)


_DENSE = dict(arch="qwen35", ssm_n_group=16)
_MOE = dict(arch="qwen35moe", ssm_n_group=16, n_expert=256, n_expert_used=8, tied=False)
SHAPES: dict[str, Shape] = {
    "tiny": Shape(arch="qwen35", n_embd=256, n_main=4, n_mtp=1, n_head=4, n_head_kv=2, ssm_n_group=2,
                  ssm_dt_rank=4, n_ff=512, tied=False, n_vocab=4096, head_dim=64, rope_dim=16,
                  ssm_d_state=64, rope_sections=(3, 3, 2, 0)),
    "qwen35-0.8b": Shape(**_DENSE, n_embd=1024, n_main=24, n_mtp=1, n_head=8, n_head_kv=2,
                         ssm_dt_rank=16, n_ff=3584),
    "qwen35-2b": Shape(**_DENSE, n_embd=2048, n_main=24, n_mtp=1, n_head=8, n_head_kv=2,
                       ssm_dt_rank=16, n_ff=6144),
    "qwen35-4b": Shape(**_DENSE, n_embd=2560, n_main=32, n_mtp=1, n_head=16, n_head_kv=4,
                       ssm_dt_rank=32, n_ff=9216),
    "qwen35-9b": Shape(**_DENSE, n_embd=4096, n_main=32, n_mtp=1, n_head=16, n_head_kv=4,
                       ssm_dt_rank=32, n_ff=12288, tied=False),
    "qwen35-27b": Shape(**_DENSE, n_embd=5120, n_main=64, n_mtp=1, n_head=24, n_head_kv=4,
                        ssm_dt_rank=48, n_ff=17408, tied=False),
    "qwen35moe-35b-a3b": Shape(**_MOE, n_embd=2048, n_main=40, n_mtp=1, n_head=16, n_head_kv=2,
                               ssm_dt_rank=32, n_ff_exp=512, n_ff_shexp=512),
    "qwen35moe-122b-a10b": Shape(**_MOE, n_embd=3072, n_main=48, n_mtp=1, n_head=32, n_head_kv=2,
                                 ssm_dt_rank=64, n_ff_exp=1024, n_ff_shexp=1024),
}
SHAPES["qwen36-27b"] = SHAPES["qwen35-27b"]
SHAPES["qwen36moe-35b-a3b"] = SHAPES["qwen35moe-35b-a3b"]

# Whole-file types; 1-D tensors, ssm_conv1d and the router stay F32 as the converter/quantizer keep them.
TYPES = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16, "Q8_0": T.Q8_0, "Q4_K_M": T.Q4_K}
FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_M": 15, "BF16": 32}  # general.file_type (llama_ftype)


def parse_spec(spec: str) -> tuple[str, str]:
    """'qwen35-0.8b:Q8_0' -> ('qwen35-0.8b', 'Q8_0'); InputError naming the choices otherwise."""
    shape, _, typ = spec.partition(":")
    typ = typ or "Q8_0"
    if shape not in SHAPES:
        raise InputError(f"--synthetic {spec}: unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    if typ.upper() not in TYPES:
        raise InputError(f"--synthetic {spec}: unknown type {typ!r} (one of {', '.join(TYPES)})")
    return shape, typ.upper()


# ---------------------------------------------------------------------------------------------
# Tensor plan: (name, PyTorch shape, role). Roles set value ranges and which tensors stay F32.

def tensor_plan(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    E, D, Hkv = s.n_embd, s.head_dim, s.n_head_kv
    Ck = s.ssm_n_group * s.ssm_d_state
    Cv = s.ssm_dt_rank * s.ssm_d_state
    C = 2 * Ck + Cv
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s.n_vocab, E), "embd")]
    for i in range(s.n_main + s.n_mtp):
        p = f"blk.{i}."
        attn = i >= s.n_main or (i + 1) % 4 == 0
        plan += [(p + "attn_norm.weight", (E,), "norm"), (p + "post_attention_norm.weight", (E,), "norm")]
        if attn:
            plan += [(p + "attn_q.weight", (2 * s.n_head * D, E), "matrix"),
                     (p + "attn_k.weight", (Hkv * D, E), "matrix"),
                     (p + "attn_v.weight", (Hkv * D, E), "matrix"),
                     (p + "attn_output.weight", (E, s.n_head * D), "matrix"),
                     (p + "attn_q_norm.weight", (D,), "norm"), (p + "attn_k_norm.weight", (D,), "norm")]
        else:
            plan += [(p + "attn_qkv.weight", (C, E), "matrix"), (p + "attn_gate.weight", (Cv, E), "matrix"),
                     (p + "ssm_conv1d.weight", (C, s.conv_kernel), "conv"),
                     (p + "ssm_dt.bias", (s.ssm_dt_rank,), "dt_bias"), (p + "ssm_a", (s.ssm_dt_rank,), "ssm_a"),
                     (p + "ssm_beta.weight", (s.ssm_dt_rank, E), "matrix"),
                     (p + "ssm_alpha.weight", (s.ssm_dt_rank, E), "matrix"),
                     (p + "ssm_norm.weight", (s.ssm_d_state,), "norm"), (p + "ssm_out.weight", (E, Cv), "matrix")]
        if s.arch == "qwen35moe":
            X, Fe, Fs = s.n_expert, s.n_ff_exp, s.n_ff_shexp
            plan += [(p + "ffn_gate_inp.weight", (X, E), "router"),
                     (p + "ffn_gate_exps.weight", (X, Fe, E), "matrix"),
                     (p + "ffn_up_exps.weight", (X, Fe, E), "matrix"),
                     (p + "ffn_down_exps.weight", (X, E, Fe), "matrix"),
                     (p + "ffn_gate_inp_shexp.weight", (E,), "vector"),
                     (p + "ffn_gate_shexp.weight", (Fs, E), "matrix"),
                     (p + "ffn_up_shexp.weight", (Fs, E), "matrix"),
                     (p + "ffn_down_shexp.weight", (E, Fs), "matrix")]
        else:
            plan += [(p + "ffn_gate.weight", (s.n_ff, E), "matrix"), (p + "ffn_up.weight", (s.n_ff, E), "matrix"),
                     (p + "ffn_down.weight", (E, s.n_ff), "matrix")]
        if i >= s.n_main:
            plan += [(p + "nextn.eh_proj.weight", (E, 2 * E), "matrix"), (p + "nextn.enorm.weight", (E,), "norm"),
                     (p + "nextn.hnorm.weight", (E,), "norm"), (p + "nextn.shared_head_norm.weight", (E,), "norm")]
    plan.append(("output_norm.weight", (E,), "norm"))
    if not s.tied:
        plan.append(("output.weight", (s.n_vocab, E), "head"))
    return plan


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp's Q4_K_M rule for ffn_down: the first and last eighth and every third block between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], role: str, type_name: str, s: Shape) -> T:
    if len(shape) == 1 or role in ("conv", "router"):
        return T.F32
    base = TYPES[type_name]
    if base != T.Q4_K:
        return base
    # Q4_K_M: Q6_K for the output head (token_embd when tied) and for ffn_down in "more bits" blocks
    if role == "head" or (role == "embd" and s.tied):
        t = T.Q6_K
    elif ".ffn_down" in name and _use_more_bits(int(name.split(".")[1]), s.n_main + s.n_mtp):
        t = T.Q6_K
    else:
        t = T.Q4_K
    return t if shape[-1] % QK_K == 0 else T.Q8_0


def _row_bytes(t: T, k: int) -> int:
    return {T.F32: 4 * k, T.F16: 2 * k, T.BF16: 2 * k, T.Q8_0: k // 32 * 34,
            T.Q4_K: k // 256 * 144, T.Q6_K: k // 256 * 210}[t]


def file_bytes(shape_name: str, type_name: str) -> int:
    """Bytes of tensor data the model occupies (≈ the GGUF file size and the resident weights)."""
    s = SHAPES[shape_name]
    total = 0
    for name, shp, role in tensor_plan(s):
        rows = math.prod(shp[:-1])
        total += rows * _row_bytes(tensor_type(name, shp, role, type_name, s), shp[-1])
    return total


def available_memory() -> int:
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return os_available_memory()


def os_available_memory() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_fits(shape_name: str, type_name: str, headroom: float = 1.25) -> int:
    """Refuse a model that cannot be held here: InputError with the bytes it needs. Returns the bytes."""
    need = file_bytes(shape_name, type_name)
    avail = available_memory()
    if need * headroom > avail:
        raise InputError(f"--synthetic {shape_name}:{type_name}: needs {need:,} bytes of weights "
                         f"(×{headroom} with working memory = {int(need * headroom):,}), "
                         f"but only {avail:,} bytes of memory are available")
    return need


# ---------------------------------------------------------------------------------------------

def _std(role: str, k: int) -> float:
    return 0.02 if role == "embd" else 0.5 / math.sqrt(k)


def _random_q8_0(out: np.ndarray, k: int, std: float, rng: np.random.Generator) -> None:
    """Fill `out` [n, k/32*34] with random Q8_0 blocks drawn directly (uniform quant bytes, one f16
    scale per block giving about `std`): the same kind of bytes as quantizing noise, much faster."""
    blocks = out.reshape(out.shape[0], k // 32, 34)
    blocks[..., 2:] = rng.integers(0, 256, size=(out.shape[0], k // 32, 32), dtype=np.uint8)
    d = (std * math.sqrt(3) / 128) * rng.uniform(0.75, 1.25, size=(out.shape[0], k // 32, 1))
    blocks[..., :2] = d.astype(np.float16).view(np.uint8)


def _values(role: str, shape: tuple[int, ...], g: torch.Generator, row0: int = 0) -> torch.Tensor:
    """Sane random float32 values for one tensor (or a slice of rows of it)."""
    if role == "norm":
        return 1.0 + 0.02 * torch.randn(shape, generator=g)
    if role == "ssm_a":  # −A, A ~ U(0.01, 16) as HF initialises it (spec §8)
        return -(0.01 + 15.99 * torch.rand(shape, generator=g))
    if role == "dt_bias":
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if role == "conv":
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    if role == "vector":
        return 0.02 * torch.randn(shape, generator=g)
    # matrices, router and head: keep activations O(1) through the residual stream
    return torch.randn(shape, generator=g) * _std(role, shape[-1])


def _metadata(s: Shape, shape_name: str, type_name: str) -> dict[str, Any]:
    a = s.arch
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.type": "model",
        "general.name": f"synthetic {shape_name} {type_name}",
        "general.file_type": FILE_TYPE[type_name],
        "general.quantization_version": 2,
        f"{a}.block_count": s.n_main + s.n_mtp,
        f"{a}.context_length": 262144,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.rope.dimension_sections": list(s.rope_sections),
        f"{a}.rope.freq_base": 1e7,
        f"{a}.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),  # as read back from the file
        f"{a}.attention.key_length": s.head_dim,
        f"{a}.attention.value_length": s.head_dim,
        f"{a}.ssm.conv_kernel": s.conv_kernel,
        f"{a}.ssm.state_size": s.ssm_d_state,
        f"{a}.ssm.group_count": s.ssm_n_group,
        f"{a}.ssm.time_step_rank": s.ssm_dt_rank,
        f"{a}.ssm.inner_size": s.ssm_dt_rank * s.ssm_d_state,
        f"{a}.full_attention_interval": 4,
        f"{a}.rope.dimension_count": s.rope_dim,
        f"{a}.nextn_predict_layers": s.n_mtp,
    }
    if a == "qwen35moe":
        md[f"{a}.expert_count"] = s.n_expert
        md[f"{a}.expert_used_count"] = s.n_expert_used
        md[f"{a}.expert_feed_forward_length"] = s.n_ff_exp
        md[f"{a}.expert_shared_feed_forward_length"] = s.n_ff_shexp
    else:
        md[f"{a}.feed_forward_length"] = s.n_ff
    return md


def build_synthetic(spec: str, seed: int = 0, check_memory: bool = True) -> GGUFFile:
    """A random-weight model 'SHAPE:TYPE' as an in-memory `GGUFFile` (no tokenizer keys)."""
    shape_name, type_name = parse_spec(spec)
    if check_memory:
        check_fits(shape_name, type_name)
    s = SHAPES[shape_name]
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tensors: dict[str, TensorInfo] = {}
    blobs: dict[str, np.ndarray] = {}
    offset = 0
    for name, shp, role in tensor_plan(s):
        t = tensor_type(name, shp, role, type_name, s)
        rows, k = math.prod(shp[:-1]), shp[-1]
        out = np.empty(rows * _row_bytes(t, k), dtype=np.uint8)
        out_rows = out.reshape(rows, -1)
        step = max(1, (1 << 22) // k)  # pack ~4M weights at a time: bounded temporaries
        for r in range(0, rows, step):
            n = min(step, rows - r)
            if t == T.Q8_0 and role in ("matrix", "embd", "head"):
                _random_q8_0(out_rows[r:r + n], k, _std(role, k), rng)
            else:
                out_rows[r:r + n] = pack(_values(role, (n, k), g), t).numpy()
        tensors[name] = TensorInfo(name, t, shp, out.nbytes, offset)
        blobs[name] = out
        offset += (out.nbytes + 31) // 32 * 32
    path = Path(f"<synthetic {shape_name}:{type_name}>")
    return GGUFFile(path, _metadata(s, shape_name, type_name), tensors, blobs)


def _tokenizer_metadata(n_vocab: int, vocab_gguf: Path | None) -> dict[str, Any]:
    """Tokenizer keys: the real Qwen3.5 vocabulary when it fits `n_vocab`, else byte tokens + pads."""
    if vocab_gguf is not None and vocab_gguf.is_file():
        from engine.gguf import open_gguf
        v = open_gguf(vocab_gguf).metadata
        if len(v.get("tokenizer.ggml.tokens", [])) == n_vocab:
            return {k: val for k, val in v.items() if k.startswith("tokenizer.")}
    byte_tokens = _byte_tokens() + ["\u0120\u0120"]  # one merge: llama.cpp requires the merges key
    tokens = byte_tokens + [f"[PAD{i}]" for i in range(len(byte_tokens), n_vocab - 2)] + ["<|endoftext|>", "<|im_end|>"]
    types = [1] * len(byte_tokens) + [5] * (n_vocab - 2 - len(byte_tokens)) + [3, 3]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["\u0120 \u0120"],
            "tokenizer.ggml.eos_token_id": n_vocab - 1, "tokenizer.ggml.padding_token_id": n_vocab - 2,
            "tokenizer.ggml.add_bos_token": False}


def _byte_tokens() -> list[str]:
    # GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _add_kv(w: GGUFWriter, key: str, val: Any) -> None:
    if isinstance(val, bool):
        w.add_key_value(key, val, GGUFValueType.BOOL)
    elif isinstance(val, int):
        w.add_key_value(key, val, GGUFValueType.UINT32)
    elif isinstance(val, float):
        w.add_key_value(key, val, GGUFValueType.FLOAT32)
    elif isinstance(val, str):
        w.add_key_value(key, val, GGUFValueType.STRING)
    elif isinstance(val, list):
        sub = GGUFValueType.STRING if val and isinstance(val[0], str) else GGUFValueType.INT32
        w.add_key_value(key, val, GGUFValueType.ARRAY, sub)
    else:
        raise TypeError(f"{key}: cannot write {type(val).__name__}")


def write_gguf(f: GGUFFile, path: str | Path, vocab_gguf: Path | None = None) -> int:
    """Write `f` (e.g. from `build_synthetic`) as a GGUF file with tokenizer keys; returns its size."""
    path = Path(path)
    md = dict(f.metadata)
    n_vocab = f.tensors["token_embd.weight"].shape[0]
    if not any(k.startswith("tokenizer.") for k in md):
        md.update(_tokenizer_metadata(n_vocab, vocab_gguf))
    arch = md["general.architecture"]
    w = GGUFWriter(path, arch)
    for key, val in md.items():
        if key != "general.architecture":
            _add_kv(w, key, val)
    for name, info in f.tensors.items():
        raw = f.tensor_bytes(name)
        rows = math.prod(info.shape[:-1])
        w.add_tensor(name, raw.reshape(*info.shape[:-1], raw.size // max(rows, 1)), raw_dtype=info.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size
