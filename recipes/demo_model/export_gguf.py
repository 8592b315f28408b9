"""Write the trained demo model as a `qwen35` GGUF with the `gguf` package, exactly as llama.cpp's
converter lays out a Qwen3.5 file (spec/qwen35-gguf.md §2-§4.8, fixtures/README.md): the same keys in
the same order and types, the same tensor names, order, shapes and types (all F32, like the F32
fixture), norms stored with the +1 already applied, `ssm_a = -exp(A_log)`, V heads in tiled order,
the nextn tensors on block Lm, the tokenizer keys and the chat template.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer

from recipes.demo_model import corpus, tokenizer_train
from recipes.demo_model.model import DemoModel

GDN_TENSORS = ("attn_norm.weight", "ssm_a", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_alpha.weight",
               "ssm_beta.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_norm.weight", "ssm_out.weight",
               "ffn_down.weight", "ffn_gate.weight", "ffn_up.weight", "post_attention_norm.weight")
ATTN_TENSORS = ("attn_norm.weight", "ffn_down.weight", "ffn_gate.weight", "ffn_up.weight",
                "post_attention_norm.weight", "attn_k_norm.weight", "attn_k.weight", "attn_output.weight",
                "attn_q_norm.weight", "attn_q.weight", "attn_v.weight")


def tensor_order(model: DemoModel) -> list[str]:
    """The converter's order (as in fixtures/models/tiny-qwen35-f32.gguf): output, token_embd, the main
    blocks, output_norm, then the nextn block with eh_proj first and its three norms last."""
    cfg = model.cfg
    names = ["output.weight", "token_embd.weight"]
    for i, kind in enumerate(cfg.layer_kinds):
        names += [f"blk.{i}.{t}" for t in (GDN_TENSORS if kind == "GDN" else ATTN_TENSORS)]
    names.append("output_norm.weight")
    n = cfg.n_layer
    names.append(f"blk.{n}.nextn.eh_proj.weight")
    names += [f"blk.{n}.{t}" for t in ATTN_TENSORS]
    names += [f"blk.{n}.nextn.{t}.weight" for t in ("shared_head_norm", "enorm", "hnorm")]
    return names


def size_label(n_params: int) -> str:
    return f"{n_params / 1e6:.1f}M"


def write_gguf(model: DemoModel, tok: Tokenizer, path: Path, name: str = "mtpchat-demo-qwen35") -> Path:
    cfg = model.cfg
    tensors = model.gguf_tensors()
    order = tensor_order(model)
    if set(order) != set(tensors):
        raise ValueError(f"tensor set mismatch: {sorted(set(order) ^ set(tensors))}")
    vocab = tokenizer_train.gguf_vocab(tok, cfg.n_vocab)
    n_params = sum(int(np.prod(t.shape)) for n, t in tensors.items()
                   if not n.startswith(f"blk.{cfg.n_layer}."))    # main model only, like llama-bench
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "qwen35")
    arch = "qwen35"
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    w.add_string("general.size_label", size_label(n_params))
    w.add_uint32(f"{arch}.block_count", cfg.n_block)
    w.add_uint32(f"{arch}.context_length", cfg.context_length)
    w.add_uint32(f"{arch}.embedding_length", cfg.n_embd)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.n_ff)
    w.add_uint32(f"{arch}.attention.head_count", cfg.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.n_head_kv)
    w.add_array(f"{arch}.rope.dimension_sections", list(cfg.rope_sections))
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.ALL_F32))
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg.ssm_conv_kernel)
    w.add_uint32(f"{arch}.ssm.state_size", cfg.ssm_d_state)
    w.add_uint32(f"{arch}.ssm.group_count", cfg.ssm_n_group)
    w.add_uint32(f"{arch}.ssm.time_step_rank", cfg.ssm_dt_rank)
    w.add_uint32(f"{arch}.ssm.inner_size", cfg.ssm_d_inner)
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.rope_dim)
    w.add_uint32(f"{arch}.nextn_predict_layers", cfg.n_nextn)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", vocab["tokens"])
    w.add_array("tokenizer.ggml.token_type", vocab["token_type"])
    w.add_array("tokenizer.ggml.merges", vocab["merges"])
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab["eos_token_id"])
    w.add_uint32("tokenizer.ggml.padding_token_id", vocab["padding_token_id"])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", corpus.chat_template_text())
    for n in order:
        w.add_tensor(n, np.ascontiguousarray(tensors[n].numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    from recipes.demo_model.train import load_checkpoint

    p = argparse.ArgumentParser(description="Export the trained demo model to GGUF.")
    p.add_argument("--build", type=Path, default=Path("recipes/demo_model/build"))
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("resources/demo-qwen35.gguf"))
    a = p.parse_args(argv)
    model = load_checkpoint(a.checkpoint or a.build / "checkpoint.pt")
    tok = Tokenizer.from_file(str(a.build / "tokenizer.json"))
    write_gguf(model, tok, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
