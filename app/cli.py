"""`mtpchat <verb>`: the command-line entry point (STYLE.md §7).

Names and flags are a contract that outside tools call. A user error exits 2 with exactly one line
`error: <what>: <why>` on stderr; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from engine.errors import MtpchatError

# Each verb lives in app/commands/<name>.py with a `register(subparsers)` function.
COMMANDS = ("chat", "inspect", "tokenize", "template", "logits", "generate", "bench", "serve", "imatrix")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as every other user error
        sys.stderr.write(f"error: {self.prog}: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mtpchat", description="Chat with local Qwen3.5/3.6 GGUF models; watch MTP speculation.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"app.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"app.commands.{name}":
                continue  # verb not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.resources import use_compile_cache

    use_compile_cache()      # compiled steps survive a reboot (inductor's default is the temp folder)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return _start_gui(args)
    try:
        return int(args.func(args) or 0)
    except MtpchatError as exc:
        if args.debug:
            raise
        msg = " ".join(str(exc).split("\n"))
        sys.stderr.write(f"error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        return 130


def _start_gui(args: argparse.Namespace) -> int:
    try:
        ui_main = importlib.import_module("ui.main")
    except ModuleNotFoundError:
        sys.stderr.write(
            "mtpchat: the desktop app is not built yet. Available now: "
            + ", ".join(f"mtpchat {c}" for c in COMMANDS if _has(c))
            + " (see mtpchat --help)\n"
        )
        if not sys.stdin.isatty():
            return 0
        sys.stderr.write("mtpchat: starting the terminal chat (mtpchat chat) instead\n")
        return main(["chat"])
    return int(ui_main.main(args) or 0)


def _has(name: str) -> bool:
    return importlib.util.find_spec(f"app.commands.{name}") is not None


if __name__ == "__main__":
    raise SystemExit(main())
