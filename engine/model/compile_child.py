"""A process that compiles kinds of call for another one (`engine.model.steps.CompiledSteps`).

Compiling a kind from an empty inductor cache takes 10-60 s of Python (dynamo, inductor's lowering and
code generation) and leaves its transient peaks in the process's heap; loading the same kind from the
cache takes 1-5 s and keeps ~3 MiB. So a server's compile worker asks this child to compile each kind
first, on the same model loaded the same way (`Qwen35Model.recipe`), and then traces the kind itself,
which now loads it from the cache that both share. The child holds no GIL of the server's: the decoding
thread runs at its own speed meanwhile.

Run as `python -m engine.model.compile_child READ_FD WRITE_FD`; jobs arrive as pickled dicts on READ_FD
(`CompiledSteps._child_job`), one answer per job goes back on WRITE_FD; the child ends when READ_FD
closes. Never prints: stdout is the parent's too.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from multiprocessing.connection import Connection


def _fake_args(model, job: dict) -> tuple:
    """The arguments `CompiledSteps._warm` reads, shaped like the parent's call: the cache's layout, the
    slot and start, the inference flags, the hidden rows' dtype and the plain trailing arguments."""
    import torch

    from engine.model.cache import ModelCache

    n_slots, kv_dtype, has_mtp, cache_inference = job["cache"]
    with torch.inference_mode(cache_inference):
        cache = ModelCache(model.cfg, n_slots, 8, device=model.device, kv_dtype=kv_dtype, mtp=has_mtp)
    with torch.inference_mode(job["tokens_inference"]):
        tokens = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    if job["key"][0] == "main":
        return (tokens, cache, None, None, None, job["single"], *job["rest"])
    dtype, inference = job["hidden"]
    with torch.inference_mode(inference):
        hidden = torch.zeros(1, 1, model.cfg.n_embd, dtype=dtype, device=model.device)
    return (tokens, hidden, cache, None, None, None, job["single"], *job["rest"])


def serve(inp: Connection, out: Connection) -> None:
    import torch

    from engine.model.model import load_model
    from engine.model.steps import CompiledSteps

    model = steps = loaded = applied = None
    while True:
        try:
            job = inp.recv()
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            recipe = job["recipe"]
            if recipe != loaded:
                model = load_model(recipe["path"], device=recipe["device"], dtype=recipe["dtype"],
                                   packed=recipe["packed"], min_packed=recipe["min_packed"])
                loaded, applied, steps = recipe, None, None
            if job["draft"] != applied:
                vocab, weights, wrong = job["draft"]
                model.set_draft_vocab(vocab)
                model.set_draft_weights(weights)
                model.set_wrong_drafts(wrong)
                applied, steps = job["draft"], None    # the steps mark the draft copies' weights static
            if torch.get_num_threads() != job["threads"]:
                torch.set_num_threads(job["threads"])
            if steps is None:
                steps = CompiledSteps(model, "compile child", background=False)
            with torch.inference_mode():
                steps._warm(job["key"], job["shape"], _fake_args(model, job), job["fixed_rows"])
            out.send({"ok": True, "seconds": time.perf_counter() - t0})
        except Exception as exc:   # the parent compiles the kind itself, and logs why
            out.send({"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})


def main(argv: list[str]) -> int:
    # a Ctrl-C in the terminal reaches the whole process group: the parent ends this child itself (or its
    # pipe closes), so a compile is never cut short into an error the parent would report
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="compile child: %(levelname)s %(message)s")
    inp = Connection(int(argv[0]), writable=False)
    out = Connection(int(argv[1]), readable=False)
    try:
        serve(inp, out)
    except BrokenPipeError:   # the parent has gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
