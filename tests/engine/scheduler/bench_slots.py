"""Aggregate decode tokens/s of the slot scheduler with 1, 2, 4 active slots, MTP off / on / adaptive / auto.

Run: .venv/bin/python -m tests.engine.scheduler.bench_slots [--model PATH] [--tokens 128] [--reps 3]
Configurations are interleaved (A B C A B C ...) to cancel machine drift; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import torch

from engine.gguf import open_gguf
from engine.model.model import load_model
from engine.scheduler.model_backend import ModelBackend
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.text import text_factory
from engine.scheduler.types import Finished, GenerationRequest, TextDelta
from engine.text.tokenizer import Tokenizer


def run_once(sched: Scheduler, prompts, n_tokens: int, mode: str, draft: int) -> dict:
    logs: list[list[tuple[float, object]]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            logs[i].append((time.perf_counter(), ev))   # stamped on the engine thread, when it happens
            if isinstance(ev, Finished):
                done.release()
        return sink

    for i, p in enumerate(prompts):
        sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=n_tokens, ignore_eos=True, mtp=mode,
                                       n_draft=draft, slot=i), sink=sink_for(i))
    for _ in prompts:
        done.acquire()
    first = [min(t for t, ev in log if isinstance(ev, TextDelta)) for log in logs]
    fins = [(t, ev) for log in logs for t, ev in log if isinstance(ev, Finished)]
    # tokens decoded while every slot was decoding: from the latest first token to the earliest end
    t0, t1 = max(first), min(t for t, _ in fins)
    tokens = sum(len(ev.token_ids) for log in logs for t, ev in log if isinstance(ev, TextDelta) and t0 < t <= t1)
    drafted = sum(ev.timings.draft_n for _, ev in fins)
    accepted = sum(ev.timings.draft_n_accepted for _, ev in fins)
    return {"tps": tokens / (t1 - t0) if t1 > t0 else 0.0, "accept": accepted / drafted if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/shared/fixtures/models/tiny-qwen35-f32.gguf")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-batch", action="store_true", help="one forward per slot (alternating) instead of batched")
    ap.add_argument("--compare-batching", action="store_true",
                    help="run every configuration batched and alternating, interleaved")
    ap.add_argument("--compare-padding", action="store_true",
                    help="run every configuration with plain steps padded into the verification pass and "
                         "with one forward per kind of work, interleaved")
    ap.add_argument("--modes", default="off,on,adaptive,auto")
    ap.add_argument("--slots", default="1,2,4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    f = open_gguf(args.model)
    tok = Tokenizer.from_gguf(f)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(f, device=args.device, dtype=dtype)
    rng = random.Random(0)
    text = open("/work/shared/fixtures/text/fixture-text.txt", encoding="utf-8").read()
    prompts = []
    for _ in range(4):
        start = rng.randrange(len(text) - 400)
        prompts.append(tok.encode(text[start:start + 200])[:48])
    modes = tuple(args.modes.split(","))
    slot_counts = tuple(int(x) for x in args.slots.split(","))
    results: dict[tuple[int, str], list[dict]] = {}
    backend = ModelBackend(model, tok.special.eog, 4, 1024, batch_slots=not args.no_batch)
    sched = Scheduler(backend, text_factory(tok.token_bytes))
    try:
        run_once(sched, prompts[:1], 16, "on", args.draft)  # warm-up
        variants = [("", not args.no_batch, True)]
        if args.compare_batching:
            variants = [("batched", True, True), ("alternating", False, True)]
        elif args.compare_padding:
            variants = [("padded", True, True), ("grouped", True, False)]
        for _ in range(args.reps):
            for n in slot_counts:
                for mode in modes:
                    for vname, batched, padded in variants:
                        backend.batch_slots, backend.pad_mixed = batched, padded
                        for s in range(4):
                            backend.abort(s)   # no prefix reuse between runs
                        key = (n, f"{mode}/{vname}" if vname else mode)
                        results.setdefault(key, []).append(run_once(sched, prompts[:n], args.tokens, mode,
                                                                    args.draft))
    finally:
        sched.close()
    table = []
    for n in slot_counts:
        keys = [k for (m, k) in results if m == n]
        base = statistics.median(r["tps"] for r in results[(n, keys[0])])
        for mode in keys:
            rs = results[(n, mode)]
            tps = statistics.median(r["tps"] for r in rs)
            acc = [r["accept"] for r in rs if r["accept"] is not None]
            best = max(r["tps"] for r in rs)
            best_base = max(r["tps"] for r in results[(n, keys[0])])
            table.append({"slots": n, "mtp": mode, "decode_tps": round(tps, 1), "ratio_vs_first": round(tps / base, 3),
                          "best_tps": round(best, 1), "best_ratio": round(best / best_base, 3),
                          "accept_rate": round(statistics.median(acc), 3) if acc else None})
    print(json.dumps({"model": args.model, "tokens": args.tokens, "draft": args.draft, "threads": args.threads,
                      "device": args.device, "batched": not args.no_batch, "results": table}, indent=1))


if __name__ == "__main__":
    main()
