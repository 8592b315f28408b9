"""`mtpchat logits --model PATH --tokens 1,2,3 --out logits.npy [--device] [--dtype] [--mtp-out mtp.npy]`:
the float32 logits [T, vocab] of one prefill, and optionally the MTP head's rows (spec §6.3 indexing:
row i pairs token i with the main model's post-norm hidden row i-1, zeros for row 0).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine.errors import InputError
from engine.resources import default_model_path
from engine.spec.modes import STEP_MODES

STEPS_HELP = ("decode steps, MTP drafts and verifications as torch.compile'd graphs: auto compiles each kind "
              "of step in the background on first use and switches when it is ready (needs a C++ "
              "compiler on CPU); compiled compiles before using (blocking); eager never compiles. "
              "MTPCHAT_STEPS=eager|compiled overrides auto")

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")


def register(subparsers) -> None:
    p = subparsers.add_parser("logits", help="write the logits of one prefill to a .npy file",
                              description="Run one prefill of the given token ids and write the float32 logits "
                                          "[T, vocab] of every position (and, with --mtp-out, the MTP head's).")
    add_model_args(p, weights="dense")
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, type=Path, help="output .npy file (float32 [T, vocab])")
    p.add_argument("--mtp-out", type=Path, help="also write the MTP head's logits (float32 [T, vocab])")
    p.set_defaults(func=run)


WEIGHTS = ("auto", "dense", "packed")
WEIGHTS_HELP = ("packed: quantized and 16-bit GGUF matrices kept in their file form, multiplied by fused kernels "
                "(CPU: a Q8_0 step reads ~1 byte per weight); dense: dequantized float matrices (the reference "
                "numerics); auto: packed on CPU with float32, dense elsewhere")


def load_model_as(f, weights: str, steps: str, device: str = "cpu", dtype=None):
    """`load_model` for the --weights / --steps / --device / --dtype choices of a command: packed weights
    when asked for, or for `auto` on CPU in float32 (a requested bfloat16 stays with the dense path, which
    holds the weights in that dtype; packing exists on CPU only), every matrix packed when the steps will
    be compiled (`engine.model.steps.min_packed`)."""
    import torch

    from engine.model.model import load_model
    from engine.model.steps import min_packed

    dtype = dtype or torch.float32
    packed = weights == "packed" or (weights == "auto" and str(device).startswith("cpu")
                                     and dtype == torch.float32)
    return load_model(f, device=device, dtype=dtype, packed=packed, min_packed=min_packed(steps, device))


DRAFT_VOCAB_HELP = ("MTP drafts choose among the first N token ids only, so a draft's output head reads N rows "
                    "instead of the whole vocabulary (BPE ids run roughly from most to least frequent; the "
                    "output stays exact, only acceptance can drop); all (default) or 1..vocabulary size")
DRAFT_WEIGHTS_CHOICES = ("auto", "exact", "q8_0", "int8", "int8_dots")
DRAFT_WEIGHTS_HELP = ("the weights MTP drafts multiply by: q8_0 = Q8_0 copies of the MTP block's and the output "
                      "head's float (F32/F16/BF16) matrices, a quarter or half of the bytes a draft reads, and of "
                      "a quantized file's other than Q8_0 (K-quants), cheaper to unpack; int8 = "
                      "int8 copies with one scale per row of those and of a quantized file's (Q8_0, K-quant) "
                      "matrices, less arithmetic; int8_dots = those "
                      "rows by the CPU's 8-bit dot products (AVX-512 VNNI or AVX-VNNI), activations rounded to int8 too "
                      "(built on first use; the output stays exact, only acceptance can change; CPU float32 "
                      "only); exact = the file's; auto (default) = where the steps are compiled on CPU, "
                      "int8_dots where the CPU has AVX-512 VNNI or AVX-VNNI, else int8 if their code has 512-bit "
                      "vectors, else q8_0; exact elsewhere")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """--draft-vocab and --draft-weights (generate, bench, chat, serve)."""
    p.add_argument("--draft-vocab", default="all", metavar="N", help=DRAFT_VOCAB_HELP)
    p.add_argument("--draft-weights", choices=DRAFT_WEIGHTS_CHOICES, default="auto", help=DRAFT_WEIGHTS_HELP)


def apply_draft_options(model, vocab: str | int | None, weights: str | None, steps: str) -> None:
    """Set `model.set_draft_vocab` from a --draft-vocab value ('all', None or 1..vocabulary size) and
    `model.set_draft_weights` from a --draft-weights value (None or 'auto': `auto_draft_weights`). Call
    before `compile_steps`."""
    if vocab is None or str(vocab).strip().lower() == "all":
        n = None
    else:
        try:
            n = int(str(vocab).strip())
        except ValueError:
            raise InputError(f"--draft-vocab: expected 'all' or a token count, got {vocab!r}") from None
    model.set_draft_vocab(n, "--draft-vocab")
    if weights in (None, "auto"):
        weights = auto_draft_weights(model, steps)
    model.set_draft_weights(weights, "--draft-weights")


def describe_draft_weights(model) -> str:
    """The draft weights in use for a status line, e.g. 'int8_dots (AVX-512 VNNI)'."""
    kind = model.draft_weights
    if kind != "int8_dots":
        return kind
    from engine.kernels import int8_dots
    return f"{kind} ({int8_dots.status()[1].split(' (built in ')[0]})"


def auto_draft_weights(model, steps: str) -> str:
    """--draft-weights auto: copies only where the steps will be compiled on CPU for a float32 model (their
    products then cost no call of their own; eager steps would pay one per packed product,
    `engine.model.steps.min_packed`); int8 rows by the CPU's 8-bit dot products where it has them
    (engine.kernels.int8_dots: AVX-512 VNNI or AVX-VNNI; a draft row 0.81x `int8`'s with AVX-512 code, 0.73x
    Q8_0's with AVX2 code on the same Xeon, thirty-sixth session); else int8 rows by inductor's code where that
    has 512-bit vectors (~7 % cheaper than Q8_0 on an AVX-512 Xeon, thirty-fifth session); else Q8_0 (whose
    words layout AVX2 code reads fastest: its int8 loads of 16 lanes are slow; other vector sets not measured)."""
    import torch

    from engine.kernels import codegen, int8_dots
    from engine.model.steps import min_packed

    if model.dtype != torch.float32 or min_packed(steps, model.device) != 0:
        return "exact"
    if int8_dots.available():
        return "int8_dots"
    return "int8" if codegen.avx512() else "q8_0"


def add_model_args(p: argparse.ArgumentParser, steps: str = "eager", weights: str = "auto") -> None:
    """--model, --device, --dtype, --threads, --weights, --steps (shared with `generate` and `bench`)."""
    p.add_argument("--model", type=Path, help="GGUF model file (default: the bundled demo model)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weight dtype: float32 (default on cpu) or bfloat16 (default on cuda)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: the cores this process may use)")
    p.add_argument("--weights", choices=WEIGHTS, default=weights, help=f"{WEIGHTS_HELP} (default {weights})")
    p.add_argument("--steps", choices=STEP_MODES, default=steps,
                   help=f"{STEPS_HELP} (default {steps})")




def load_from_args(args: argparse.Namespace):
    """(GGUFFile, model) for --model/--device/--dtype/--threads; user errors raise MtpchatError."""
    import torch

    from engine.gguf import open_gguf

    if args.threads < 0:
        raise InputError(f"--threads: must be >= 0, got {args.threads}")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device: cuda is not available on this machine")
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    f = open_gguf(args.model or default_model_path())
    model = load_model_as(f, getattr(args, "weights", "dense"), args.steps, args.device, getattr(torch, dtype_name))
    apply_draft_options(model, getattr(args, "draft_vocab", None), getattr(args, "draft_weights", None), args.steps)
    model.compile_steps(args.steps, background=args.steps == "auto")
    return f, model


def parse_token_ids(text: str, n_vocab: int, what: str = "--tokens") -> list[int]:
    try:
        ids = [int(s) for s in text.replace(" ", "").split(",") if s != ""]
    except ValueError:
        raise InputError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise InputError(f"{what}: no token ids given")
    for t in ids:
        if not 0 <= t < n_vocab:
            raise InputError(f"{what}: token id {t} is outside the vocabulary (0..{n_vocab - 1})")
    return ids


def _save(path: Path, array, what: str) -> None:
    import numpy as np

    try:
        with open(path, "wb") as fh:   # exactly this path (np.save on a name would append .npy)
            np.save(fh, array)
    except OSError as exc:
        raise InputError(f"{what}: cannot write {path} ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.model import shift_hidden

    for what, path in (("--out", args.out), ("--mtp-out", args.mtp_out)):
        if path is not None and not path.parent.is_dir():
            raise InputError(f"{what}: folder {path.parent} does not exist")
    _, model = load_from_args(args)
    ids = parse_token_ids(args.tokens, model.cfg.n_vocab)
    if args.mtp_out is not None and not model.cfg.has_mtp:
        raise InputError("--mtp-out: this model file has no nextn (MTP) block")
    with torch.inference_mode():
        tokens = torch.tensor([ids], dtype=torch.long, device=model.device)
        out = model(tokens)
        _save(args.out, out.logits[0].float().cpu().numpy(), "--out")
        if args.mtp_out is not None:
            mtp = model.mtp_forward(tokens, shift_hidden(out.hidden))
            _save(args.mtp_out, mtp.logits[0].float().cpu().numpy(), "--mtp-out")
    return 0
