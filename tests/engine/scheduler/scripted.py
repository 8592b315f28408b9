"""A scripted backend and text stream for testing the scheduler's mechanics without a model.

Each slot "generates" a deterministic function of its prompt; steps can be slowed to test cancellation.
The real backend is tested end to end through the server (tests/app/server).
"""

from __future__ import annotations

import time

from engine.scheduler.backend import SlotBackend, SlotStep
from engine.spec.events import RoundEvent

EOS = 99


def script_token(prompt: tuple[int, ...], i: int) -> int:
    return (sum(prompt) * 7 + i * 13) % 90


class ScriptedBackend(SlotBackend):
    def __init__(self, n_slots=2, n_ctx_slot=512, prefill_chunk=8, step_s=0.0, eos_after=None, fail_task=None):
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, 100
        self.prefill_chunk, self.step_s, self.eos_after, self.fail_task = prefill_chunk, step_s, eos_after, fail_task
        self.cache: list[list[int]] = [[] for _ in range(n_slots)]
        self.state: dict[int, dict] = {}
        self.batches: list[tuple[int, ...]] = []

    def cached_tokens(self, slot):
        return self.cache[slot]

    def begin(self, slot, task, req, mtp, n_draft):
        old = self.cache[slot]
        n = 0
        while n < min(len(old), len(req.prompt) - 1) and old[n] == req.prompt[n]:
            n += 1
        self.cache[slot] = list(req.prompt[:n])
        self.state[slot] = {"task": task, "prompt": req.prompt, "done": n, "gen": 0}
        return n

    def step(self, slots, budgets):
        self.batches.append(tuple(slots))
        if self.step_s:
            time.sleep(self.step_s)
        out = {}
        for slot, _budget in zip(slots, budgets, strict=True):
            st = self.state[slot]
            if st["task"] == self.fail_task:
                out[slot] = RuntimeError("injected fault")
                continue
            res = SlotStep()
            if st["done"] < len(st["prompt"]):
                n = min(self.prefill_chunk, len(st["prompt"]) - st["done"])
                self.cache[slot].extend(st["prompt"][st["done"]:st["done"] + n])
                st["done"] += n
                res.prompt_processed = n
                if st["done"] < len(st["prompt"]):
                    out[slot] = res
                    continue
            tok = script_token(st["prompt"], st["gen"])
            if self.eos_after is not None and st["gen"] == self.eos_after:
                tok, res.eos = EOS, True
            st["gen"] += 1
            self.cache[slot].append(tok)
            res.tokens.append(tok)
            res.events.append(RoundEvent(t=time.monotonic(), slot=slot, task=st["task"], kind="plain", k=0,
                                         accepted=0, accepted_flags=(), emitted=1, round_s=0.0))
            out[slot] = res
        return out

    def finish(self, slot, n_kept):
        st = self.state.pop(slot)
        del self.cache[slot][len(st["prompt"]) + n_kept:]

    def abort(self, slot):
        self.state.pop(slot, None)
        self.cache[slot] = []


class CharText:
    """Token t -> chr(ord('a') + t % 26); stop strings matched on the text, held back while a prefix."""

    def __init__(self, stop):
        self.stop = stop
        self.pending = ""

    def push(self, token):
        self.pending += chr(ord("a") + token % 26)
        for s in self.stop:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, s
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, None

    def flush(self):
        out, self.pending = self.pending, ""
        return out
