"""The model configuration, built once from GGUF metadata and tensor presence (spec/qwen35-gguf.md §2, §5).

Code reads fields of `ModelConfig`, never raw metadata keys. Layer kinds come from tensor presence
(`ssm_conv1d` -> GDN, `attn_q` -> attention), falling back to the `full_attention_interval` rule,
so RYS files with repeated spans load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelFileError

GDN = "GDN"
ATTN = "ATTN"
SUPPORTED_ARCHS = ("qwen35", "qwen35moe")
MAX_DIM = 2**31 - 1   # no dimension of a real model comes near this; bounds all later arithmetic


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # "qwen35" (dense FFN) or "qwen35moe"
    n_embd: int                    # E
    n_block: int                   # L: main + nextn blocks, as `block_count`
    n_nextn: int                   # M: MTP blocks present in the file (0 = no MTP)
    layer_kinds: tuple[str, ...]   # kind of each main block 0..Lm-1, GDN or ATTN
    n_head: int                    # H
    n_head_kv: int                 # Hkv
    head_dim: int                  # D
    rope_dim: int                  # R: rotary dims at the start of each head
    rope_theta: float
    rope_sections: tuple[int, ...]
    rms_eps: float
    n_ff: int                      # F (dense), 0 when unused
    n_vocab: int                   # rows of token_embd
    context_length: int
    ssm_conv_kernel: int           # Kc
    ssm_d_state: int               # Dk (K head dim)
    ssm_n_group: int               # Hk (K heads)
    ssm_dt_rank: int               # Hv (V heads)
    ssm_d_inner: int               # Hv * Dv
    n_expert: int = 0              # X
    n_expert_used: int = 0         # k
    n_ff_exp: int = 0              # Fe
    n_ff_shexp: int = 0            # Fs
    tied_output: bool = False      # no output.weight: the head is token_embd
    attention_scale: float | None = None

    @property
    def n_layer(self) -> int:
        """Lm, the number of main blocks."""
        return self.n_block - self.n_nextn

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def has_mtp(self) -> bool:
        return self.n_nextn > 0

    @property
    def ssm_head_v_dim(self) -> int:  # Dv
        return self.ssm_d_inner // self.ssm_dt_rank

    @property
    def conv_channels(self) -> int:  # C = 2*Hk*Dk + Hv*Dv
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == ATTN)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == GDN)

    @property
    def nextn_blocks(self) -> tuple[int, ...]:
        return tuple(range(self.n_layer, self.n_block))

    def layer_pattern(self) -> str:
        """e.g. 'GDN GDN GDN ATTN | MTP'."""
        s = " ".join(self.layer_kinds)
        if self.n_nextn:
            s += " | " + " ".join(["MTP"] * self.n_nextn)
        return s

    @classmethod
    def from_gguf(cls, f: Any) -> ModelConfig:
        """Build from a `GGUFFile` (metadata + tensor names). Raises ModelFileError naming the key."""
        md, names, path = f.metadata, set(f.tensors), f.path
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(path, "general.architecture: missing or not a string")
        if arch not in SUPPORTED_ARCHS:
            raise ModelFileError(path, f"general.architecture: {arch!r} is not supported (qwen35, qwen35moe)")

        def key(name: str, typ: type | tuple = int, default: Any = ..., required: bool = True) -> Any:
            full = f"{arch}.{name}"
            if full not in md:
                if default is not ... or not required:
                    return None if default is ... else default
                raise ModelFileError(path, f"{full}: required key missing")
            v = md[full]
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if isinstance(v, bool) or not isinstance(v, typ):
                vt = getattr(f, "value_types", {}).get(full)
                found = str(vt) if vt is not None else type(v).__name__
                want = "an integer" if typ is int else "a number"
                raise ModelFileError(path, f"{full}: expected {want}, found {found}")
            if typ is int and v < 0:
                raise ModelFileError(path, f"{full}: negative value {v}")
            return v

        n_block = key("block_count")
        n_nextn = key("nextn_predict_layers", default=0)
        if n_block <= 0 or n_block > 4096:
            raise ModelFileError(path, f"{arch}.block_count: {n_block} out of range 1..4096")
        if n_nextn >= n_block:
            raise ModelFileError(path, f"{arch}.nextn_predict_layers: {n_nextn} >= block_count {n_block}")
        # A file may declare MTP blocks whose tensors were dropped: trust tensors.
        if n_nextn and f"blk.{n_block - n_nextn}.nextn.eh_proj.weight" not in names \
                and f"blk.{n_block - n_nextn}.attn_norm.weight" not in names:
            n_block -= n_nextn
            n_nextn = 0
        interval = key("full_attention_interval", default=4) or 4
        kinds = []
        for i in range(n_block - n_nextn):
            gdn = f"blk.{i}.ssm_conv1d.weight" in names
            att = f"blk.{i}.attn_q.weight" in names
            if gdn and att:
                raise ModelFileError(path, f"blk.{i}: has both Gated DeltaNet and attention tensors")
            if gdn:
                kinds.append(GDN)
            elif att:
                kinds.append(ATTN)
            else:
                kinds.append(ATTN if (i + 1) % interval == 0 else GDN)
        n_head = key("attention.head_count")
        n_head_kv = key("attention.head_count_kv", default=n_head)
        head_dim = key("attention.key_length")
        value_length = key("attention.value_length")
        if value_length != head_dim:
            raise ModelFileError(path, f"{arch}.attention.value_length: {value_length} differs from "
                                       f"{arch}.attention.key_length {head_dim}")
        sections = md.get(f"{arch}.rope.dimension_sections", [])
        if not isinstance(sections, list) or len(sections) > 4 \
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sections):
            raise ModelFileError(path, f"{arch}.rope.dimension_sections: expected an array of at most 4 "
                                       f"non-negative integers, found {_short(sections)}")
        is_moe = arch == "qwen35moe"
        vocab_rows = f.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in f.tensors else 0
        cfg = cls(
            arch=arch,
            n_embd=key("embedding_length"),
            n_block=n_block,
            n_nextn=n_nextn,
            layer_kinds=tuple(kinds),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            rope_dim=key("rope.dimension_count", default=head_dim),
            rope_theta=key("rope.freq_base", float),
            rope_sections=tuple(int(s) for s in sections),
            rms_eps=key("attention.layer_norm_rms_epsilon", float),
            n_ff=key("feed_forward_length", default=0) if is_moe else key("feed_forward_length"),
            n_vocab=vocab_rows,
            context_length=key("context_length"),
            ssm_conv_kernel=key("ssm.conv_kernel"),
            ssm_d_state=key("ssm.state_size"),
            ssm_n_group=key("ssm.group_count"),
            ssm_dt_rank=key("ssm.time_step_rank"),
            ssm_d_inner=key("ssm.inner_size"),
            n_expert=key("expert_count") if is_moe else 0,
            n_expert_used=key("expert_used_count") if is_moe else 0,
            n_ff_exp=key("expert_feed_forward_length") if is_moe else 0,
            n_ff_shexp=key("expert_shared_feed_forward_length", default=0) if is_moe else 0,
            tied_output="output.weight" not in names,
            attention_scale=key("attention.scale", float, required=False),
        )
        positive = [("embedding_length", cfg.n_embd), ("attention.head_count", n_head),
                    ("attention.head_count_kv", n_head_kv), ("attention.key_length", head_dim),
                    ("context_length", cfg.context_length), ("ssm.conv_kernel", cfg.ssm_conv_kernel),
                    ("ssm.state_size", cfg.ssm_d_state), ("ssm.inner_size", cfg.ssm_d_inner),
                    ("ssm.time_step_rank", cfg.ssm_dt_rank), ("ssm.group_count", cfg.ssm_n_group)]
        if is_moe:
            positive += [("expert_count", cfg.n_expert), ("expert_feed_forward_length", cfg.n_ff_exp)]
        else:
            positive.append(("feed_forward_length", cfg.n_ff))
        for name, v in positive:
            if not 0 < v <= MAX_DIM:
                raise ModelFileError(path, f"{arch}.{name}: expected an integer in 1..{MAX_DIM}, found {v}")
        if cfg.n_ff_shexp > MAX_DIM or cfg.n_ff > MAX_DIM:
            raise ModelFileError(path, f"{arch}: feed-forward length out of range")
        for name, v in (("rope.freq_base", cfg.rope_theta), ("attention.layer_norm_rms_epsilon", cfg.rms_eps),
                        ("attention.scale", cfg.attention_scale)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ModelFileError(path, f"{arch}.{name}: expected a finite positive number, found {v}")
        if n_head % n_head_kv:
            raise ModelFileError(path, f"{arch}.attention.head_count_kv: {n_head_kv} does not divide head_count {n_head}")
        if cfg.rope_dim > head_dim or cfg.rope_dim % 2:
            raise ModelFileError(path, f"{arch}.rope.dimension_count: {cfg.rope_dim} invalid for head dim {head_dim}")
        if cfg.ssm_d_inner % cfg.ssm_dt_rank or cfg.ssm_head_v_dim != cfg.ssm_d_state:
            raise ModelFileError(path, f"{arch}.ssm.inner_size: V head dim {cfg.ssm_d_inner}/{cfg.ssm_dt_rank} != state_size {cfg.ssm_d_state}")
        if cfg.ssm_dt_rank % cfg.ssm_n_group:
            raise ModelFileError(path, f"{arch}.ssm.group_count: {cfg.ssm_n_group} does not divide time_step_rank {cfg.ssm_dt_rank}")
        if is_moe and not (0 < cfg.n_expert_used <= cfg.n_expert):
            raise ModelFileError(path, f"{arch}.expert_used_count: {cfg.n_expert_used} not in 1..{cfg.n_expert}")
        return cfg
