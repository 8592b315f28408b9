"""`mtpchat chat`: a terminal chat on a local model, streaming reasoning and answer, with MTP stats.

What `mtpchat` (and `make run`) starts while the desktop app is not built. It drives the same slot
scheduler as the server and the app, with one slot, so prompt reuse across turns and MTP work as there.
"""

from __future__ import annotations

import argparse
import os
import sys

from app.commands.logits import (
    STEPS_HELP,
    WEIGHTS,
    WEIGHTS_HELP,
    add_draft_args,
    apply_draft_options,
    describe_draft_weights,
    load_model_as,
)
from engine.errors import InputError
from engine.spec.modes import STEP_MODES

MTP_MODES = ("off", "on", "adaptive", "auto")
HELP = "commands: /reset (new conversation), /stats (last reply's speculation), /quit"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a local model (the bundled demo model by default)",
                       description="Chat in the terminal. " + HELP)
    p.add_argument("--model", help="GGUF model file (default: the bundled demo model)")
    p.add_argument("--mtp", choices=MTP_MODES, default="auto", help="speculative decoding mode (default auto)")
    p.add_argument("--draft", type=int, default=3, help="draft tokens per round, 1..8 (default 3)")
    add_draft_args(p)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--system", help="system message")
    p.add_argument("--no-think", action="store_true", help="render the prompt with enable_thinking=false")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: the cores this process may use)")
    p.add_argument("--steps", choices=STEP_MODES, default="auto", help=f"{STEPS_HELP} (default auto)")
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help=f"{WEIGHTS_HELP} (default auto)")
    p.set_defaults(func=run)


class TerminalChat:
    """One conversation on a one-slot scheduler; `reply(text, out)` streams the assistant turn to `out`."""

    def __init__(self, model_path: str, *, mtp: str, draft: int, max_tokens: int, temperature: float,
                 system: str | None, think: bool, steps: str = "eager", weights: str = "auto",
                 draft_vocab: str | int | None = None, draft_weights: str | None = None):
        from engine.bench.speed import describe_weights, weight_inventory
        from engine.gguf import open_gguf
        from engine.scheduler.model_backend import ModelBackend
        from engine.scheduler.scheduler import Scheduler
        from engine.scheduler.text import text_factory
        from engine.text.template import ChatTemplate
        from engine.text.tokenizer import Tokenizer
        from engine.threads import in_passing_thread

        f = open_gguf(model_path)
        self.tokenizer = Tokenizer.from_gguf(f)
        self.template = ChatTemplate.from_tokenizer_metadata(f.metadata, self.tokenizer)

        def build():
            # in a thread that ends before decoding starts (engine.threads): the scheduler's thread decodes
            model = load_model_as(f, weights, steps)
            apply_draft_options(model, draft_vocab, draft_weights, steps)
            status = model.compile_steps(steps, background=steps == "auto")
            n_ctx = min(4096, model.cfg.context_length)
            return model, status, n_ctx, ModelBackend(model, self.tokenizer.special.eog, 1, n_ctx)

        model, self.steps_status, n_ctx, backend = in_passing_thread(build)
        self.matrices = describe_weights(weight_inventory(model))   # e.g. "27 packed Q8_0, 4 dense float32"
        self.drafts = describe_draft_weights(model)                 # e.g. "int8_dots (AVX-512 VNNI)"
        self.scheduler = Scheduler(backend, text_factory(self.tokenizer.token_bytes), default_mtp=mtp,
                                   default_draft=draft)
        self.n_ctx = n_ctx
        self.max_tokens, self.temperature, self.think = max_tokens, temperature, think
        self.system = system
        self.messages: list[dict] = []
        self.last_stats: dict = {}
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def close(self) -> None:
        self.scheduler.close()

    def reply(self, text: str, out) -> str:
        from engine.scheduler.types import Finished, GenerationRequest, TextDelta
        from engine.text.output import OutputParser

        self.messages.append({"role": "user", "content": text})
        rendered = self.template.render(self.messages, None, add_generation_prompt=True,
                                        template_kwargs={"enable_thinking": self.think})
        ids = self.tokenizer.encode_chat(rendered.pieces)
        if len(ids) + 16 > self.n_ctx:
            self.messages.pop()
            raise InputError(f"conversation: {len(ids)} prompt tokens leave no room in the {self.n_ctx}-token "
                             "context; /reset to start over")
        parser = OutputParser(None, thinking_open=rendered.text.rstrip().endswith("<think>"))
        handle = self.scheduler.submit(GenerationRequest(prompt=tuple(ids), max_tokens=self.max_tokens,
                                                         temperature=self.temperature))
        content: list[str] = []
        reasoning: list[str] = []
        in_reasoning = False
        finished = None

        def show(deltas):
            nonlocal in_reasoning
            for d in deltas:
                if d.get("reasoning_content"):
                    if not in_reasoning:
                        out.write("\x1b[2m")  # dim: reasoning
                        in_reasoning = True
                    out.write(d["reasoning_content"])
                    reasoning.append(d["reasoning_content"])
                if d.get("content"):
                    if in_reasoning:
                        out.write("\x1b[0m\n")
                        in_reasoning = False
                    out.write(d["content"])
                    content.append(d["content"])
            out.flush()

        try:
            for ev in handle:
                if isinstance(ev, TextDelta):
                    show(parser.feed(ev.text))
                elif isinstance(ev, Finished):
                    finished = ev
        except KeyboardInterrupt:
            handle.cancel()
            out.write("\x1b[0m\n[stopped]")
        show(parser.finish())
        if in_reasoning:
            out.write("\x1b[0m")
        out.write("\n")
        answer = "".join(content)
        msg = {"role": "assistant", "content": answer}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        self.messages.append(msg)
        if finished is not None:
            t = finished.timings
            tps = t.predicted_n / (t.predicted_ms / 1000) if t.predicted_ms > 0 else 0.0
            rate = t.draft_n_accepted / t.draft_n if t.draft_n else 0.0
            self.last_stats = {"tokens": t.predicted_n, "tokens_per_s": tps, "drafted": t.draft_n,
                               "accepted": t.draft_n_accepted, "accept_rate": rate,
                               "by_position": list(t.draft_by_depth), "finish": finished.finish_reason}
            if finished.error:
                raise InputError(f"generation: {finished.error}")
        return answer

    def stats_line(self) -> str:
        s = self.last_stats
        if not s:
            return "no reply yet"
        line = f"{s['tokens']} tokens, {s['tokens_per_s']:.1f} tok/s"
        if s["drafted"]:
            per = " ".join(f"{a}/{n}" for n, a in s["by_position"])
            line += f", MTP accepted {s['accepted']}/{s['drafted']} ({s['accept_rate']:.0%}; by position {per})"
        else:
            line += ", no drafts"
        return line


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.resources import default_model_path

    if args.max_tokens < 1:
        raise InputError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    if not 1 <= args.draft <= 8:
        raise InputError(f"--draft: {args.draft} not in 1..8")
    if args.threads < 0:
        raise InputError(f"--threads: must be >= 0, got {args.threads}")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    path = args.model or str(default_model_path())
    sys.stderr.write(f"mtpchat: loading {path} …\n")
    chat = TerminalChat(path, mtp=args.mtp, draft=args.draft, max_tokens=args.max_tokens,
                        temperature=args.temperature, system=args.system, think=not args.no_think,
                        steps=args.steps, weights=args.weights, draft_vocab=args.draft_vocab,
                        draft_weights=args.draft_weights)
    path_, why = chat.steps_status
    sys.stderr.write(f"mtpchat: ready (MTP {args.mtp}; steps {path_}: {why}; matrices: {chat.matrices}; "
                     f"draft weights: {chat.drafts}). {HELP}\n")
    try:
        while True:
            try:
                line = input("\n> ")
            except EOFError:
                break
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            if line == "/reset":
                chat.reset()
                print("[new conversation]")
                continue
            if line == "/stats":
                print(chat.stats_line())
                continue
            try:
                chat.reply(line, sys.stdout)
            except InputError as exc:
                sys.stderr.write(f"error: {exc}\n")
                continue
            sys.stderr.write(f"\x1b[2m[{chat.stats_line()}]\x1b[0m\n")
    except KeyboardInterrupt:
        pass
    finally:
        chat.close()
    return 0
