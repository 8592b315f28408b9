"""Per-slot prompt-prefix reuse with bounded Gated DeltaNet checkpoints (spec/mtp-speculation.md §6.5, E11).

Attention KV can be cut at any length; GDN state only restored from an exact checkpoint. A slot reuses
state only when its cached tokens equal the new prompt token by token up to the reuse point and the
recurrent state is known at exactly that point (live state or a checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.cache import GDNSnapshot


@dataclass
class Checkpoint:
    n: int                      # state after the first n tokens of the slot's sequence
    gdn: GDNSnapshot
    carry: torch.Tensor | None  # MTP hidden carry h(n-1) [E], None without MTP or at n = 0

    @property
    def nbytes(self) -> int:
        ts = [*self.gdn.conv.values(), *self.gdn.ssm.values()]
        if self.carry is not None:
            ts.append(self.carry)
        return sum(t.numel() * t.element_size() for t in ts)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class ReusePlan:
    n: int                           # prompt tokens reused
    source: str                      # "live" / "checkpoint" / "none"
    checkpoint: Checkpoint | None = None


def plan_reuse(held: Sequence[int], live: bool, checkpoints: Sequence[Checkpoint], prompt: Sequence[int]
               ) -> ReusePlan:
    """Where to resume a slot for `prompt`. At least the last prompt token is always re-processed (its
    logits start generation)."""
    limit = min(common_prefix(held, prompt), len(prompt) - 1)
    if live and len(held) <= limit:
        return ReusePlan(len(held), "live") if held else ReusePlan(0, "none")
    best = None
    for ck in checkpoints:
        if 0 < ck.n <= limit and (best is None or ck.n > best.n):
            best = ck
    if best is not None:
        return ReusePlan(best.n, "checkpoint", best)
    return ReusePlan(0, "none")


class CheckpointStore:
    """At most `max_count` checkpoints per slot, oldest evicted first; one per position."""

    def __init__(self, max_count: int):
        self.max_count = max_count
        self.items: list[Checkpoint] = []

    def add(self, ck: Checkpoint) -> None:
        if self.max_count <= 0:
            return
        self.items = [c for c in self.items if c.n != ck.n]
        self.items.append(ck)
        while len(self.items) > self.max_count:
            self.items.pop(0)

    def drop_beyond(self, n: int) -> None:
        """Forget checkpoints of a continuation that is being overwritten (positions > n)."""
        self.items = [c for c in self.items if c.n <= n]

    def clear(self) -> None:
        self.items = []

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.items)
