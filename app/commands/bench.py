"""`mtpchat bench [--model PATH] [--prompts FILE] [--max-tokens N] [--mtp off,on,adaptive,auto]
[--draft 1,2,3,4] [--repeats R] [--wrong-drafts] [--temperature T --top-k K --top-p P] [--json]`: decode speed
of MTP configurations.

All configurations run in one process on the same prompts, interleaved, and are reported side by side:
decode tokens/s (median), ratio to off (of the medians, and the median of each run's ratio to off's run of
the same prompt in the same repeat, with a 95 % interval), acceptance per draft position, mean accepted
length, the measured cost of a plain step, a verification and a draft step, memory. --json prints one
document.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.commands import bench_synthetic
from app.commands.logits import add_draft_args, add_model_args, load_from_args
from engine.errors import InputError
from engine.spec.modes import HIDDEN_MODES, MTP_MODES

# Used when --prompts is not given: prose, code, a list, repetition (encoded with the model's tokenizer).
DEFAULT_PROMPTS = (
    "The class statement defines a new class object and binds it to a name in the local namespace.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Shopping list:\n1. apples\n2. bread\n3.",
    "for x in range(10): for x in range(10): for x in range(10):",
    "Exceptions are raised by the raise statement and handled by the try statement, which",
    "An object's identity never changes once it has been created; you may think of it as",
)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="compare decode speed with MTP off/on/adaptive/auto",
                              description="Run every MTP configuration on the same prompts in one process, "
                                          "interleaved, and report decode tokens/s side by side.")
    add_model_args(p, steps="auto")
    p.add_argument("--prompts", type=Path, help="prompts file: one prompt per line, or JSON lines with "
                                                "'prompt' (text) or 'tokens' (ids)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens per run (default 128)")
    p.add_argument("--mtp", default="off,on,adaptive,auto", help="comma-separated modes (default all four)")
    p.add_argument("--draft", default="1,2,3,4", help="comma-separated k values (default 1,2,3,4)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (default 1)")
    p.add_argument("--wrong-drafts", action="store_true",
                   help="replace every draft by a wrong token: measures the pure overhead of speculation")
    p.add_argument("--mtp-hidden", choices=HIDDEN_MODES, default="post-norm", help="hidden state fed to MTP")
    add_draft_args(p)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time with the wall clock (default) or this thread's CPU time (use with --threads 1 "
                        "on a shared machine; the MTP policies then decide on CPU time too)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop runs at end-of-generation tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (default 0: greedy); every configuration's run of a prompt "
                        "draws from one seed, so all of them emit the same text and compare like for like")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling (1 = off)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    bench_synthetic.add_args(p)
    p.set_defaults(func=run)


def _csv(text: str, what: str, cast, allowed=None) -> list:
    try:
        vals = [cast(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise InputError(f"{what}: expected a comma-separated list, got {text!r}") from None
    if not vals:
        raise InputError(f"{what}: empty list")
    for v in vals:
        if allowed is not None and v not in allowed:
            raise InputError(f"{what}: {v!r} is not one of {', '.join(map(str, allowed))}")
    return list(dict.fromkeys(vals))


def _load_prompts(path: Path | None, f, n_vocab: int) -> list[list[int]]:
    from app.commands.generate import _tokenizer

    tok = _tokenizer(f)
    entries: list = []
    if path is None:
        entries = list(DEFAULT_PROMPTS)
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InputError(f"--prompts: {path}: {exc.strerror or exc}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"--prompts: {path}:{n}: bad JSON ({exc.msg})") from None
                entries.append(obj.get("tokens") if "tokens" in obj else obj.get("prompt"))
            else:
                entries.append(line.replace("\\n", "\n"))
    out = []
    for e in entries:
        if isinstance(e, list):
            ids = [int(t) for t in e]
            if any(not 0 <= t < n_vocab for t in ids):
                raise InputError(f"--prompts: token id outside the vocabulary (0..{n_vocab - 1})")
        elif isinstance(e, str):
            if tok is None:
                raise InputError("--prompts: the model has no tokenizer; give token ids as JSON lines")
            ids = tok.encode(e)
        else:
            raise InputError("--prompts: each JSON line needs 'prompt' or 'tokens'")
        if ids:
            out.append(ids)
    if not out:
        raise InputError("--prompts: no prompts")
    return out


def run(args: argparse.Namespace) -> int:
    if args.synthetic:
        return bench_synthetic.run(args)
    from engine.sampling import SamplingParams
    from engine.spec.bench import configurations, run_bench

    modes = _csv(args.mtp, "--mtp", str, MTP_MODES)
    drafts = _csv(args.draft, "--draft", int, range(1, 9))
    if args.max_tokens < 2:
        raise InputError(f"--max-tokens: must be >= 2, got {args.max_tokens}")
    if args.repeats < 1:
        raise InputError(f"--repeats: must be >= 1, got {args.repeats}")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    f, model = load_from_args(args)
    if any(m != "off" for m in modes) and not model.cfg.has_mtp:
        raise InputError("--mtp: this model file has no MTP (nextn) layer; use --mtp off")
    prompts = _load_prompts(args.prompts, f, model.cfg.n_vocab)
    eos = frozenset()
    if args.stop_at_eos:
        from app.commands.generate import _stop_ids, _tokenizer

        eos = frozenset(_stop_ids(f, _tokenizer(f)))
    configs = configurations(modes, drafts)
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(done, total):
            sys.stderr.write(f"\r{done}/{total} runs")
            sys.stderr.flush()
    doc = run_bench(model, prompts, configs, max_tokens=args.max_tokens, repeats=args.repeats,
                    wrong_drafts=args.wrong_drafts, hidden=args.mtp_hidden, eos_ids=eos, progress=progress,
                    clock=args.clock, sampling=sampling)
    doc["model"] = str(f.path)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
        return 0
    if progress is not None:
        sys.stderr.write("\n")
    _table(doc)
    return 0


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _paired(p: dict | None) -> str:
    if not p:
        return "-"
    ci = p["ci95"]
    return f"{p['median']:.3f} " + (f"[{ci[0]:.3f}-{ci[1]:.3f}]" if ci else f"(n={p['n']}, no CI)")


def _sampling(s: dict) -> str:
    return (f", temperature {s['temperature']:g}" + (f" top-k {s['top_k']}" if s["top_k"] else "")
            + (f" top-p {s['top_p']:g}" if s["top_p"] < 1.0 else ""))


def _table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from engine.bench.speed import describe_weights

    title = (f"{doc['model']}: {doc['prompts']} prompts x {doc['repeats']}, {doc['max_tokens']} tokens, "
             f"{doc['device']} {doc['dtype']}, {doc['threads']} threads, {doc['clock']} clock"
             + (f", drafts among the first {doc['draft_vocab']} token ids" if doc["draft_vocab"] < doc["n_vocab"] else "")
             + (f", {doc['draft_weights']} draft weights" if doc["draft_weights"] != "exact" else "")
             + (", WRONG DRAFTS" if doc["wrong_drafts"] else "")
             + (_sampling(doc["sampling"]) if doc.get("sampling") else ""))
    t = Table(title=title)
    for col in ("config", "tok/s", "x off", "x off by prompt [95% CI]", "accept/pos", "mean len", "plain ms",
                "verify ms (rows)", "draft ms", "cache MiB"):
        t.add_column(col, justify="right" if col != "config" else "left")
    for r in doc["configs"]:
        t.add_row(r["config"], _fmt(r["decode_tps_median"], ".1f"), _fmt(r["ratio_to_off"], ".3f"),
                  _paired(r.get("ratio_to_off_paired")),
                  " ".join(f"{a:.2f}" for a in r["accepted_per_position"]) or "-",
                  _fmt(r["mean_accepted_length"]), _fmt(r["plain_step_ms"], ".3f"),
                  " ".join(f"{v:.2f}({n})" for n, v in r["verify_ms"].items()) or "-",
                  "in verify" if r.get("fused_rounds") and r["draft_step_ms"] is None else
                  _fmt(r["draft_step_ms"], ".3f"), _fmt(r["cache_mib"], ".1f"))
    Console(width=200).print(t)
    differ = [f"{r['config']} {r['runs_differing_from_off']} of {r['runs']}" for r in doc["configs"]
              if r.get("runs_differing_from_off")]
    if differ:
        print("runs whose tokens differ from off's run of the same prompt (a near-tie the verification's numerics "
              "tip): " + ", ".join(differ))
    print(f"peak RSS {doc['peak_rss_mib']:.0f} MiB; matrices: {describe_weights(doc['weights'])}; "
          f"steps: {doc['steps']['path']} ({doc['steps']['why']})")
    bw = doc["bandwidth"]
    print(f"read bandwidth after the runs: {bw['step_sized_gbs']:.1f} GB/s over {bw['step_sized_mib']} MiB "
          f"(one decode step reads {bw['decode_step_bytes'] / 2**20:.1f} MiB of weights), "
          f"{bw['memory_gbs']:.1f} GB/s over {bw['memory_mib']} MiB")
    calls = doc.get("calls")
    if calls:
        ver = ", ".join(f"{n} rows {v:.2f}" for n, v in calls["verify_over_plain_step"].items())
        row = calls["draft_row_over_plain_step"]
        print(f"calls apart ({calls['passes']} x {calls['calls_per_pass']} of each, medians): plain step "
              f"{calls['plain_step_ms']:.3f} ms; verification over it: {ver}; a draft row "
              + ("-" if row is None else f"{calls['draft_row_ms']:.3f} ms = {row:.3f} plain step")
              + " (draft chains of " + ", ".join(f"{k}: {v:.3f}" for k, v in calls["chain_ms"].items()) + " ms)")
    st = doc["steps"]
    if st.get("runs_repeated_after_a_compile"):
        print(f"note: {st['kinds_compiled_in_timed_runs']} kinds of step were first met in the timed runs; the "
              f"{st['runs_repeated_after_a_compile']} runs that met them were run again once they were compiled")
    if st.get("kept_runs_with_a_compile"):
        print(f"note: {st['kept_runs_with_a_compile']} runs met a new kind of step every time they ran and were kept: "
              "their figures include compile time or eager calls")
