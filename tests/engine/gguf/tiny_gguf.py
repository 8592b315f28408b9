"""A few-KiB Qwen3.5-shaped GGUF, generated with gguf-py's writer (CLARIFICATIONS, Issue 2).

Same keys and tensor names as fixtures/models/tiny-qwen35-*.gguf (dense or MoE, MTP block, untied
head, tokenizer keys), at tiny dimensions. Build a `TinyPlan`, edit it (drop or reshape a tensor,
change a key), then `write(plan, path)`. Reusable by any test that needs a small valid model file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

T = GGMLQuantizationType
V = GGUFValueType


@dataclass
class TinyDims:
    n_embd: int = 4            # E
    n_vocab: int = 8           # V (tokens = embedding rows)
    n_head: int = 2            # H
    n_head_kv: int = 1         # Hkv
    head_dim: int = 2          # D
    rope_dim: int = 2          # R
    ssm_n_group: int = 1       # Hk
    ssm_dt_rank: int = 2       # Hv
    ssm_d_state: int = 2       # Dk = Dv
    conv_kernel: int = 4       # Kc
    n_ff: int = 4              # F (dense)
    n_expert: int = 2          # X (MoE)
    n_expert_used: int = 1
    n_ff_exp: int = 2          # Fe
    n_ff_shexp: int = 4        # Fs
    n_main: int = 4            # GDN GDN GDN ATTN
    n_mtp: int = 1


@dataclass
class TinyPlan:
    arch: str
    metadata: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = field(default_factory=list)
    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]] = field(default_factory=list)

    def drop_tensor(self, name: str) -> None:
        n = len(self.tensors)
        self.tensors = [t for t in self.tensors if t[0] != name]
        assert len(self.tensors) == n - 1, name

    def set_tensor(self, name: str, data: np.ndarray, ggml_type: GGMLQuantizationType = T.F32) -> None:
        for i, t in enumerate(self.tensors):
            if t[0] == name:
                self.tensors[i] = (name, data, ggml_type)
                return
        self.tensors.append((name, data, ggml_type))

    def tensor(self, name: str) -> np.ndarray:
        return next(t[1] for t in self.tensors if t[0] == name)

    def set_key(self, key: str, value: Any, vtype: GGUFValueType, sub: GGUFValueType | None = None) -> None:
        for i, m in enumerate(self.metadata):
            if m[0] == key:
                self.metadata[i] = (key, value, vtype, sub)
                return
        self.metadata.append((key, value, vtype, sub))

    def drop_key(self, key: str) -> None:
        n = len(self.metadata)
        self.metadata = [m for m in self.metadata if m[0] != key]
        assert len(self.metadata) == n - 1, key


def tiny_plan(*, moe: bool = False, mtp: bool = True, tied: bool = False, dims: TinyDims | None = None,
              matrix_type: GGMLQuantizationType = T.F32, seed: int = 0) -> TinyPlan:
    """The plan of a tiny qwen35 (or qwen35moe) model; `matrix_type` applies to 2-D/3-D weights."""
    d = dims or TinyDims()
    arch = "qwen35moe" if moe else "qwen35"
    rng = np.random.default_rng(seed)
    plan = TinyPlan(arch)
    n_block = d.n_main + (d.n_mtp if mtp else 0)
    a = arch
    md = [
        ("general.architecture", arch, V.STRING, None),
        ("general.type", "model", V.STRING, None),
        ("general.name", f"tiny-{arch}-test", V.STRING, None),
        (f"{a}.block_count", n_block, V.UINT32, None),
        (f"{a}.context_length", 4096, V.UINT32, None),
        (f"{a}.embedding_length", d.n_embd, V.UINT32, None),
        (f"{a}.attention.head_count", d.n_head, V.UINT32, None),
        (f"{a}.attention.head_count_kv", d.n_head_kv, V.UINT32, None),
        (f"{a}.rope.dimension_sections", [1, 0, 0, 0], V.ARRAY, V.INT32),
        (f"{a}.rope.freq_base", 1e7, V.FLOAT32, None),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32, None),
        (f"{a}.attention.key_length", d.head_dim, V.UINT32, None),
        (f"{a}.attention.value_length", d.head_dim, V.UINT32, None),
        ("general.file_type", 0, V.UINT32, None),
        (f"{a}.ssm.conv_kernel", d.conv_kernel, V.UINT32, None),
        (f"{a}.ssm.state_size", d.ssm_d_state, V.UINT32, None),
        (f"{a}.ssm.group_count", d.ssm_n_group, V.UINT32, None),
        (f"{a}.ssm.time_step_rank", d.ssm_dt_rank, V.UINT32, None),
        (f"{a}.ssm.inner_size", d.ssm_dt_rank * d.ssm_d_state, V.UINT32, None),
        (f"{a}.full_attention_interval", 4, V.UINT32, None),
        (f"{a}.rope.dimension_count", d.rope_dim, V.UINT32, None),
    ]
    if mtp:
        md.append((f"{a}.nextn_predict_layers", d.n_mtp, V.UINT32, None))
    if moe:
        md += [(f"{a}.expert_count", d.n_expert, V.UINT32, None),
               (f"{a}.expert_used_count", d.n_expert_used, V.UINT32, None),
               (f"{a}.expert_feed_forward_length", d.n_ff_exp, V.UINT32, None),
               (f"{a}.expert_shared_feed_forward_length", d.n_ff_shexp, V.UINT32, None)]
    else:
        md.append((f"{a}.feed_forward_length", d.n_ff, V.UINT32, None))
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(d.n_vocab - 3)] + ["<|endoftext|>", "<|im_start|>",
                                                                                       "<|im_end|>"]
    md += [
        ("general.quantization_version", 2, V.UINT32, None),
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.pre", "qwen35", V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", [1] * (d.n_vocab - 3) + [3, 3, 3], V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", ["a b", "c d"], V.ARRAY, V.STRING),
        ("tokenizer.ggml.eos_token_id", d.n_vocab - 1, V.UINT32, None),
        ("tokenizer.ggml.padding_token_id", d.n_vocab - 3, V.UINT32, None),
        ("tokenizer.ggml.add_bos_token", False, V.BOOL, None),
        ("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}", V.STRING, None),
    ]
    plan.metadata = md

    E, D, H, Hkv = d.n_embd, d.head_dim, d.n_head, d.n_head_kv
    Ck, Cv = d.ssm_n_group * d.ssm_d_state, d.ssm_dt_rank * d.ssm_d_state
    C = 2 * Ck + Cv

    def mat(name: str, *shape: int) -> None:
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if matrix_type == T.F32 or shape[-1] % GGML_QUANT_SIZES[matrix_type][0]:
            plan.tensors.append((name, x, T.F32))  # as the quantizer: rows that are not whole blocks stay F32
        else:
            plan.tensors.append((name, quantize(x, matrix_type), matrix_type))

    def vec(name: str, *shape: int, value: float | None = None) -> None:
        x = np.full(shape, value, np.float32) if value is not None else rng.standard_normal(shape).astype(np.float32)
        plan.tensors.append((name, x, T.F32))

    def ffn(p: str) -> None:
        if not moe:
            mat(p + "ffn_down.weight", E, d.n_ff)
            mat(p + "ffn_gate.weight", d.n_ff, E)
            mat(p + "ffn_up.weight", d.n_ff, E)
        else:
            X = d.n_expert
            mat(p + "ffn_down_exps.weight", X, E, d.n_ff_exp)
            mat(p + "ffn_gate_exps.weight", X, d.n_ff_exp, E)
            mat(p + "ffn_up_exps.weight", X, d.n_ff_exp, E)
            vec(p + "ffn_gate_inp.weight", X, E)
            mat(p + "ffn_down_shexp.weight", E, d.n_ff_shexp)
            mat(p + "ffn_gate_shexp.weight", d.n_ff_shexp, E)
            mat(p + "ffn_up_shexp.weight", d.n_ff_shexp, E)
            vec(p + "ffn_gate_inp_shexp.weight", 1, E)
        vec(p + "post_attention_norm.weight", E, value=1.0)

    def attention(p: str) -> None:
        vec(p + "attn_k_norm.weight", D, value=1.0)
        mat(p + "attn_k.weight", Hkv * D, E)
        mat(p + "attn_output.weight", E, H * D)
        vec(p + "attn_q_norm.weight", D, value=1.0)
        mat(p + "attn_q.weight", 2 * H * D, E)
        mat(p + "attn_v.weight", Hkv * D, E)

    if not tied:
        mat("output.weight", d.n_vocab, E)
    mat("token_embd.weight", d.n_vocab, E)
    for i in range(d.n_main):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", E, value=1.0)
        if (i + 1) % 4:
            vec(p + "ssm_a", d.ssm_dt_rank, value=-1.0)
            vec(p + "ssm_conv1d.weight", C, d.conv_kernel)
            vec(p + "ssm_dt.bias", d.ssm_dt_rank, value=1.0)
            mat(p + "ssm_alpha.weight", d.ssm_dt_rank, E)
            mat(p + "ssm_beta.weight", d.ssm_dt_rank, E)
            mat(p + "attn_qkv.weight", C, E)
            mat(p + "attn_gate.weight", Cv, E)
            vec(p + "ssm_norm.weight", d.ssm_d_state, value=1.0)
            mat(p + "ssm_out.weight", E, Cv)
            ffn(p)
        else:
            ffn(p)
            attention(p)
    vec("output_norm.weight", E, value=1.0)
    if mtp:
        for n in range(d.n_main, d.n_main + d.n_mtp):
            p = f"blk.{n}."
            mat(p + "nextn.eh_proj.weight", E, 2 * E)
            vec(p + "attn_norm.weight", E, value=1.0)
            ffn(p)
            attention(p)
            vec(p + "nextn.shared_head_norm.weight", E, value=1.0)
            vec(p + "nextn.enorm.weight", E, value=1.0)
            vec(p + "nextn.hnorm.weight", E, value=1.0)
    return plan


def write(plan: TinyPlan, path: str | Path) -> Path:
    """Write the plan with gguf-py's GGUFWriter (the library llama.cpp's converter uses)."""
    path = Path(path)
    w = GGUFWriter(path, plan.arch)
    w.kv_data[0].clear()  # the plan carries general.architecture itself, in the fixtures' order
    for key, value, vtype, sub in plan.metadata:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, data, ggml_type in plan.tensors:
        if ggml_type in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_bytes(tmp_dir: str | Path, name: str = "tiny.gguf", **kw: Any) -> bytes:
    """Write `tiny_plan(**kw)` under `tmp_dir` and return the file's bytes."""
    return write(tiny_plan(**kw), Path(tmp_dir) / name).read_bytes()
