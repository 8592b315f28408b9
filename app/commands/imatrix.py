"""`mtpchat imatrix`: an importance matrix for llama-quantize, with the MTP layer warmed up (spec §9).

Prints the running perplexity as llama.cpp does (`[1]x,[2]y,…`, then `Final estimate: PPL = …`), a progress
bar on stderr when it is a terminal, and writes llama.cpp's GGUF imatrix file. `--json`: one document instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from engine.errors import InputError
from engine.resources import default_model_path

DEFAULT_BATCH = 2048  # llama.cpp's default n_batch: chunks per forward = n_batch / n_ctx


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "imatrix", help="compute an importance matrix (llama.cpp GGUF format) with MTP warm-up",
        description="Run the model over chunks of a calibration text and write, for every weight it multiplies, "
                    "the sum of squared input activations per column and the rows counted, in the GGUF "
                    "imatrix format that llama-quantize --imatrix reads. With MTP the nextn layer runs over "
                    "the main model's hidden states of every chunk, so its tensors get entries too.")
    p.add_argument("--model", type=Path, help="GGUF model file (default: the bundled demo model)")
    p.add_argument("--text", type=Path, required=True, help="calibration text, UTF-8 (one trailing newline dropped)")
    p.add_argument("--out", type=Path, required=True, help="imatrix file to write")
    p.add_argument("--output-format", choices=("gguf", "dat"), default="gguf",
                   help="gguf: llama.cpp's current format (default); dat: the legacy binary format, the only "
                        "one ik_llama.cpp's llama-quantize reads")
    p.add_argument("--ctx", type=int, default=512, metavar="N", help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, metavar="N",
                   help="process at most N chunks (default: every whole chunk of the text)")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="run the nextn (MTP) layer per chunk and collect its tensors "
                        "(default: on when the model has one)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, metavar="N",
                   help=f"tokens per forward pass; whole chunks are batched side by side (default {DEFAULT_BATCH})")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON document with the results")
    p.set_defaults(func=run)




def run(args: argparse.Namespace) -> int:
    import torch

    from engine.gguf import open_gguf
    from engine.imatrix.gguf_format import write_imatrix, write_imatrix_dat
    from engine.imatrix.perplexity import count_chunks, read_calibration_text
    from engine.imatrix.run import compute_imatrix
    from engine.model import load_model
    from engine.text.tokenizer import Tokenizer

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    if args.batch < 1:
        raise InputError(f"--batch: {args.batch} must be at least 1")
    if args.threads < 0:
        raise InputError(f"--threads: {args.threads} must not be negative")
    out_dir = args.out.parent if str(args.out.parent) else Path(".")
    if not out_dir.is_dir():
        raise InputError(f"--out: {args.out}: folder {out_dir} does not exist")
    if args.threads:
        torch.set_num_threads(args.threads)

    text = read_calibration_text(args.text)
    path = args.model or default_model_path()
    f = open_gguf(path)
    tokenizer = Tokenizer.from_gguf(f)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    n_chunk = count_chunks(tokens.shape[0], args.ctx, args.chunks)  # refuse a short text before loading
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype) or (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model = load_model(f, device=args.device, dtype=dtype)
    mtp = model.cfg.has_mtp if args.mtp is None else args.mtp
    bos = tokenizer.special.bos if tokenizer.special.add_bos else None

    err = sys.stderr
    if not args.json:
        mtp_desc = f"MTP warm-up on (blk.{model.cfg.nextn_blocks[0]})" if mtp else "MTP warm-up off"
        err.write(f"imatrix: {tokens.shape[0]} tokens, {n_chunk} chunks of {args.ctx}, {mtp_desc}\n")
    chunks_per_batch = min(n_chunk, max(1, args.batch // args.ctx))
    show_bar = not args.json and err.isatty() and n_chunk > 1
    stream_values = not args.json and not (show_bar and sys.stdout.isatty())
    with _Progress(n_chunk, show_bar) as progress:

        def on_chunk(ev) -> None:
            progress.advance(ev.running_ppl)
            if ev.index == 1 and not args.json and not show_bar:  # llama.cpp's first-pass estimate
                err.write(f"imatrix: {ev.seconds:.2f} seconds per pass of {chunks_per_batch} chunks - ETA "
                          f"{ev.seconds * ev.n_chunk / chunks_per_batch / 60:.2f} minutes\n")
            if stream_values:
                sys.stdout.write(f"[{ev.index}]{ev.running_ppl:.4f},")
                sys.stdout.flush()

        result = compute_imatrix(model, tokens, args.ctx, max_chunks=args.chunks, mtp=mtp, bos_id=bos,
                                 chunks_per_batch=chunks_per_batch, on_chunk=on_chunk)
    try:
        if args.output_format == "dat":
            n_written = write_imatrix_dat(args.out, result.entries, str(args.text), chunk_count=result.n_chunk,
                                          chunk_size=args.ctx)
        else:
            write_imatrix(args.out, result.entries, [str(args.text)], chunk_count=result.n_chunk,
                          chunk_size=args.ctx)
            n_written = len(result.entries)
    except OSError as exc:
        raise InputError(f"--out: {args.out}: {exc.strerror or exc}") from None

    meter = result.meter
    if args.json:
        doc = {"model": str(path), "text": str(args.text), "out": str(args.out), "n_tokens": int(tokens.shape[0]),
               "n_ctx": args.ctx, "chunks": result.n_chunk, "mtp": mtp, "ppl": meter.ppl,
               "ppl_error": meter.ppl_error, "ppl_running": meter.running, "entries": n_written,
               "output_format": args.output_format,
               "seconds": result.seconds}
        sys.stdout.write(json.dumps(doc) + "\n")
        return 0
    if not stream_values:
        sys.stdout.write("".join(f"[{i + 1}]{v:.4f}," for i, v in enumerate(meter.running)))
    sys.stdout.write("\n")
    if meter.ppl_error is not None:
        sys.stdout.write(f"Final estimate: PPL = {meter.ppl:.4f} +/- {meter.ppl_error:.5f}\n")
    else:
        sys.stdout.write(f"Final estimate: PPL = {meter.ppl:.4f}\n")
    err.write(f"imatrix: {n_written} entries ({args.output_format}), {result.n_chunk} chunks, {result.seconds:.1f} s "
              f"-> {args.out}\n")
    return 0


class _Progress:
    """A rich progress bar on stderr with the running perplexity, or nothing when stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self._bar = None
        self._task = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("imatrix"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("PPL {task.fields[ppl]}"), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=True, redirect_stdout=False)
            self._bar.__enter__()
            self._task = self._bar.add_task("imatrix", total=self.total, ppl="-")
        return self

    def advance(self, running_ppl: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, ppl=f"{running_ppl:.4f}")

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
