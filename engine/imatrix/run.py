"""One imatrix run: chunks of tokens through the main model and, with MTP, the nextn block (spec §9.1, §9.2).

Per chunk (every chunk from an empty state, positions 0..n_ctx-1): the main model over the chunk with logits
for every row; the second half scored for perplexity; with MTP, the nextn block over (token q, h(q-1)) with
h(-1) = 0 (spec/mtp-speculation.md §1 pairing, not the seed's one-row-late pairing), no head. Every weight
multiply's input is collected meanwhile. Progress leaves through the `on_chunk` callback; nothing prints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import InputError, MtpchatError
from engine.imatrix.collector import ImatrixCollector
from engine.imatrix.perplexity import PerplexityMeter, chunk_tokens, count_chunks, score_chunk
from engine.imatrix.stats import ImatrixEntry, ImatrixStats
from engine.model import Qwen35Model, shift_hidden

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkDone:
    """Event after each chunk: 1-based `index` of `n_chunk`, its mean NLL, the running perplexity."""

    index: int
    n_chunk: int
    chunk_nll: float
    running_ppl: float
    seconds: float  # wall time since the run started


@dataclass
class ImatrixResult:
    entries: dict[str, ImatrixEntry]
    meter: PerplexityMeter
    n_chunk: int
    n_ctx: int
    mtp: bool
    seconds: float


def compute_imatrix(model: Qwen35Model, tokens: torch.Tensor, n_ctx: int, *, max_chunks: int | None = None,
                    mtp: bool = True, bos_id: int | None = None, chunks_per_batch: int = 1,
                    include_output: bool = True,
                    on_chunk: Callable[[ChunkDone], None] | None = None) -> ImatrixResult:
    """Collect the importance matrix of `model` over `tokens` [N] (the calibration text, tokenised once).

    mtp: also run the nextn block per chunk (the model must have one). bos_id: replaces each chunk's first
    token for the decode when the model adds BOS (llama.cpp); scoring uses the real tokens.
    chunks_per_batch: chunks evaluated side by side in one forward (llama.cpp's n_batch / n_ctx)."""
    if mtp and not model.cfg.has_mtp:
        raise InputError("--mtp: this model file has no nextn (MTP) block")
    if chunks_per_batch < 1:
        raise InputError(f"--batch: {chunks_per_batch} chunks per batch, need at least 1")
    if n_ctx > model.cfg.context_length:
        log.warning("n_ctx %d exceeds the model's training context %d", n_ctx, model.cfg.context_length)
    tokens = tokens.reshape(-1).to(torch.int64)
    n_chunk = count_chunks(tokens.shape[0], n_ctx, max_chunks)
    real = chunk_tokens(tokens, n_ctx, n_chunk)
    fed = chunk_tokens(tokens, n_ctx, n_chunk, bos_id).to(model.device)
    stats = ImatrixStats()
    meter = PerplexityMeter()
    t0 = time.perf_counter()
    with torch.inference_mode(), ImatrixCollector(model, stats, include_output=include_output):
        for c0 in range(0, n_chunk, chunks_per_batch):
            batch = fed[c0:c0 + chunks_per_batch]                      # [B, n_ctx]
            out = model(batch, logits="all")                           # fresh sequences, positions 0..n_ctx-1
            if mtp:
                # spec §9.2 + §1: row q pairs token q with h(q-1); h(-1) = 0 at every chunk start
                model.mtp_forward(batch, shift_hidden(out.hidden), logits="none")
            for b in range(batch.shape[0]):
                meter.add(score_chunk(out.logits[b], real[c0 + b]))
                if on_chunk is not None:
                    on_chunk(ChunkDone(c0 + b + 1, n_chunk, meter.chunk_nll[-1], meter.running[-1],
                                       time.perf_counter() - t0))
            bad = stats.check_finite()
            if bad is not None:
                raise MtpchatError(f"imatrix: non-finite activations reached {bad} in chunk {c0 + 1}")
    return ImatrixResult(stats.entries(), meter, n_chunk, n_ctx, mtp, time.perf_counter() - t0)
