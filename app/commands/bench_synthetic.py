"""`mtpchat bench --synthetic SHAPE:TYPE`: engine speed on a random-weight model of a real shape.

The flags live on the `bench` verb (app/commands/bench.py calls `add_args` and `run`); this module
builds the model (engine/bench/synthetic.py), measures it (engine/bench/speed.py) and prints a
table or one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.errors import InputError


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine speed on a random-weight model (--synthetic)")
    g.add_argument("--synthetic", metavar="SHAPE:TYPE",
                   help="e.g. qwen35-0.8b:Q8_0; shapes: tiny, qwen35-0.8b, qwen35-2b, qwen35-4b, qwen35-9b, "
                        "qwen36-27b, qwen35moe-35b-a3b ...; types: F32, F16, BF16, Q8_0, Q4_K_M")
    g.add_argument("--write-gguf", type=Path, metavar="PATH",
                   help="write the synthetic model as a GGUF file (for an outside engine) and exit")
    g.add_argument("--prompt-tokens", type=int, default=128, help="prefill length (default 128)")
    g.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps (default 32)")
    g.add_argument("--bench-repeats", type=int, default=5, help="repeats of the other timings (default 5)")
    g.add_argument("--verify-k", default="1,2,3,4", help="draft counts k whose k+1-row verification is timed")
    g.add_argument("--path", choices=("packed", "reference"), default="packed",
                   help="packed: compact weights + fused kernels (default); reference: dense float32")
    g.add_argument("--profile", action="store_true", help="add a torch.profiler table of one decode step")
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")


def default_threads() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.bench import speed, synthetic
    from engine.model.model import load_model
    from engine.model.steps import min_packed

    spec = args.synthetic
    shape, typ = synthetic.parse_spec(spec)
    threads = args.threads or default_threads()
    if threads < 1:
        raise InputError(f"--threads: must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    for name in ("prompt_tokens", "decode_tokens", "bench_repeats"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.write_gguf:
        f = synthetic.build_synthetic(f"{shape}:{typ}", seed=args.seed)
        vocab = _vocab_gguf()
        size = synthetic.write_gguf(f, args.write_gguf, vocab)
        doc = {"written": str(args.write_gguf), "bytes": size, "shape": shape, "type": typ}
        sys.stdout.write((json.dumps(doc) if args.json else f"wrote {args.write_gguf} ({size:,} bytes)") + "\n")
        return 0
    synthetic.check_fits(shape, typ)
    if args.device == "cuda":       # the GPU measurement alone (without --device cuda it follows the CPU one)
        if not torch.cuda.is_available():
            raise InputError("--device: cuda is not available on this machine")
        settings = speed.SpeedSettings(prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                                       repeats=args.bench_repeats)
        row = speed.gpu_row(synthetic.build_synthetic(f"{shape}:{typ}", seed=args.seed), settings,
                            steps=args.steps)
        doc = {"model": f"synthetic {shape}:{typ}", "shape": shape, "type": typ, "gpu": row}
        sys.stdout.write((json.dumps(doc) if args.json else json.dumps(doc, indent=1)) + "\n")
        return 0
    bandwidth = speed.measure_read_bandwidth()  # first: its buffer is freed before the model exists
    f = synthetic.build_synthetic(f"{shape}:{typ}", seed=args.seed)
    model = load_model(f, packed=args.path == "packed", min_packed=min_packed(args.steps, "cpu"))
    # whole steps compiled as the app runs them (`--steps auto`: when a C++ compiler is there), on first
    # use in the warm-up: a 24-block model's kinds of step take minutes the first time, seconds from
    # inductor's on-disk cache after that (`warmup_s` in the output)
    steps = model.compile_steps(args.steps, background=False)
    try:
        verify_k = tuple(int(k) for k in args.verify_k.split(",") if k.strip())
    except ValueError:
        raise InputError(f"--verify-k: expected comma-separated integers, got {args.verify_k!r}") from None
    if not verify_k or any(not 1 <= k <= 7 for k in verify_k):
        raise InputError(f"--verify-k: each k must be in 1..7, got {args.verify_k!r}")
    settings = speed.SpeedSettings(prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                                   repeats=args.bench_repeats, verify_k=verify_k)
    doc = {"model": f"synthetic {shape}:{typ}", "shape": shape, "type": typ,
           "file_bytes": synthetic.file_bytes(shape, typ), "path": args.path,
           "steps": dict(zip(("path", "why"), steps, strict=True)),
           **speed.run_speed(model, settings, profile=args.profile, bandwidth=bandwidth)}
    del model
    doc["gpu"] = speed.gpu_row(f, settings, steps=args.steps)
    doc["rss_over_file"] = round(doc["peak_rss_bytes"] / doc["file_bytes"], 3)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        _table(doc)
    return 0


def _vocab_gguf() -> Path | None:
    """The real Qwen3.5 vocabulary from the shared fixtures, when present (else byte tokens)."""
    root = Path(os.environ.get("MTPCHAT_FIXTURES", Path(__file__).resolve().parents[3] / "shared" / "fixtures"))
    p = root / "tokenizer" / "qwen35-vocab.gguf"
    return p if p.is_file() else None


def _table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cp = doc["compute_path"]
    t = Table(title=f"{doc['model']} ({doc['file_bytes']:,} bytes), {doc['threads']} threads, "
                    f"path {doc['path']}: kernels {cp['kernels']} ({cp['why']})")
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [
        ("decode tok/s", f"{doc['decode_tok_s']:.2f} ({doc['decode_step_ms']:.2f} ms/step)"),
        ("prefill tok/s", f"{doc['prefill_tok_s']:.1f} ({doc['prefill_tokens']} tokens)"),
        ("bytes read per decode step", f"{doc['bytes_per_decode_step']:,}"),
        ("read bandwidth (this run)", f"{doc['read_bandwidth_gbs']:.1f} GB/s"),
        ("bandwidth bound", f"{doc['bound_tok_s']:.1f} tok/s; decode at {doc['bound_pct']:.0f} %"),
        ("verify k+1 rows / 1 row", "  ".join(f"k={k}: {v:.2f}x" for k, v in doc["verify_cost"].items())),
        ("MTP draft / decode step", "-" if doc["mtp_draft_cost"] is None else f"{doc['mtp_draft_cost']:.2f}x"),
        ("rollback", f"{doc['rollback_ms']:.3f} ms ({doc['rollback_cost']:.3f}x a step)"),
        ("host (Python) time per step", f"{doc['host_ms_per_step']:.2f} ms"),
        ("peak RSS", f"{doc['peak_rss_bytes']:,} bytes ({doc['rss_over_file']:.2f}x the file)"),
        ("weights", ", ".join(f"{k}: {v}" for k, v in cp["weights"].items())),
        ("decode steps", f"{doc['steps']['path']} ({doc['steps']['why']}); warm-up {doc['warmup_s']:.0f} s"),
        ("GPU", doc["gpu"].get("reason") or (
            f"{doc['gpu']['device']}: bf16 decode {doc['gpu']['decode_tok_s']:.1f} tok/s "
            f"({doc['gpu']['bound_pct']:.0f} % of {doc['gpu']['read_bandwidth_gbs']:.0f} GB/s), "
            f"prefill {doc['gpu']['prefill_tok_s']:.0f} tok/s" if "decode_tok_s" in doc["gpu"] else doc["gpu"]["device"])),
        ("load average before/after", f"{doc['load_average_before'][0]:.2f} / {doc['load_average_after'][0]:.2f}"),
    ]
    for r in rows:
        t.add_row(*r)
    Console(width=160).print(t)
    if doc.get("profile"):
        print(doc["profile"])
