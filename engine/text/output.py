"""Model output -> content, reasoning_content and tool_calls, incrementally (spec/mtp-speculation.md
§8.2-§8.4, rows D1-D4).

A hand-written scanner (str.find and single-character regexes only: linear time, no backtracking) fed
text deltas of any size. It emits OpenAI streaming deltas; text is never re-labelled once sent (possible
tag prefixes are held back), and a tool call is emitted only once its `</tool_call>` is parsed, so a
partial call is never reported and dedupe is exact (D2). A call still open at the end, or a closed one
that cannot be parsed, is kept as content.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.text.toolcalls import (
    argument_fragments,
    coerce_parameter,
    dedupe_key,
    json_variant_call,
    parameter_value_text,
    tool_schemas,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
MAX_NAME = 256  # longest function/parameter name accepted; longer means the call is malformed
_WS = re.compile(r"\s*")
_JSON_OUTSIDE = re.compile(r'"|[{\[]+|[}\]]+|<')  # runs of brackets in one step
_JSON_INSIDE = re.compile(r'["\\]')
_BACKSLASHES = re.compile(r"\\+")


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False  # a closed <tool_call> block could not be parsed: its raw text is in content
    truncated: bool = False  # a call was still open at the end: its raw text is in content (§8.2)
    duplicates_dropped: int = 0  # identical calls removed (§8.4)


class _Chunks:
    """A growing string kept as a list of pieces; every 256 small pieces are joined into one, so a
    long stream fed a few characters at a time keeps few objects alive (linear time, steady per-feed cost)."""

    __slots__ = ("pieces", "mark", "size")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.mark = 0
        self.size = 0

    def append(self, s: str) -> None:
        self.pieces.append(s)
        self.size += len(s)
        if len(self.pieces) - self.mark >= 256:
            tail = "".join(self.pieces[self.mark:])
            del self.pieces[self.mark:]
            self.pieces.append(tail)
            self.mark = len(self.pieces) if len(tail) >= 4096 else self.mark

    def text(self) -> str:
        return "".join(self.pieces)

    def __bool__(self) -> bool:
        return self.size > 0


class _Channel:
    """One text stream (content or reasoning): trailing whitespace is held until non-space text follows,
    so whitespace just before a tag can be dropped without taking back anything already sent."""

    def __init__(self, key: str):
        self.key = key
        self.parts = _Chunks()
        self.pending_ws = _Chunks()
        self.lstrip_newlines = False

    def add(self, text: str, out: list[tuple[str, str]]) -> None:
        if self.lstrip_newlines and text:
            text = text.lstrip("\n")
            if text:
                self.lstrip_newlines = False
        if not text:
            return
        body = text.rstrip()
        if not body:
            self.pending_ws.append(text)
            return
        piece = self.pending_ws.text() + body
        self.pending_ws = _Chunks()
        if len(body) < len(text):
            self.pending_ws.append(text[len(body):])
        self.parts.append(piece)
        out.append((self.key, piece))

    def drop_pending(self) -> None:
        self.pending_ws = _Chunks()

    def release_pending(self, out: list[tuple[str, str]]) -> None:
        if self.pending_ws:
            piece = self.pending_ws.text()
            self.pending_ws = _Chunks()
            self.parts.append(piece)
            out.append((self.key, piece))

    def raw(self, text: str, out: list[tuple[str, str]]) -> None:
        """Text kept verbatim (a malformed or truncated call): whitespace before it is released first."""
        self.release_pending(out)
        self.lstrip_newlines = False
        if text:
            self.parts.append(text)
            out.append((self.key, text))


class OutputParser:
    """Incremental parser for one assistant message.

    thinking_open: the prompt ended inside `<think>` (Qwen3.5/3.6 default generation prompt), so output
    starts as reasoning until `</think>` (§8.3). parse_tool_calls defaults to "tools were given".
    reasoning_format="none": no reasoning separation, `<think>` tags stay in content.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, *, thinking_open: bool = True,
                 parse_tool_calls: bool | None = None, reasoning_format: str = "auto",
                 id_prefix: str | None = None):
        if reasoning_format not in ("auto", "none"):
            raise ValueError(f"reasoning_format: {reasoning_format!r} (auto, none)")
        self._schemas = tool_schemas(tools)
        self._parse_calls = bool(tools) if parse_tool_calls is None else parse_tool_calls
        self._think = reasoning_format == "auto"
        self._id_prefix = uuid.uuid4().hex[:16] if id_prefix is None else id_prefix
        self._content = _Channel("content")
        self._reasoning = _Channel("reasoning_content")
        self._state = "reasoning" if (thinking_open and self._think) else "content"
        self._at_start = True  # nothing but whitespace seen yet (a leading <think> opens reasoning)
        self._buf = ""
        self._i = 0
        self._finished = False
        self._calls: list[dict[str, Any]] = []
        self._keys: set[str] = set()
        self._result = ParsedOutput()
        self._after_call = False
        self._reset_call()

    # ---- public API -----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """Add generated text; returns the OpenAI-style deltas that are now certain."""
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish")
        if not text:
            return []
        self._buf = self._buf[self._i:] + text if self._i else self._buf + text
        self._i = 0
        events: list[tuple[str, Any]] = []
        self._advance(events, final=False)
        return _deltas(events)

    def finish(self) -> list[dict[str, Any]]:
        """End of generation: releases held text; an open call becomes content (§8.2)."""
        if self._finished:
            return []
        events: list[tuple[str, Any]] = []
        self._advance(events, final=True)
        if self._state == "call":
            self._result.truncated = True
            self._content.raw(self._call_ws + self._call_raw.text() + self._buf[self._i:], events)
            self._buf, self._i = "", 0
        if self._state == "reasoning":
            self._reasoning.drop_pending()
        if self._after_call:
            self._content.drop_pending()
        else:
            self._content.release_pending(events)
        self._finished = True
        r = self._result
        r.content = self._content.parts.text()
        r.reasoning_content = self._reasoning.parts.text()
        r.tool_calls = self._calls
        return _deltas(events)

    def result(self) -> ParsedOutput:
        if not self._finished:
            raise RuntimeError("OutputParser.result before finish")
        return self._result

    # ---- scanner --------------------------------------------------------------------------------------
    def _advance(self, ev: list, final: bool) -> None:
        while True:
            if self._state == "call":
                progressed = self._scan_call(ev, final)
            else:
                progressed = self._scan_text(ev, final)
            if not progressed:
                return

    def _scan_text(self, ev: list, final: bool) -> bool:
        buf, i = self._buf, self._i
        if i >= len(buf):
            return False
        if self._state == "reasoning":
            tags: tuple[str, ...] = (THINK_CLOSE,)
            channel = self._reasoning
        else:
            tags = ((CALL_OPEN,) if self._parse_calls else ()) + ((THINK_OPEN,) if self._think else ())
            channel = self._content
        if self._at_start and self._think:  # a leading <think> opens reasoning (or repeats the prompt's)
            m = _WS.match(buf, i)
            if m.end() > i:  # leading whitespace waits in the channel (dropped if <think> follows)
                channel.add(buf[i:m.end()], ev)
                self._i = i = m.end()
            rest = buf[i:i + len(THINK_OPEN)]
            if rest.startswith(THINK_OPEN):
                self._i = i + len(THINK_OPEN)
                channel.drop_pending()
                self._open_reasoning()
                return True
            if not final and THINK_OPEN.startswith(rest):
                return False  # maybe a <think> still arriving (rest is short: no rescanning cost)
        j, tag = _find_first(buf, tags, i)
        if tag is None:
            end = len(buf) if final else len(buf) - _partial_tag_len(buf, tags, i)
            if end > i:
                self._text(channel, buf[i:end], ev)
                self._i = end
            return False
        if j > i:
            self._text(channel, buf[i:j], ev)
        self._i = j + len(tag)
        if tag == THINK_CLOSE:
            self._reasoning.drop_pending()
            self._state = "content"
            self._content.lstrip_newlines = True
        elif tag == THINK_OPEN:
            self._open_reasoning()
        else:  # <tool_call>: whitespace before it is dropped only if the call turns out valid
            call_ws = self._content.pending_ws.text()
            self._content.drop_pending()
            self._state = "call"
            self._reset_call()
            self._call_ws = call_ws
            self._call_raw.append(CALL_OPEN)
        return True

    def _text(self, channel: _Channel, text: str, ev: list) -> None:
        if self._at_start and text.strip():
            self._at_start = False
        if channel is self._content and self._after_call and text.strip():
            self._after_call = False
        channel.add(text, ev)

    def _open_reasoning(self) -> None:
        self._at_start = False
        self._state = "reasoning"
        self._reasoning.lstrip_newlines = True

    # ---- one <tool_call> block ------------------------------------------------------------------------
    def _reset_call(self) -> None:
        self._stage = "open"
        self._call_ws = ""
        self._call_raw = _Chunks()
        self._fname = ""
        self._params: dict[str, Any] = {}
        self._pname = ""
        self._pvalue = _Chunks()
        self._json_depth = 0
        self._json_in_str = False
        self._json_start = 0  # offset in the raw call text where the JSON body begins

    def _take(self, n: int) -> str:
        s = self._buf[self._i:self._i + n]
        self._call_raw.append(s)
        self._i += n
        return s

    def _skip_ws(self) -> None:
        m = _WS.match(self._buf, self._i)
        if m.end() > self._i:
            self._take(m.end() - self._i)

    def _expect(self, options: tuple[str, ...], final: bool) -> str | None | bool:
        """The option starting at the cursor; False if one may still arrive; None if none can."""
        rest = self._buf[self._i:self._i + max(map(len, options))]
        for opt in options:
            if rest.startswith(opt):
                return opt
        if not final and any(opt.startswith(rest) for opt in options):
            return False
        return None

    def _scan_call(self, ev: list, final: bool) -> bool:
        buf, stage = self._buf, self._stage
        if self._i >= len(buf) and stage != "done":
            return False
        if stage in ("open", "params", "close", "jclose"):
            self._skip_ws()
            if self._i >= len(buf):
                return False
            options = {"open": (FUNC_OPEN, "{"), "params": (PARAM_OPEN, FUNC_CLOSE),
                       "close": (CALL_CLOSE,), "jclose": (CALL_CLOSE,)}[stage]
            got = self._expect(options, final)
            if got is False:
                return False
            if got is None:
                self._stage = "skip"
                return True
            self._take(len(got))
            if got == "{":
                self._stage, self._json_depth, self._json_start = "json", 1, self._call_raw.size - 1
            elif got == FUNC_OPEN:
                self._stage = "fname"
            elif got == PARAM_OPEN:
                self._stage = "pname"
            elif got == FUNC_CLOSE:
                self._stage = "close"
            elif stage == "close":
                self._emit_call(self._fname, self._params, ev)
            else:  # jclose
                body = self._call_raw.text()[self._json_start:-len(CALL_CLOSE)]
                parsed = json_variant_call(body.rstrip())
                if parsed is None:
                    self._malformed(ev)
                else:
                    self._emit_call(parsed[0], parsed[1], ev)
            return True
        if stage in ("fname", "pname"):
            j = buf.find(">", self._i, self._i + MAX_NAME + 1)
            if j < 0:
                if len(buf) - self._i > MAX_NAME or final:
                    self._stage = "skip"
                    return True
                return False
            name = self._take(j - self._i).strip()
            self._take(1)
            if not name or "<" in name or "\n" in name:
                self._stage = "skip"
            elif stage == "fname":
                self._fname, self._stage = name, "params"
            else:
                self._pname, self._pvalue, self._stage = name, _Chunks(), "pvalue"
            return True
        if stage == "pvalue":
            j = buf.find(PARAM_CLOSE, self._i)
            if j < 0:
                keep = 0 if final else _partial_tag_len(buf, (PARAM_CLOSE,), self._i)
                if len(buf) - keep > self._i:
                    self._pvalue.append(self._take(len(buf) - keep - self._i))
                return False
            self._pvalue.append(self._take(j - self._i))
            self._take(len(PARAM_CLOSE))
            self._add_param(self._pname, self._pvalue.text())
            self._stage = "params"
            return True
        if stage == "json":
            return self._scan_json(final)
        # skip: a malformed block, kept as content once its </tool_call> arrives
        j = buf.find(CALL_CLOSE, self._i)
        if j < 0:
            keep = 0 if final else _partial_tag_len(buf, (CALL_CLOSE,), self._i)
            if len(buf) - keep > self._i:
                self._take(len(buf) - keep - self._i)
            return False
        self._take(j + len(CALL_CLOSE) - self._i)
        self._malformed(ev)
        return True

    def _scan_json(self, final: bool) -> bool:
        buf = self._buf
        while self._i < len(buf):
            if self._json_in_str:
                m = _JSON_INSIDE.search(buf, self._i)
                if m is None:
                    self._take(len(buf) - self._i)
                    return False
                if m.group() == "\\":
                    run = _BACKSLASHES.match(buf, m.start()).end()
                    if (run - m.start()) % 2:  # odd: the last backslash escapes the next char
                        if run >= len(buf):  # not here yet: keep that backslash until it arrives
                            self._take(run - 1 - self._i)
                            return False
                        run += 1
                    self._take(run - self._i)
                    continue
                self._take(m.end() - self._i)
                self._json_in_str = False
                continue
            m = _JSON_OUTSIDE.search(buf, self._i)
            if m is None:
                self._take(len(buf) - self._i)
                return False
            c = m.group()
            if c == "<":
                self._take(m.start() - self._i)
                got = self._expect((CALL_CLOSE,), final)
                if got is False:
                    return False
                if got == CALL_CLOSE:  # the block closes while the JSON is still open: malformed
                    self._stage = "skip"
                    return True
                self._take(1)
                continue
            if c == '"':
                self._take(m.end() - self._i)
                self._json_in_str = True
            elif c[0] in "{[":
                self._take(m.end() - self._i)
                self._json_depth += len(c)
            elif len(c) < self._json_depth:
                self._take(m.end() - self._i)
                self._json_depth -= len(c)
            else:  # this run of closers ends the object
                self._take(m.start() + self._json_depth - self._i)
                self._json_depth = 0
                self._stage = "jclose"
                return True
        return False

    def _add_param(self, name: str, raw: str) -> None:
        schema_root = self._schemas.get(self._fname) or {}
        props = schema_root.get("properties") if isinstance(schema_root, Mapping) else None
        schema = props.get(name) if isinstance(props, Mapping) else None
        self._params[name] = coerce_parameter(parameter_value_text(raw), schema, schema_root)

    def _malformed(self, ev: list) -> None:
        self._result.malformed = True
        self._content.raw(self._call_ws + self._call_raw.text(), ev)
        self._end_call()

    def _emit_call(self, name: str, arguments: Mapping[str, Any], ev: list) -> None:
        fragments = argument_fragments(arguments)
        text = "".join(fragments)
        key = dedupe_key(name, text)
        if key in self._keys:
            self._result.duplicates_dropped += 1  # §8.4: keep the first identical call of this message
        else:
            self._keys.add(key)
            index = len(self._calls)
            call_id = f"call_{self._id_prefix}{index}"
            self._calls.append({"id": call_id, "type": "function",
                                "function": {"name": name, "arguments": text}})
            ev.append(("call", (index, call_id, name, fragments)))
        self._end_call()

    def _end_call(self) -> None:
        self._reset_call()
        self._state = "content"
        self._after_call = True


def _find_first(buf: str, tags: tuple[str, ...], start: int) -> tuple[int, str | None]:
    best, best_tag = -1, None
    for tag in tags:
        j = buf.find(tag, start) if best < 0 else buf.find(tag, start, best + len(tag))
        if j >= 0 and (best < 0 or j < best):
            best, best_tag = j, tag
    return best, best_tag


def _partial_tag_len(buf: str, tags: tuple[str, ...], start: int) -> int:
    """Length of the longest tail of buf[start:] that is a proper prefix of one of the tags."""
    longest = max((len(t) for t in tags), default=0)
    for k in range(min(longest - 1, len(buf) - start), 0, -1):
        tail = buf[len(buf) - k:]
        if any(t.startswith(tail) for t in tags):
            return k
    return 0


def _deltas(events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for kind, value in events:
        if kind == "call":
            index, call_id, name, fragments = value
            out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            out.extend({"tool_calls": [{"index": index, "function": {"arguments": f}}]} for f in fragments)
        elif out and kind in out[-1] and len(out[-1]) == 1 and isinstance(out[-1][kind], str):
            out[-1][kind] += value
        else:
            out.append({kind: value})
    return out


def parse_output(text: str, tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> ParsedOutput:
    """One-shot parse of a whole assistant message (same result as feeding it in any chunks)."""
    parser = OutputParser(tools, **options)
    parser.feed(text)
    parser.finish()
    return parser.result()
