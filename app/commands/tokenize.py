"""`mtpchat tokenize [--model PATH] (--text TEXT | --file F) [--special] [--json]`: token ids of a text.

Without --special, CONTROL tokens (<|im_start|> ...) stay literal text and USER_DEFINED tags (<think> ...)
are matched, as llama.cpp's parse_special=false; --special parses CONTROL tokens too. Works on a
vocab-only GGUF. Bad input exits 2 with one line (the CLI prints the MtpchatError).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.errors import InputError
from engine.resources import default_model_path

_CACHE: dict[tuple, Any] = {}  # (path, size, mtime) -> GGUFFile / Tokenizer, for repeated in-process calls


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("tokenize", help="token ids of a text with the model's tokenizer",
                              description="Encode a text with the GGUF's tokenizer (a vocab-only GGUF is enough).")
    add_model_argument(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to encode")
    src.add_argument("--file", type=Path, metavar="F", help="encode the contents of this UTF-8 file")
    p.add_argument("--special", action="store_true",
                   help="parse special-token text (<|im_start|> ...) as control tokens (off by default)")
    p.add_argument("--json", action="store_true", help="print one JSON document with ids and token strings")
    p.set_defaults(func=run)


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, metavar="PATH",
                   help="the .gguf file (default: the bundled demo model in resources/, once it exists)")


def model_path(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    return default_model_path()


def _key(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return (str(path),)
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def load_gguf(path: Path):
    from engine.gguf import open_gguf

    key = ("gguf",) + _key(path)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = open_gguf(path)
    return _CACHE[key]


def load_tokenizer(path: Path):
    from engine.text import Tokenizer

    key = ("tok",) + _key(path)
    if key not in _CACHE:
        _CACHE[key] = Tokenizer.from_gguf(load_gguf(path))
    return _CACHE[key]


def read_text_file(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{what}: {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what}: {path}: not UTF-8 (byte {exc.start})") from None


def run(args: argparse.Namespace) -> int:
    text = args.text if args.text is not None else read_text_file(args.file, "--file")
    tok = load_tokenizer(model_path(args.model))
    ids = tok.encode(text, special=args.special)
    if args.json:
        doc = {"ids": ids, "tokens": [tok.piece(i) for i in ids], "n_tokens": len(ids), "special": args.special}
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(" ".join(map(str, ids)) + "\n")
    return 0
