"""`mtpchat generate --model PATH (--prompt TEXT [--chat] | --tokens IDS) --max-tokens N
[--temperature T --top-k K --top-p P --seed S] [--mtp off] [--json]`: plain generation.

With --json, one JSON object: tokens, text, finish_reason, stats (prompt/generated tokens, prefill and
decode seconds, tokens per second). Only `--mtp off` exists until the speculative loop lands.
"""

from __future__ import annotations

import argparse
import json
import sys

from app.commands.logits import add_model_args, load_from_args, parse_token_ids
from engine.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt (plain decoding)",
                              description="Prefill a prompt and generate up to --max-tokens tokens, greedy by "
                                          "default; stops at the model's end-of-generation tokens.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--tokens", help="prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as one user message with the chat template")
    p.add_argument("--max-tokens", type=int, required=True, metavar="N", help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--mtp", choices=("off",), default="off", help="speculative decoding mode (only 'off' so far)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.generate import generate
    from engine.sampling import SamplingParams

    if args.max_tokens < 0:
        raise InputError(f"--max-tokens: must be >= 0, got {args.max_tokens}")
    if args.chat and args.prompt is None:
        raise InputError("--chat: needs --prompt")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    f, model = load_from_args(args)
    tok = _tokenizer(f)
    if args.tokens is not None:
        prompt = parse_token_ids(args.tokens, model.cfg.n_vocab)
    else:
        if tok is None:
            raise InputError("--prompt: the text tokenizer is not available; use --tokens")
        prompt = _encode(f, tok, args.prompt, args.chat)
        if not prompt:
            raise InputError("--prompt: the prompt encodes to no tokens")
    stop = () if args.ignore_eos else _stop_ids(f, tok)
    res = generate(model, prompt, max_tokens=args.max_tokens, sampling=sampling, stop_ids=stop)
    text = tok.decode(res.tokens) if tok is not None else ""
    stats = {
        "prompt_tokens": res.prompt_tokens,
        "generated_tokens": len(res.tokens),
        "prefill_seconds": round(res.prefill_s, 6),
        "decode_seconds": round(res.decode_s, 6),
        "tokens_per_second": round(res.decode_tokens_per_second, 3),
        "prefill_tokens_per_second": round(res.prefill_tokens_per_second, 3),
        "decode_steps": res.decode_steps,
    }
    if args.json:
        doc = {"tokens": res.tokens, "text": text, "finish_reason": res.finish_reason, "stats": stats,
               "prompt": prompt, "mtp": args.mtp, "device": args.device, "dtype": str(model.dtype).split(".")[-1]}
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(text + "\n")
        sys.stderr.write(f"[{res.finish_reason}] prompt {res.prompt_tokens} tokens in {res.prefill_s:.3f} s, "
                         f"{len(res.tokens)} generated, decode {res.decode_tokens_per_second:.1f} tokens/s\n")
    return 0


def _tokenizer(f):
    """The file's tokenizer, or None when the file has no vocabulary (or engine.text is absent)."""
    try:
        from engine.text import Tokenizer
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("engine.text"):
            return None
        raise
    if "tokenizer.ggml.tokens" not in f.metadata:
        return None
    return Tokenizer.from_gguf(f)


def _encode(f, tok, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tok.encode(prompt)
    from engine.text import ChatTemplate

    rendered = ChatTemplate.from_tokenizer_metadata(f.metadata, tok).render([{"role": "user", "content": prompt}])
    return tok.encode_chat(rendered.pieces)


def _stop_ids(f, tok) -> tuple[int, ...]:
    if tok is not None:
        return tuple(sorted(tok.special.eog))
    eos = f.metadata.get("tokenizer.ggml.eos_token_id")
    return (eos,) if isinstance(eos, int) else ()
