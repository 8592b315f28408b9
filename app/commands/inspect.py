"""`mtpchat inspect PATH [--json] [--ctx N]`: what a model GGUF holds, after every loader check.

Reads only the header (no weights). An invalid file exits 2 with one line `error: <path>: <what>`
(the CLI prints the ModelFileError); `--json` prints exactly one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from engine.errors import InputError
from engine.gguf import ModelFile, load_model_file
from engine.memory import engine_kv_dtype, sequence_memory


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="summarise a model GGUF (layers, dims, quant types, tokenizer, MTP)",
                              description="Check a Qwen3.5/3.6 GGUF and summarise it: architecture, layer kinds, "
                                          "dimensions, quant types, tokenizer, chat template, MTP; with --ctx, the "
                                          "KV cache and recurrent-state bytes one sequence needs.")
    p.add_argument("path", help="the .gguf file")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--ctx", type=int, metavar="N", help="context length for the per-sequence memory figures")
    p.set_defaults(func=run)


def summarize(m: ModelFile, n_ctx: int | None = None) -> dict[str, Any]:
    """Everything `inspect` reports, as plain JSON-able values."""
    f, c = m.gguf, m.config
    md = f.metadata
    quant: Counter = Counter()
    qbytes: Counter = Counter()
    for t in f.tensors.values():
        quant[t.ggml_type.name] += 1
        qbytes[t.ggml_type.name] += t.n_bytes
    tokens = md.get("tokenizer.ggml.tokens") or []
    special = {}
    for key, v in md.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            special[key[len("tokenizer.ggml."):-len("_token_id")]] = {"id": v, "text": tokens[v]}
    template = md.get("tokenizer.chat_template")
    out: dict[str, Any] = {
        "path": str(f.path),
        "file_bytes": f.file_size,
        "gguf_version": f.header.version if f.header else None,
        "architecture": c.arch,
        "name": md.get("general.name"),
        "blocks": c.n_block,
        "main_blocks": c.n_layer,
        "layer_kinds": list(c.layer_kinds),
        "layer_pattern": c.layer_pattern(),
        "dims": {
            "n_embd": c.n_embd, "n_vocab": c.n_vocab, "context_length": c.context_length,
            "n_head": c.n_head, "n_head_kv": c.n_head_kv, "head_dim": c.head_dim, "rope_dim": c.rope_dim,
            "rope_theta": c.rope_theta, "rope_sections": list(c.rope_sections), "rms_eps": c.rms_eps,
            "ssm_n_group": c.ssm_n_group, "ssm_dt_rank": c.ssm_dt_rank, "ssm_d_state": c.ssm_d_state,
            "ssm_head_v_dim": c.ssm_head_v_dim, "ssm_conv_kernel": c.ssm_conv_kernel,
            "n_ff": c.n_ff, "n_expert": c.n_expert, "n_expert_used": c.n_expert_used,
            "n_ff_exp": c.n_ff_exp, "n_ff_shexp": c.n_ff_shexp,
        },
        "output_head": "tied (token_embd.weight)" if c.tied_output else "untied (output.weight)",
        "mtp": {"present": c.has_mtp, "blocks": list(c.nextn_blocks), "reduced_form": list(m.mtp_form)},
        "quant_types": {k: {"tensors": quant[k], "bytes": qbytes[k]} for k in sorted(quant, key=lambda k: -qbytes[k])},
        "tensors": len(f.tensors),
        "tensor_bytes": sum(qbytes.values()),
        "tokenizer": {
            "model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens), "merges": len(md.get("tokenizer.ggml.merges") or []),
            "special": special, "add_bos_token": md.get("tokenizer.ggml.add_bos_token"),
        },
        "chat_template": {"present": template is not None,
                          "bytes": len(template.encode("utf-8")) if template is not None else 0},
    }
    if n_ctx is not None:
        mem = {}
        for label, dtype in (("engine_cpu", engine_kv_dtype("cpu")), ("engine_cuda", engine_kv_dtype("cuda")),
                             ("llama_cpp", "f16")):
            s = sequence_memory(c, n_ctx, dtype)
            mem[label] = {"kv_dtype": dtype, "kv_bytes": s.kv_bytes}
        s = sequence_memory(c, n_ctx)
        out["memory"] = {
            "n_ctx": n_ctx, "kv": mem, "attention_blocks_with_kv": s.attn_blocks,
            "recurrent_state": {"gdn_blocks": s.gdn_blocks, "conv_bytes": s.conv_state_bytes,
                                "delta_bytes": s.delta_state_bytes, "total_bytes": s.state_bytes,
                                "dtype": "f32"},
        }
    return out


def _b(n: int) -> str:
    return f"{n:,} B" + (f" ({n / 2**20:.2f} MiB)" if n >= 2**20 else "")


def render(s: dict[str, Any]) -> str:
    d = s["dims"]
    lines = [
        f"file            {s['path']} ({s['file_bytes']:,} bytes, GGUF v{s['gguf_version']})",
        f"architecture    {s['architecture']}" + (f"  ({s['name']})" if s["name"] else ""),
        f"blocks          {s['blocks']}: {s['main_blocks']} main + {len(s['mtp']['blocks'])} MTP",
        f"layer kinds     {s['layer_pattern']}",
        f"dimensions      n_embd {d['n_embd']}, n_vocab {d['n_vocab']}, context {d['context_length']:,}",
        f"attention       {d['n_head']} heads x {d['head_dim']}, {d['n_head_kv']} KV heads, rope {d['rope_dim']} dims, "
        f"theta {d['rope_theta']:g}, sections {d['rope_sections']}, rms eps {d['rms_eps']:g}",
        f"gated deltanet  {d['ssm_n_group']} K heads x {d['ssm_d_state']}, {d['ssm_dt_rank']} V heads x "
        f"{d['ssm_head_v_dim']}, conv kernel {d['ssm_conv_kernel']}",
    ]
    if d["n_expert"]:
        lines.append(f"ffn             MoE: {d['n_expert']} experts, top-{d['n_expert_used']}, expert ffn {d['n_ff_exp']}, "
                     f"shared expert ffn {d['n_ff_shexp']}")
    else:
        lines.append(f"ffn             dense {d['n_ff']}")
    lines.append(f"output head     {s['output_head']}")
    mtp = s["mtp"]
    if mtp["present"]:
        extra = f"; reduced form: {', '.join(mtp['reduced_form'])}" if mtp["reduced_form"] else ""
        lines.append(f"MTP             present (blk.{', blk.'.join(map(str, mtp['blocks']))}){extra}")
    else:
        lines.append("MTP             absent: the model loads without MTP speculation")
    lines.append(f"tensors         {s['tensors']}, {_b(s['tensor_bytes'])}")
    for name, q in s["quant_types"].items():
        lines.append(f"  {name:<8}      {q['tensors']:>5} tensors  {_b(q['bytes'])}")
    t = s["tokenizer"]
    specials = ", ".join(f"{k} {v['id']} {v['text']!r}" for k, v in sorted(t["special"].items())) or "none"
    lines.append(f"tokenizer       {t['model']} / pre {t['pre']}, {t['vocab_size']:,} tokens, {t['merges']:,} merges, "
                 f"add_bos {t['add_bos_token']}")
    lines.append(f"special ids     {specials}")
    ct = s["chat_template"]
    lines.append("chat template   " + (f"present ({ct['bytes']:,} bytes)" if ct["present"] else "absent"))
    if "memory" in s:
        m = s["memory"]
        kv = m["kv"]
        st = m["recurrent_state"]
        lines += [
            f"memory per sequence at n_ctx {m['n_ctx']:,} ({m['attention_blocks_with_kv']} attention blocks with KV, "
            "MTP included):",
            f"  KV cache      engine on CPU ({kv['engine_cpu']['kv_dtype']}): {_b(kv['engine_cpu']['kv_bytes'])}",
            f"                engine on CUDA ({kv['engine_cuda']['kv_dtype']}): {_b(kv['engine_cuda']['kv_bytes'])}",
            f"                llama.cpp default ({kv['llama_cpp']['kv_dtype']}): {_b(kv['llama_cpp']['kv_bytes'])}",
            f"  GDN state     {_b(st['total_bytes'])} f32 ({st['gdn_blocks']} blocks: conv {st['conv_bytes']:,} B + "
            f"delta {st['delta_bytes']:,} B), independent of n_ctx",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.ctx is not None and args.ctx <= 0:
        raise InputError(f"--ctx: expected a positive context length, got {args.ctx}")
    s = summarize(load_model_file(args.path), args.ctx)
    if args.json:
        sys.stdout.write(json.dumps(s, indent=2) + "\n")
    else:
        sys.stdout.write(render(s) + "\n")
    return 0
