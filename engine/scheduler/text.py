"""Per-request text output for the scheduler: token ids in, UTF-8-safe text deltas out, stop strings cut
(rows C1-C4), built on engine.text's streaming detokenizer and stop matcher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from engine.text.detokenizer import TextStream as _DetokStream


class TextStream(Protocol):
    def push(self, token: int) -> tuple[str, str | None]:
        """Add one generated token. Returns (text now safe to emit, the stop string hit or None).
        After a hit the text returned ends right before the stop string and the stream is finished."""

    def flush(self) -> str:
        """Text held back (a partial code point or a possible stop-string prefix) at the end."""


class DetokenizedText:
    """`TextStream` over the tokenizer's bytes: the scheduler's view of engine.text.detokenizer."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str]):
        self._stream = _DetokStream(token_bytes, stop)

    def push(self, token: int) -> tuple[str, str | None]:
        delta = self._stream.push([token])
        return delta.text, (self._stream.stop_string if delta.stopped else None)

    def flush(self) -> str:
        return self._stream.finish().text


def text_factory(token_bytes: Callable[[int], bytes]) -> Callable[[Sequence[str]], TextStream]:
    """The scheduler's `text_factory` for a tokenizer's `token_bytes`."""
    return lambda stop: DetokenizedText(token_bytes, stop)
