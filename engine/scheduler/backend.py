"""The contract between the slot scheduler and the code that runs the model for N slots.

The scheduler decides *which* request runs on *which* slot and turns tokens into events; a backend
owns the model, the caches and the per-slot decode state and advances all active slots by one batched
iteration. `engine.scheduler.model_backend.ModelBackend` is the real one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.scheduler.types import GenerationRequest
from engine.spec.events import RoundEvent


@dataclass
class SlotStep:
    """What one iteration did for one slot."""

    prompt_processed: int = 0                     # prompt tokens consumed this iteration
    tokens: list[int] = field(default_factory=list)   # newly committed generated tokens
    eos: bool = False                             # the last token in `tokens` is an end-of-generation token
    events: list[RoundEvent] = field(default_factory=list)


class SlotBackend(ABC):
    n_slots: int
    n_ctx_slot: int
    n_vocab: int

    @abstractmethod
    def cached_tokens(self, slot: int) -> Sequence[int]:
        """Tokens the slot's cache describes (for choosing the slot with the longest common prefix)."""

    @abstractmethod
    def begin(self, slot: int, task: int, req: GenerationRequest, mtp: str, n_draft: int) -> int:
        """Start `req` on `slot`: restore the best exact prefix (§6.5), reset sampler and draft policy.
        Returns the number of prompt tokens reused."""

    @abstractmethod
    def step(self, slots: Sequence[int], budgets: Sequence[int]) -> dict[int, SlotStep]:
        """One batched iteration over the active `slots`: a prompt chunk for slots still in prefill, a
        plain step or a speculative round for the others, never emitting more than `budgets[i]` tokens."""

    @abstractmethod
    def finish(self, slot: int, n_kept: int) -> None:
        """The request ended after keeping `n_kept` generated tokens (fewer than produced when a stop
        string cut the last round): the slot's cache must describe exactly prompt + kept tokens."""

    @abstractmethod
    def abort(self, slot: int) -> None:
        """The request failed or was cancelled at an arbitrary point: leave the slot consistent
        (possibly empty) for the next request."""

    def slot_info(self, slot: int) -> dict:
        """Speculative state for /slots (policy, k, gate state, EMAs, n_checkpoints ...)."""
        return {}
