"""`mtpchat generate --model PATH (--prompt TEXT [--chat] | --tokens IDS) --max-tokens N
[--temperature T --top-k K --top-p P --seed S] [--mtp off|on|adaptive|auto] [--draft K] [--json]`.

With --json, one JSON object: tokens, text, finish_reason, stats (prompt/generated tokens, prefill and
decode seconds, tokens per second, and the MTP counters of spec/mtp-speculation.md §7: drafted,
accepted, accept_rate, accepted_per_position, mean_accepted_length, gate).
"""

from __future__ import annotations

import argparse
import json
import sys

from app.commands.logits import add_draft_args, add_model_args, load_from_args, parse_token_ids
from engine.errors import InputError
from engine.spec.modes import DEFAULT_DRAFT, DEFAULT_MODE, HIDDEN_MODES, MTP_MODES


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt (MTP speculation: --mtp)",
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
    p.add_argument("--mtp", choices=MTP_MODES, default=DEFAULT_MODE,
                   help="MTP speculation: off, on (always --draft drafts), adaptive (the seed's gate), "
                        "auto (choose k each round; default). auto/adaptive fall back to plain decoding "
                        "on a model without an MTP layer")
    p.add_argument("--draft", type=int, default=DEFAULT_DRAFT, metavar="K",
                   help="drafts per round, 1..8 (default 3; the largest k for auto)")
    add_draft_args(p)
    p.add_argument("--mtp-hidden", choices=HIDDEN_MODES, default="post-norm",
                   help="main hidden state fed to the MTP head: post-norm (default) or pre-norm (the seed's)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.sampling import SamplingParams
    from engine.spec.decode import SpecDecoder, SpecOptions
    from engine.spec.stops import StopRule

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
    if args.mtp == "on" and not model.cfg.has_mtp:
        raise InputError("--mtp on: this model file has no MTP (nextn) layer")
    if not 1 <= args.draft <= 8:
        raise InputError(f"--draft: must be in 1..8, got {args.draft}")
    stop = () if args.ignore_eos else _stop_ids(f, tok)
    if args.max_tokens == 0:
        res = None
    else:
        dec = SpecDecoder(model, SpecOptions(mode=args.mtp, n_draft=args.draft, hidden=args.mtp_hidden))
        res = dec.generate([prompt], StopRule(max_tokens=args.max_tokens, eos_ids=frozenset(stop)), sampling)[0]
    tokens = res.tokens if res else []
    text = tok.decode(tokens) if tok is not None else ""
    spec = res.stats.as_dict() if res else {}
    stats = {
        "prompt_tokens": len(prompt),
        "generated_tokens": len(tokens),
        "prefill_seconds": round(res.prefill_s, 6) if res else 0.0,
        "decode_seconds": round(res.decode_s, 6) if res else 0.0,
        "tokens_per_second": round(res.decode_tokens_per_second, 3) if res else 0.0,
        "prefill_tokens_per_second": round(len(prompt) / res.prefill_s, 3) if res and res.prefill_s else 0.0,
        "decode_steps": (spec.get("rounds", 0) + spec.get("plain_steps", 0)) if res else 0,
        **{k: spec.get(k) for k in ("drafted", "accepted", "accept_rate", "accepted_per_position",
                                     "mean_accepted_length", "gate")},
    }
    finish = res.finish_reason if res else "length"
    if args.json:
        doc = {"tokens": tokens, "text": text, "finish_reason": finish, "stats": stats,
               "prompt": prompt, "mtp": args.mtp, "device": args.device, "dtype": str(model.dtype).split(".")[-1]}
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(text + "\n")
        mtp = ""
        if stats["drafted"]:
            mtp = (f", MTP {args.mtp}: {stats['accepted']}/{stats['drafted']} drafts accepted, "
                   f"{stats['mean_accepted_length']:.2f} tokens per round")
        sys.stderr.write(f"[{finish}] prompt {len(prompt)} tokens in {stats['prefill_seconds']:.3f} s, "
                         f"{len(tokens)} generated, decode {stats['tokens_per_second']:.1f} tokens/s{mtp}\n")
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
