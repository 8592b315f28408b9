"""`mtpchat template [--model PATH] --messages FILE.json [--tools FILE.json] [--no-generation-prompt]
[--enable-thinking true|false]`: the chat prompt exactly as the model's template renders it.

Prints the rendered text and nothing else (no newline added). Bad JSON, template failures and limits hit
exit 2 with one line. Works on a vocab-only GGUF.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app.commands.tokenize import add_model_argument, load_gguf, model_path, read_text_file
from engine.errors import InputError


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("template", help="render the chat template for a conversation",
                              description="Render the GGUF's chat template (sandboxed, as HF apply_chat_template "
                                          "does) and print the prompt exactly, without a trailing newline.")
    add_model_argument(p)
    p.add_argument("--messages", type=Path, required=True, metavar="FILE.json",
                   help="a JSON list of messages (or an object with a 'messages' list)")
    p.add_argument("--tools", type=Path, metavar="FILE.json", help="a JSON list of OpenAI-style tools")
    p.add_argument("--no-generation-prompt", action="store_true", help="do not open the assistant turn")
    p.add_argument("--enable-thinking", type=_bool, metavar="true|false",
                   help="false closes the reasoning block in the generation prompt")
    p.add_argument("--preserve-thinking", type=_bool, metavar="true|false",
                   help="Qwen3.6 templates: keep the reasoning of every assistant turn")
    p.set_defaults(func=run)


def _load_json(path: Path, what: str) -> Any:
    text = read_text_file(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what}: {path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None


def run(args: argparse.Namespace) -> int:
    from engine.text import ChatTemplate

    messages = _load_json(args.messages, "--messages")
    tools = None
    if isinstance(messages, dict) and "messages" in messages:
        tools = messages.get("tools")
        messages = messages["messages"]
    if args.tools is not None:
        tools = _load_json(args.tools, "--tools")
    kwargs = {}
    if args.enable_thinking is not None:
        kwargs["enable_thinking"] = args.enable_thinking
    if args.preserve_thinking is not None:
        kwargs["preserve_thinking"] = args.preserve_thinking
    gguf = load_gguf(model_path(args.model))
    template = ChatTemplate.from_tokenizer_metadata(gguf.metadata)
    rendered = template.render(messages, tools, add_generation_prompt=not args.no_generation_prompt,
                               template_kwargs=kwargs)
    sys.stdout.buffer.write(rendered.text.encode("utf-8"))
    sys.stdout.flush()
    return 0
