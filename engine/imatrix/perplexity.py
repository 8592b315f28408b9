"""llama.cpp's chunking and perplexity protocol (tools/imatrix, tools/perplexity; spec/mtp-speculation.md §9.1).

The token stream is cut into ⌊N / n_ctx⌋ whole chunks (capped by `--chunks`, the rest ignored); each chunk is
evaluated from an empty state; only its second half is scored: the logit row j, j = n_ctx/2 … n_ctx-2,
against token j+1, with the log-softmax in float64. Pure functions of tensors: no model, no printing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.errors import InputError


def read_calibration_text(path) -> str:
    """The text as llama.cpp's `-f` reads it: the whole file, one trailing newline dropped."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise InputError(f"--text: {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"--text: {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise InputError(f"--text: {path}: {exc.strerror}") from None
    return text[:-1] if text.endswith("\n") else text


def count_chunks(n_tokens: int, n_ctx: int, max_chunks: int | None = None) -> int:
    """Number of whole chunks processed; llama.cpp refuses fewer than 2·n_ctx tokens."""
    if n_ctx < 4 or n_ctx % 2:
        raise InputError(f"--ctx: {n_ctx} must be an even number of at least 4")
    if n_tokens < 2 * n_ctx:
        raise InputError(f"--text: tokenizes to {n_tokens} tokens; a context of {n_ctx} needs at least {2 * n_ctx}")
    n = n_tokens // n_ctx
    if max_chunks is not None:
        if max_chunks < 1:
            raise InputError(f"--chunks: {max_chunks} must be at least 1")
        n = min(n, max_chunks)
    return n


def chunk_tokens(tokens: torch.Tensor, n_ctx: int, n_chunk: int, bos_id: int | None = None) -> torch.Tensor:
    """[n_chunk, n_ctx] int64 windows; with `bos_id`, each window's first token is replaced by BOS for the decode."""
    chunks = tokens[: n_chunk * n_ctx].reshape(n_chunk, n_ctx).to(torch.int64).clone()
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


@dataclass(frozen=True)
class ChunkScore:
    nll: float    # Σ -log p over the scored tokens of the chunk
    nll2: float   # Σ (log p)²
    count: int    # scored tokens: n_ctx - 1 - n_ctx/2


def score_chunk(logits: torch.Tensor, tokens: torch.Tensor) -> ChunkScore:
    """Second-half NLL of one chunk. `logits` [n_ctx, n_vocab] (any float dtype), `tokens` [n_ctx] (the real ones)."""
    n_ctx = tokens.shape[0]
    first = n_ctx // 2
    rows = logits[first : n_ctx - 1].to(torch.float64)
    target = tokens[first + 1 : n_ctx].to(device=rows.device, dtype=torch.int64)
    nll = -rows.log_softmax(-1).gather(1, target[:, None])[:, 0]
    return ChunkScore(float(nll.sum()), float((nll * nll).sum()), int(nll.shape[0]))


class PerplexityMeter:
    """Running perplexity over chunks, as llama.cpp prints it (`[i]ppl,` after each chunk, then a final estimate)."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.nll2 = 0.0
        self.count = 0
        self.chunk_nll: list[float] = []  # mean NLL of each chunk
        self.running: list[float] = []    # exp(mean NLL so far) after each chunk

    def add(self, score: ChunkScore) -> float:
        self.nll += score.nll
        self.nll2 += score.nll2
        self.count += score.count
        self.chunk_nll.append(score.nll / score.count)
        self.running.append(math.exp(self.nll / self.count))
        return self.running[-1]

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_error(self) -> float | None:
        """llama.cpp's ± figure: ppl · stddev(NLL)/sqrt(count-1); None when undefined."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if self.count < 2 or var <= 0:
            return None
        return math.sqrt(var / (self.count - 1)) * self.ppl
