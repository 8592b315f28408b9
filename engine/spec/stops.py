"""End-of-generation checks applied to every emitted token, one at a time.

spec/mtp-speculation.md §3.4: the a+1 tokens of a round go through the same per-token logic as plain
decoding; at the first EOS, completed stop string or the max_tokens limit generation ends and nothing
after that token is emitted or counted. Stop strings are matched on the UTF-8 bytes of the output,
so a string split across tokens is found; the text is cut where the stop string starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopRule:
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()


class StopChecker:
    """Feed tokens with `push`; it returns the finish reason ("stop" / "length") on the last token.

    `token_bytes(id) -> bytes` is needed only when there are stop strings.
    """

    def __init__(self, rule: StopRule, token_bytes: Callable[[int], bytes] | None = None):
        if rule.stop and token_bytes is None:
            raise ValueError("stop strings need token_bytes")
        self.rule = rule
        self.token_bytes = token_bytes
        self._stops = [s.encode("utf-8") for s in rule.stop if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.tokens: list[int] = []
        self.text = bytearray()
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.text_end: int | None = None   # bytes of text before the stop string

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.rule.max_tokens - len(self.tokens)

    def push(self, token: int) -> str | None:
        if self.done:
            raise RuntimeError("push after the end of generation")
        self.tokens.append(token)
        if token in self.rule.eos_ids:
            self.finish_reason = "stop"
            return self.finish_reason
        if self._stops:
            start = max(0, len(self.text) - self._longest + 1)
            self.text += self.token_bytes(token)
            window = bytes(self.text[start:])
            hits = [(window.find(s), i) for i, s in enumerate(self._stops) if window.find(s) >= 0]
            if hits:
                pos, i = min(hits)
                self.finish_reason = "stop"
                self.stop_string = self.rule.stop[i]
                self.text_end = start + pos
                return self.finish_reason
        if len(self.tokens) >= self.rule.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    def push_many(self, tokens: Iterable[int]) -> int:
        """Push until the end of generation; returns how many tokens were taken."""
        n = 0
        for t in tokens:
            if self.done:
                break
            self.push(t)
            n += 1
        return n

    def output_bytes(self) -> bytes:
        return bytes(self.text[: self.text_end]) if self.text_end is not None else bytes(self.text)
