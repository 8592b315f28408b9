"""The scheduler's plain dataclasses: requests in, events out, slot snapshots (spec/mtp-speculation.md §6).

The server and the Qt worker are two adapters over these; nothing here touches torch, HTTP or Qt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.events import RoundEvent

MTP_MODES = ("off", "on", "adaptive", "auto")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation on one slot. `prompt` are token ids; `checkpoint_at` the prompt lengths at message
    boundaries where the slot may keep a Gated DeltaNet checkpoint for prefix reuse (§6.5)."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    mtp: str | None = None              # None: the scheduler's default mode
    n_draft: int | None = None          # None: the scheduler's default k
    mtp_adaptive: bool | None = None    # the seed's per-request "speculative.mtp_adaptive"
    slot: int | None = None             # pinned slot; None = any (§6.1 slot choice)
    checkpoint_at: tuple[int, ...] = ()


@dataclass(frozen=True)
class Assigned:
    """The request got its slot; `cache_n` prompt tokens are reused from the slot's cache."""

    task: int
    slot: int
    cache_n: int
    n_prompt: int


@dataclass(frozen=True)
class TextDelta:
    """Newly committed tokens and the text they complete (never a broken UTF-8 sequence, never part of a
    stop string)."""

    task: int
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Timings:
    """llama.cpp's per-response `timings` (spec §7.2) plus ik's per-depth draft counts (§7.4)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_by_depth: tuple[tuple[int, int], ...] = ()   # (draft_n, draft_n_accepted) per depth 1..
    n_ctx: int = 0
    n_past: int = 0

    def as_dict(self) -> dict:
        d = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": 1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0,
            "n_ctx": self.n_ctx,
            "n_past": self.n_past,
        }
        if self.draft_n > 0:
            d["draft_n"] = self.draft_n
            d["draft_n_accepted"] = self.draft_n_accepted
            d["draft_by_depth"] = [{"depth": i + 1, "draft_n": n, "draft_n_accepted": a}
                                   for i, (n, a) in enumerate(self.draft_by_depth)]
        return d


@dataclass(frozen=True)
class Finished:
    """The last event of every request. `finish_reason`: stop / length / cancelled / error."""

    task: int
    slot: int                          # -1 when it never got a slot
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    stopping_word: str = ""
    error: str | None = None
    error_status: int = 0              # HTTP-like status for errors: 503 queue timeout, 500 engine fault
    spec: dict = field(default_factory=dict)


Event = Assigned | TextDelta | RoundEvent | Finished


@dataclass(frozen=True)
class SlotSnapshot:
    """One slot for `/slots` (spec §6.4)."""

    id: int
    id_task: int
    n_ctx: int
    is_processing: bool
    n_past: int
    n_cached: int
    speculative: bool
    spec: dict
    params: dict
    next_token: dict
    n_checkpoints: int
    checkpoint_bytes: int

    def as_dict(self) -> dict:
        return {
            "id": self.id, "id_task": self.id_task, "n_ctx": self.n_ctx, "is_processing": self.is_processing,
            "n_past": self.n_past, "n_cached": self.n_cached, "speculative": self.speculative,
            "spec": self.spec, "params": self.params, "next_token": self.next_token,
            "n_checkpoints": self.n_checkpoints, "checkpoint_bytes": self.checkpoint_bytes,
        }
