"""Streaming text out of token ids: complete UTF-8 characters only, and stop strings never leaked.

Rows C1-C4 of spec/reliability-matrix.md. `StreamingDetokenizer` keeps a byte buffer and emits whole
characters (invalid bytes become U+FFFD at once, an incomplete tail waits, `flush` ends it); `StopMatcher`
holds back the longest tail that could still start a stop string. Neither ever prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class StreamingDetokenizer:
    """Token ids (or raw bytes) in, text out. The text emitted so far always equals the bulk decode
    `b"".join(bytes).decode("utf-8", "replace")` of everything pushed, minus at most one incomplete
    character (<= 3 bytes held, row C2), which `flush()` releases (as U+FFFD if it never completed)."""

    def __init__(self, token_bytes: Callable[[int], bytes] | None = None):
        self._token_bytes = token_bytes
        self._held = b""

    def push(self, token_id: int) -> str:
        if self._token_bytes is None:
            raise TypeError("this detokenizer was built without a token_bytes function; use push_bytes")
        return self.push_bytes(self._token_bytes(token_id))

    def push_many(self, token_ids: Iterable[int]) -> str:
        return self.push_bytes(b"".join(self._token_bytes(t) for t in token_ids))

    def push_bytes(self, data: bytes) -> str:
        buf = self._held + data if self._held else data
        cut = len(buf) - _incomplete_tail(buf)
        self._held = buf[cut:]
        # A kept tail starts with a lead byte, so the head decodes exactly as it would in one piece.
        return buf[:cut].decode("utf-8", "replace")

    @property
    def held(self) -> bytes:
        """Bytes waiting for the rest of their character: always a proper prefix of one UTF-8 sequence."""
        return self._held

    @property
    def held_bytes(self) -> int:
        return len(self._held)

    def flush(self) -> str:
        """End of generation (any reason): release the tail; an incomplete character becomes U+FFFD."""
        out, self._held = self._held.decode("utf-8", "replace"), b""
        return out


def _incomplete_tail(buf: bytes) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of one valid UTF-8 sequence (0..3).
    Bytes that can never complete (C0, C1, F5..FF, ED A0 = a surrogate, E0 80 = overlong ...) are not held."""
    n = len(buf)
    for k in range(1, min(3, n) + 1):
        lead = buf[n - k]
        if 0x80 <= lead <= 0xBF:
            continue  # a continuation byte: the lead is further back
        if 0xC2 <= lead <= 0xDF:
            need = 2
        elif 0xE0 <= lead <= 0xEF:
            need = 3
        elif 0xF0 <= lead <= 0xF4:
            need = 4
        else:
            return 0
        if k >= need:
            return 0  # complete (or invalid, which decode replaces now)
        if k >= 2:
            lo, hi = _SECOND_BYTE.get(lead, (0x80, 0xBF))
            if not lo <= buf[n - k + 1] <= hi:
                return 0
        return k
    return 0


# Second-byte ranges that differ from 80..BF (Unicode Table 3-7, well-formed UTF-8 byte sequences)
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class StopMatcher:
    """Withholds text that might be the start of a stop string (row C4).

    `push(text)` returns (text safe to emit, stopped). Generation stops at the first point where any stop
    string is complete; only the text before that stop string is ever emitted, the rest is discarded.
    Among stop strings completed at the same point the one starting earliest wins.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._max = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        pending = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            i = pending.find(stop)
            if i >= 0:
                key = (i + len(stop), i, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return pending[:best[1]], True
        keep = self._held_tail(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], False

    def _held_tail(self, pending: str) -> int:
        for k in range(min(len(pending), self._max - 1), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    @property
    def held(self) -> str:
        return self._held

    def flush(self) -> str:
        """End without a stop string: the held text was not a stop after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string matched; `text` is everything before it and generation should end


class TextStream:
    """Detokenizer + stop matcher for one generated sequence: ids in, safe text deltas out."""

    def __init__(self, token_bytes: Callable[[int], bytes], stops: Sequence[str] = ()):
        self._detok = StreamingDetokenizer(token_bytes)
        self._stop = StopMatcher(stops)

    def push(self, token_ids: Iterable[int]) -> TextDelta:
        """One step: a single token or several accepted at once (MTP drafts)."""
        text, stopped = self._stop.push(self._detok.push_many(token_ids))
        return TextDelta(text, stopped)

    def finish(self) -> TextDelta:
        """End of generation (EOS, max_tokens, cancel): flush the byte tail through the stop matcher."""
        if self._stop.stopped:
            return TextDelta("", True)
        text, stopped = self._stop.push(self._detok.flush())
        if not stopped:
            text += self._stop.flush()
        return TextDelta(text, stopped)

    @property
    def stop_string(self) -> str | None:
        return self._stop.matched
