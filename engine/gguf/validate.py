"""Semantic checks of a `qwen35` / `qwen35moe` GGUF against its own config (spec/qwen35-gguf.md §2-§3, §5).

`load_model_file(path)` = checked header (`open_gguf`) + `ModelConfig` + these checks; it reads no
tensor data. Every expected tensor must be present with the shape the config implies and a type
the engine can dequantize; no unknown tensor, no fused Qwen3-Next tensor, vocabulary sizes agree,
special token ids in range (reliability-matrix A4). Failures raise `ModelFileError` naming the key
or tensor with "expected X, found Y".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from engine.config import ATTN, GDN, ModelConfig
from engine.errors import ModelFileError
from engine.gguf.reader import GGUFFile, open_gguf
from engine.quants import FLOAT_TYPES, SUPPORTED

log = logging.getLogger(__name__)

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# Fused Qwen3-Next tensors: their presence changes the V-head order in ik's GDN (spec §3.3); refuse.
_REFUSED_SUFFIXES = ("ssm_in.weight", "ssm_ba.weight", "ffn_gate_up_exps.weight")
_NORM_TYPES = FLOAT_TYPES  # 1-D tensors and ssm_conv1d are never quantized (spec §3.8)


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]      # PyTorch order
    float_only: bool = False    # 1-D tensors, ssm_conv1d: F32/F16/BF16 only
    alt_shapes: tuple[tuple[int, ...], ...] = ()


@dataclass
class ModelFile:
    """A model GGUF whose header, config and tensor inventory passed every check (no weights read yet)."""
    gguf: GGUFFile
    config: ModelConfig
    mtp_form: tuple[str, ...] = ()   # the ik-tolerated reduced MTP pieces in use, e.g. ("no eh_proj",)

    @property
    def path(self) -> Path:
        return self.gguf.path

    def load_weights(self, device="cpu"):
        from engine.weights import load_weights

        return load_weights(self.gguf, device)


def _norm(n: int) -> Expected:
    return Expected((n,), float_only=True)


def _mixer_tensors(cfg: ModelConfig, kind: str) -> dict[str, Expected]:
    E, D = cfg.n_embd, cfg.head_dim
    if kind == GDN:
        C, Cv, Hv = cfg.conv_channels, cfg.ssm_d_inner, cfg.ssm_dt_rank
        return {
            "attn_qkv.weight": Expected((C, E)),
            "attn_gate.weight": Expected((Cv, E)),
            "ssm_conv1d.weight": Expected((C, cfg.ssm_conv_kernel), float_only=True),
            "ssm_dt.bias": _norm(Hv),
            "ssm_a": _norm(Hv),
            "ssm_beta.weight": Expected((Hv, E)),
            "ssm_alpha.weight": Expected((Hv, E)),
            "ssm_norm.weight": _norm(cfg.ssm_head_v_dim),
            "ssm_out.weight": Expected((E, Cv)),
        }
    H, Hkv = cfg.n_head, cfg.n_head_kv
    return {
        "attn_q.weight": Expected((2 * H * D, E)),
        "attn_k.weight": Expected((Hkv * D, E)),
        "attn_v.weight": Expected((Hkv * D, E)),
        "attn_output.weight": Expected((E, H * D)),
        "attn_q_norm.weight": _norm(D),
        "attn_k_norm.weight": _norm(D),
    }


def _ffn_tensors(cfg: ModelConfig) -> dict[str, Expected]:
    E = cfg.n_embd
    if not cfg.is_moe:
        F = cfg.n_ff
        return {"ffn_gate.weight": Expected((F, E)), "ffn_up.weight": Expected((F, E)),
                "ffn_down.weight": Expected((E, F))}
    X, Fe, Fs = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    out = {
        "ffn_gate_inp.weight": Expected((X, E)),
        "ffn_gate_exps.weight": Expected((X, Fe, E)),
        "ffn_up_exps.weight": Expected((X, Fe, E)),
        "ffn_down_exps.weight": Expected((X, E, Fe)),
    }
    if Fs:
        out.update({
            "ffn_gate_inp_shexp.weight": Expected((E,), alt_shapes=((1, E),)),
            "ffn_gate_shexp.weight": Expected((Fs, E)),
            "ffn_up_shexp.weight": Expected((Fs, E)),
            "ffn_down_shexp.weight": Expected((E, Fs)),
        })
    return out


def expected_tensors(cfg: ModelConfig, present: set[str]) -> tuple[dict[str, Expected], dict[str, Expected],
                                                                   tuple[str, ...]]:
    """(required, optional, mtp_form): every tensor name the config implies, PyTorch shapes.

    MTP blocks accept ik_llama.cpp's reduced forms (spec §3.7, §6.1): `eh_proj`, `shared_head_norm`,
    `attn_q` and the whole FFN (with its norm) may be absent; each absence is reported in mtp_form.
    """
    E, V = cfg.n_embd, cfg.n_vocab
    required: dict[str, Expected] = {
        "token_embd.weight": Expected((V, E)),
        "output_norm.weight": _norm(E),
    }
    optional: dict[str, Expected] = {
        "output.weight": Expected((V, E)),
        "output_extra.weight": Expected((V, E)),  # ik_llama.cpp only; ignored by the engine
    }
    common = {"attn_norm.weight": _norm(E), "post_attention_norm.weight": _norm(E)}
    for i, kind in enumerate(cfg.layer_kinds):
        for suffix, exp in {**common, **_mixer_tensors(cfg, kind), **_ffn_tensors(cfg)}.items():
            required[f"blk.{i}.{suffix}"] = exp
    form: list[str] = []
    for n in cfg.nextn_blocks:
        p = f"blk.{n}."
        block_req = {"attn_norm.weight": _norm(E), **_mixer_tensors(cfg, ATTN),
                     "nextn.enorm.weight": _norm(E), "nextn.hnorm.weight": _norm(E)}
        block_opt = {"nextn.embed_tokens.weight": Expected((V, E)),
                     "nextn.shared_head_head.weight": Expected((V, E))}
        for suffix, exp, label in (("nextn.eh_proj.weight", Expected((E, 2 * E)), "no eh_proj"),
                                   ("nextn.shared_head_norm.weight", _norm(E), "no shared_head_norm"),
                                   ("attn_q.weight", block_req.pop("attn_q.weight"), "no attn_q")):
            if p + suffix in present:
                block_req[suffix] = exp
            else:
                block_opt[suffix] = exp
                form.append(f"{p[:-1]}: {label}")
        ffn = {"post_attention_norm.weight": _norm(E), **_ffn_tensors(cfg)}
        if any(p + s in present for s in ffn):
            block_req.update(ffn)
        else:
            form.append(f"{p[:-1]}: no FFN")
        required.update({p + s: e for s, e in block_req.items()})
        optional.update({p + s: e for s, e in block_opt.items()})
    return required, optional, tuple(form)


def _check_tensor(f: GGUFFile, name: str, exp: Expected) -> None:
    t = f.tensors[name]
    if t.ggml_type not in SUPPORTED:
        raise ModelFileError(f.path, f"{name}: type {t.ggml_type.name} is not supported "
                                     f"(supported: {', '.join(q.name for q in SUPPORTED)})")
    if exp.float_only and t.ggml_type not in _NORM_TYPES:
        raise ModelFileError(f.path, f"{name}: expected type F32, F16 or BF16, found {t.ggml_type.name}")
    if t.shape != exp.shape and t.shape not in exp.alt_shapes:
        raise ModelFileError(f.path, f"{name}: expected shape {list(exp.shape)} (PyTorch order), "
                                     f"found {list(t.shape)}")


def _int_list(f: GGUFFile, key: str) -> list | None:
    v = f.metadata.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ModelFileError(f.path, f"{key}: expected an array of integers, found {_describe(f, key)}")
    return v


def _str_list(f: GGUFFile, key: str) -> list | None:
    v = f.metadata.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or any(not isinstance(x, str) for x in v):
        raise ModelFileError(f.path, f"{key}: expected an array of strings, found {_describe(f, key)}")
    return v


def _describe(f: GGUFFile, key: str) -> str:
    vt = f.value_types.get(key)
    if vt is not None:
        return str(vt)
    v = f.metadata.get(key)
    return type(v).__name__


def check_tokenizer(f: GGUFFile, n_vocab: int | None, *, required: bool = True) -> None:
    """Vocabulary keys: types, lengths that agree with each other and with `n_vocab`, ids in range."""
    tokens = _str_list(f, "tokenizer.ggml.tokens")
    if tokens is None:
        if required:
            raise ModelFileError(f.path, "tokenizer.ggml.tokens: required key missing (the file has no vocabulary)")
        return
    model = f.metadata.get("tokenizer.ggml.model")
    if not isinstance(model, str):
        raise ModelFileError(f.path, f"tokenizer.ggml.model: expected a string, found "
                                     f"{'nothing' if model is None else _describe(f, 'tokenizer.ggml.model')}")
    n_tokens = len(tokens)
    if n_tokens == 0:
        raise ModelFileError(f.path, "tokenizer.ggml.tokens: the vocabulary is empty")
    if n_vocab is not None and n_tokens != n_vocab:
        raise ModelFileError(f.path, f"tokenizer.ggml.tokens: expected {n_vocab} tokens (rows of token_embd.weight), "
                                     f"found {n_tokens}")
    types = _int_list(f, "tokenizer.ggml.token_type")
    if types is not None and len(types) != n_tokens:
        raise ModelFileError(f.path, f"tokenizer.ggml.token_type: expected {n_tokens} entries (one per token), "
                                     f"found {len(types)}")
    _str_list(f, "tokenizer.ggml.merges")
    for key in ("tokenizer.ggml.scores",):
        v = f.metadata.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != n_tokens):
            raise ModelFileError(f.path, f"{key}: expected {n_tokens} entries, found {_describe(f, key)}")
    for key, v in f.metadata.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ModelFileError(f.path, f"{key}: expected an integer, found {_describe(f, key)}")
            if not 0 <= v < n_tokens:
                raise ModelFileError(f.path, f"{key}: token id {v} is out of range (vocabulary of {n_tokens})")
        elif key.startswith("tokenizer.ggml.add_") and not isinstance(v, bool):
            raise ModelFileError(f.path, f"{key}: expected a boolean, found {_describe(f, key)}")
    tmpl = f.metadata.get("tokenizer.chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise ModelFileError(f.path, f"tokenizer.chat_template: expected a string, found {_describe(f, 'tokenizer.chat_template')}")


def validate_model(f: GGUFFile, cfg: ModelConfig, *, require_tokenizer: bool = True) -> tuple[str, ...]:
    """Check the tensor inventory and vocabulary against `cfg`. Returns the MTP reduced form (may be empty)."""
    names = set(f.tensors)
    for name in sorted(names):
        if name.endswith(_REFUSED_SUFFIXES):
            raise ModelFileError(f.path, f"{name}: fused Qwen3-Next tensor in a {cfg.arch} file is not supported "
                                         "(spec §3.3)")
    # Unsupported types first, so the message names the type rather than a shape.
    for name in sorted(names, key=lambda n: f.tensors[n].offset):
        t = f.tensors[name]
        if t.ggml_type not in SUPPORTED:
            raise ModelFileError(f.path, f"{name}: type {GGMLQuantizationType(t.ggml_type).name} is not supported")
    blocks_present: dict[int, int] = {}
    for name in names:
        m = _BLOCK_NAME.match(name)
        if m:
            i = int(m.group(1))
            if i >= cfg.n_block:
                raise ModelFileError(f.path, f"{name}: block {i} is beyond {cfg.arch}.block_count {cfg.n_block}")
            if i < cfg.n_layer and m.group(2).startswith("nextn."):
                raise ModelFileError(f.path, f"{name}: MTP tensor in main block {i} ({cfg.arch}.block_count "
                                             f"{cfg.n_block} and nextn_predict_layers {cfg.n_nextn} put the MTP "
                                             f"blocks at {cfg.n_layer}..{cfg.n_block - 1})")
            blocks_present[i] = blocks_present.get(i, 0) + 1
    for i in range(cfg.n_block):
        if i not in blocks_present:
            raise ModelFileError(f.path, f"{cfg.arch}.block_count: {cfg.n_block} blocks declared, but blk.{i} has "
                                         "no tensors")
    required, optional, form = expected_tensors(cfg, names)
    for name, exp in required.items():
        if name not in names:
            m = _BLOCK_NAME.match(name)
            where = ""
            if m and int(m.group(1)) < cfg.n_layer:
                where = f" ({cfg.layer_kinds[int(m.group(1))]} block)"
            elif m:
                where = " (MTP block)"
            raise ModelFileError(f.path, f"{name}: required tensor missing{where}")
        _check_tensor(f, name, exp)
    for name in sorted(names - set(required)):
        if name not in optional:
            raise ModelFileError(f.path, f"{name}: unexpected tensor in a {cfg.arch} file with layers "
                                         f"{cfg.layer_pattern()}")
        _check_tensor(f, name, optional[name])
    check_tokenizer(f, cfg.n_vocab, required=require_tokenizer)
    vocab_size = f.metadata.get(f"{cfg.arch}.vocab_size")
    if vocab_size is not None and vocab_size != cfg.n_vocab:
        raise ModelFileError(f.path, f"{cfg.arch}.vocab_size: expected {cfg.n_vocab} (rows of token_embd.weight), "
                                     f"found {vocab_size!r}")
    for piece in form:
        log.info("%s: MTP block in a reduced form: %s", f.path, piece)
    return form


def check_model_gguf(f: GGUFFile, *, require_tokenizer: bool = True) -> ModelFile:
    """Config + semantic checks on an already opened GGUF."""
    if not f.tensors:
        raise ModelFileError(f.path, "has no model weights (0 tensors; a tokenizer-only GGUF cannot be used as a model)")
    cfg = ModelConfig.from_gguf(f)
    form = validate_model(f, cfg, require_tokenizer=require_tokenizer)
    return ModelFile(f, cfg, form)


def load_model_file(path: str | Path) -> ModelFile:
    """Open a model GGUF and run every check: header (ten checks), config, tensors, vocabulary.

    Reads no tensor data; call `.load_weights(device)` for owned weights (spec/reliability-matrix.md A1-A6).
    """
    return check_model_gguf(open_gguf(path))
