"""The plain generation loop (no speculation): prefill the prompt, then one token per forward until
a stop token, `max_tokens`, or the end of the context. One sequence in one cache slot.

Never prints; timings come back in `GenerationResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.errors import InputError
from engine.model import ModelCache, Qwen35Model
from engine.sampling import Sampler, SamplingParams


@dataclass
class GenerationResult:
    tokens: list[int]            # generated ids, including a final stop token if one ended the run
    finish_reason: str           # "stop" (a stop token), "length" (max_tokens or the context is full)
    prompt_tokens: int
    prefill_s: float             # wall time of the prompt forward (and the first sample)
    decode_s: float              # wall time of the one-token steps after it
    decode_steps: int            # one-token forwards run

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


def generate(model: Qwen35Model, prompt: list[int], *, max_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_ids: Iterable[int] = (), cache: ModelCache | None = None, slot: int = 0,
             prefill_chunk: int = 512, on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate up to `max_tokens` tokens after `prompt` (appended to `slot` of `cache`, or a fresh
    one-slot cache sized prompt + max_tokens)."""
    if not prompt:
        raise InputError("prompt: at least one token is needed")
    if max_tokens < 0:
        raise InputError(f"max_tokens: must be >= 0, got {max_tokens}")
    n_vocab = model.cfg.n_vocab
    bad = [t for t in prompt if not 0 <= t < n_vocab]
    if bad:
        raise InputError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    if cache is None:
        cache = ModelCache(model.cfg, 1, len(prompt) + max(max_tokens, 1), device=model.device,
                           kv_dtype=model.dtype, mtp=False)
    stop = set(stop_ids)
    sampler = Sampler(sampling, model.device)
    out: list[int] = []
    finish = "length"
    with torch.inference_mode():
        t0 = time.perf_counter()
        tokens = torch.tensor([prompt], dtype=torch.long, device=model.device)
        res = model.prefill(tokens, cache, [slot], chunk_tokens=prefill_chunk, logits="last")
        t1 = time.perf_counter()
        steps = 0
        while len(out) < max_tokens:
            nxt = sampler.sample(res.logits[:, -1])
            tok = int(nxt[0])
            out.append(tok)
            if len(out) == 1:
                t1 = time.perf_counter()
            if on_token is not None:
                on_token(tok)
            if tok in stop:
                finish = "stop"
                break
            if len(out) == max_tokens or cache.lengths[slot] >= cache.n_ctx:
                break
            res = model(nxt[:, None], cache, [slot], logits="last")
            steps += 1
        t2 = time.perf_counter()
    return GenerationResult(out, finish, len(prompt), t1 - t0, t2 - t1, steps)
