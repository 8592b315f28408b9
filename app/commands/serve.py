"""`mtpchat serve`: the OpenAI-compatible local server over N slots (spec/mtp-speculation.md §6, §7).

Loopback-only by default; a network bind needs --api-key or an explicit --allow-no-auth
(reliability-matrix E1). Exits 2 with one line for any bad argument or model file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

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
from engine.resources import default_model_path
from engine.spec.modes import STEP_MODES

MTP_MODES = ("off", "on", "adaptive", "auto")
# how long a start with compiled steps waits for the decode step's kind (`ModelBackend.compile_ahead`); past
# it the server listens and the kind goes on compiling in the background
COMPILE_AHEAD_S = 60.0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with parallel slots and slot pinning",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
                    "/v1/completions, /v1/models, /slots, /metrics, /health. Pin a request to slot N with "
                    "`id_slot` or the model name <alias>-slot<N> / <alias>-s<N>.")
    p.add_argument("--model", type=Path, help="GGUF model file (default: the bundled demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port; 0 picks a free one (default 8080)")
    p.add_argument("--parallel", type=int, default=2, metavar="N", help="number of slots (default 2)")
    p.add_argument("--alias", help="model name served in /v1/models (default: the file name without .gguf)")
    p.add_argument("--api-key", default=os.environ.get("MTPCHAT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but GET /health "
                        "(default: $MTPCHAT_API_KEY, else no key)")
    p.add_argument("--allow-no-auth", action="store_true",
                   help="allow a non-loopback --host without --api-key (the network can then use the model)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="accept this Host header name besides localhost/127.0.0.1/[::1] (DNS-rebinding "
                        "check); repeatable")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow cross-origin requests from exactly this origin, e.g. http://localhost:3000; "
                        "repeatable (default: none)")
    p.add_argument("--ctx", type=int, default=0, metavar="N",
                   help="total context in tokens, split evenly between slots (default 4096 per slot, "
                        "capped by the model's context length)")
    p.add_argument("--ctx-checkpoints", type=int, default=8, metavar="N",
                   help="Gated DeltaNet state checkpoints kept per slot for prompt-prefix reuse (default 8)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens per slot per engine iteration (default 256)")
    p.add_argument("--mtp", choices=MTP_MODES, default="auto",
                   help="MTP speculative decoding: off, on (fixed --draft), adaptive (the seed's gate) or "
                        "auto (pick k per round; default)")
    p.add_argument("--draft", type=int, default=3, metavar="K", help="draft tokens per round, 1..16 (default 3)")
    add_draft_args(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--steps", choices=STEP_MODES, default="auto", help=f"{STEPS_HELP} (default auto)")
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help=f"{WEIGHTS_HELP} (default auto)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: the cores this process may use)")
    p.add_argument("--queue-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a request may wait for a slot before a 503 (default 600)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a client has to send a request line and headers (default 10)")
    p.add_argument("--no-slots", action="store_true", help="disable the /slots endpoint")
    p.set_defaults(func=run)




def run(args: argparse.Namespace) -> int:
    from app.server.app import build_app
    from app.server.run import check_bind, serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_bind(args.host, args.api_key, args.allow_no_auth)
    state = build_state(args)
    try:
        serve(build_app(state), args.host, args.port, auth=bool(args.api_key), header_timeout_s=args.header_timeout)
    finally:
        state.scheduler.close()
    return 0


def build_state(args: argparse.Namespace):
    """Load the model and start the scheduler thread: everything but the HTTP listener."""
    import torch

    from app.server.app import ServerConfig, ServerState
    from app.server.chat import ChatText
    from engine.bench.speed import describe_weights, weight_inventory
    from engine.gguf import open_gguf
    from engine.scheduler.model_backend import ModelBackend
    from engine.scheduler.scheduler import Scheduler
    from engine.scheduler.text import text_factory
    from engine.text.template import ChatTemplate
    from engine.text.tokenizer import Tokenizer
    from engine.threads import in_passing_thread

    if not 1 <= args.parallel <= 64:
        raise InputError(f"--parallel: {args.parallel} not in 1..64")
    if not 1 <= args.draft <= 16:
        raise InputError(f"--draft: {args.draft} not in 1..16")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port: {args.port} not in 0..65535")
    if args.ctx_checkpoints < 0 or args.prefill_chunk < 1 or args.ctx < 0:
        raise InputError("--ctx, --ctx-checkpoints, --prefill-chunk: must not be negative")
    if args.threads < 0:
        raise InputError(f"--threads: must be >= 0, got {args.threads}")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    path = args.model or default_model_path()
    f = open_gguf(path)
    tokenizer = Tokenizer.from_gguf(f)
    template = ChatTemplate.from_tokenizer_metadata(f.metadata, tokenizer)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype) or (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)

    def build():
        # in a thread that ends before decoding starts (engine.threads): the scheduler's thread decodes
        model = load_model_as(f, args.weights, args.steps, args.device, dtype)
        apply_draft_options(model, args.draft_vocab, args.draft_weights, args.steps)
        steps = model.compile_steps(args.steps, background=args.steps == "auto")
        n_ctx_slot = args.ctx // args.parallel if args.ctx else min(4096, model.cfg.context_length)
        if n_ctx_slot < 16:
            raise InputError(f"--ctx: {args.ctx} leaves {n_ctx_slot} tokens per slot; need at least 16")
        backend = ModelBackend(model, tokenizer.special.eog, args.parallel, n_ctx_slot,
                               prefill_chunk=args.prefill_chunk, ctx_checkpoints=args.ctx_checkpoints)
        if steps[0] == "compiled":
            t0 = time.monotonic()
            print("mtpchat serve: compiling the decode step (once: later starts load it from the cache)",
                  file=sys.stderr, flush=True)
            done = backend.compile_ahead(COMPILE_AHEAD_S)
            logging.getLogger("mtpchat.serve").info("decode step %s in %.1f s", "compiled" if done else
                                                    "still compiling (in the background)", time.monotonic() - t0)
        return model, steps, n_ctx_slot, backend

    model, (steps_path, steps_why), n_ctx_slot, backend = in_passing_thread(build)
    logging.getLogger("mtpchat.serve").info("decode steps: %s (%s); matrices: %s; draft weights: %s", steps_path,
                                            steps_why, describe_weights(weight_inventory(model)),
                                            describe_draft_weights(model))
    cfg = model.cfg
    scheduler = Scheduler(backend, text_factory(tokenizer.token_bytes), default_mtp=args.mtp,
                          default_draft=args.draft, queue_timeout_s=args.queue_timeout)
    alias = args.alias or Path(path).name.removesuffix(".gguf")
    meta = {"arch": cfg.arch, "n_vocab": cfg.n_vocab, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_ctx_train": cfg.context_length, "has_mtp": cfg.has_mtp, "n_parallel": args.parallel,
            "steps": steps_path}
    scfg = ServerConfig(alias=alias, model_path=str(path), n_parallel=args.parallel, n_ctx_slot=n_ctx_slot,
                        n_vocab=tokenizer.n_vocab, model_meta=meta, api_key=args.api_key or None,
                        allowed_hosts=tuple(args.allowed_host), cors_origins=tuple(args.cors_origin),
                        slots_endpoint=not args.no_slots)
    return ServerState(scfg, scheduler, ChatText(tokenizer, template))
