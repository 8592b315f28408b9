"""Chat prompts: the GGUF's `tokenizer.chat_template` rendered exactly as HF `apply_chat_template` does,
and told apart into template scaffolding and message text (rows B1-B5, spec/mtp-speculation.md §8.1).

Message text never becomes an added token (B4): before rendering, every added-token string inside any
string the caller supplies is wrapped in private-use markers; after rendering the markers split the prompt
into pieces, and `Tokenizer.encode_chat` matches added tokens only in the template's own pieces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import InputError, TemplateError
from engine.text.sandbox import DEFAULT_OUTPUT_LIMIT, DEFAULT_TIME_LIMIT_S, compile_template, render_limited

# Private-use code points (plane 16) used as markers; removed from every caller string before marking.
MARK_OPEN, MARK_CLOSE, MARK_BREAK = "\U0010fff0", "\U0010fff1", "\U0010fff2"
_MARKERS = MARK_OPEN + MARK_CLOSE + MARK_BREAK
_STRIP_MARKERS = {ord(c): None for c in _MARKERS}

# B5: the only caller-settable template variables, with their types (what the Qwen3.5/3.6 templates read).
TEMPLATE_KWARGS: dict[str, type] = {
    "enable_thinking": bool,    # False: generation prompt closes <think> at once (§8.1)
    "preserve_thinking": bool,  # Qwen3.6: keep reasoning of every assistant turn
    "add_vision_id": bool,      # "Picture N: " labels before image parts
}
_ROLES = ("system", "user", "assistant", "tool")


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """B5: only whitelisted keys with the right type; anything else is an InputError naming the key."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InputError(f"chat_template_kwargs: expected an object, got {type(kwargs).__name__}")
    out = {}
    for key, value in kwargs.items():
        want = TEMPLATE_KWARGS.get(key) if isinstance(key, str) else None
        if want is None:
            allowed = ", ".join(TEMPLATE_KWARGS)
            raise InputError(f"chat_template_kwargs.{key}: not an allowed template variable (allowed: {allowed})")
        if type(value) is not want:
            raise InputError(f"chat_template_kwargs.{key}: expected {want.__name__}, got {type(value).__name__}")
        out[key] = value
    return out


@dataclass(frozen=True)
class RenderedPrompt:
    text: str  # the prompt exactly as HF apply_chat_template(tokenize=False) renders it
    pieces: tuple[tuple[str, bool], ...]  # (text, from_template); content's added-token text has False


class ChatTemplate:
    """A compiled chat template plus the added-token texts that message content must never produce."""

    def __init__(self, source: str, added_tokens: Iterable[str] = (), *, bos_token: str = "",
                 eos_token: str = "", time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 output_limit: int = DEFAULT_OUTPUT_LIMIT):
        self.source = source
        self._template = compile_template(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.time_limit_s, self.output_limit = time_limit_s, output_limit
        tokens = sorted({t for t in added_tokens if t}, key=len, reverse=True)
        self._token_re = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        self._prefixes = {t[:k] for t in tokens for k in range(1, len(t))}
        self._suffixes = {t[k:] for t in tokens for k in range(1, len(t))}
        self._max_token = max((len(t) for t in tokens), default=0)
        alt = "|".join(map(re.escape, tokens)) or "(?!)"
        self._split_re = re.compile(f"{MARK_OPEN}({alt}){MARK_CLOSE}|[{_MARKERS}]")

    @classmethod
    def from_tokenizer_metadata(cls, md: Mapping[str, Any], tokenizer: Any = None, **limits: Any) -> ChatTemplate:
        source = md.get("tokenizer.chat_template")
        if not isinstance(source, str) or not source:
            raise TemplateError("chat template: the model file has no tokenizer.chat_template")
        if tokenizer is not None:
            added = list(tokenizer.added_tokens)
            sp = tokenizer.special
            bos = tokenizer.piece(sp.bos) if sp.bos is not None else ""
            eos = tokenizer.piece(sp.eos) if sp.eos is not None else ""
        else:  # no tokenizer built (e.g. `mtpchat template`): the same facts straight from the metadata
            tokens = md.get("tokenizer.ggml.tokens") or []
            types = md.get("tokenizer.ggml.token_type") or []
            added = [t for t, ty in zip(tokens, types, strict=False) if ty in (3, 4)]  # CONTROL, USER_DEFINED

            def text_of(key: str) -> str:
                i = md.get(key)
                return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

            bos, eos = text_of("tokenizer.ggml.bos_token_id"), text_of("tokenizer.ggml.eos_token_id")
        return cls(source, added, bos_token=bos, eos_token=eos, **limits)

    @classmethod
    def bundled(cls, name: str = "qwen35", added_tokens: Iterable[str] = (), **kwargs: Any) -> ChatTemplate:
        """A template shipped with mtpchat (B1: what the app offers when a file's own template is rejected).
        name: "qwen35" (Qwen3.5, = llama.cpp models/templates/Qwen3.5-4B.jinja) or "qwen36" (Qwen3.6)."""
        return cls(bundled_template_source(name), added_tokens, **kwargs)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               *, add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None
               ) -> RenderedPrompt:
        kwargs = check_template_kwargs(template_kwargs)
        msgs = [self._mark(m) for m in normalize_messages(messages)]
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise InputError("tools: expected a list of objects")
            tools = self._mark(_plain(tools, "tools"))
        context = {"messages": msgs, "tools": tools, "add_generation_prompt": bool(add_generation_prompt),
                   "bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        marked = render_limited(self._template, context, time_limit_s=self.time_limit_s,
                                output_limit=self.output_limit)
        return self._pieces(marked)

    # ---- B4 marking -----------------------------------------------------------------------------------
    def _mark(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self._mark_str(obj)
        if isinstance(obj, dict):
            return {self._mark(k): self._mark(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._mark(v) for v in obj]
        return obj

    def _mark_str(self, s: str) -> str:
        if not s:
            return s
        s = s.translate(_STRIP_MARKERS)
        if self._token_re is None:
            return s
        s = self._token_re.sub(lambda m: MARK_OPEN + m.group() + MARK_CLOSE, s)
        # Text that ends with the start of a token (or starts with its end) must not join template text
        # into one: "</tool_call" + the template's ">" would otherwise become </tool_call>.
        n = min(self._max_token - 1, len(s))
        if any(s[-k:] in self._prefixes for k in range(1, n + 1)):
            s += MARK_BREAK
        if any(s[:k] in self._suffixes for k in range(1, n + 1)):
            s = MARK_BREAK + s
        return s

    def _pieces(self, marked: str) -> RenderedPrompt:
        pieces: list[tuple[str, bool]] = []
        text: list[str] = []
        pos = 0
        for m in self._split_re.finditer(marked):
            if m.start() > pos:
                pieces.append((marked[pos:m.start()], True))
            if m.group(1) is not None:
                pieces.append((m.group(1), False))
            pos = m.end()
        if pos < len(marked):
            pieces.append((marked[pos:], True))
        text = "".join(p for p, _ in pieces)
        return RenderedPrompt(text=text, pieces=tuple(pieces))


BUNDLED_TEMPLATES = {"qwen35": "qwen35.jinja", "qwen35moe": "qwen35.jinja", "qwen36": "qwen36.jinja"}


def bundled_template_source(name: str) -> str:
    file = BUNDLED_TEMPLATES.get(name)
    if file is None:
        raise InputError(f"chat template: no bundled template named {name!r} ({', '.join(BUNDLED_TEMPLATES)})")
    return (Path(__file__).resolve().parent / "templates" / file).read_text(encoding="utf-8")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain JSON copies of the messages, shaped as HF's apply_chat_template passes them to templates:
    keys with None values dropped, `reasoning` aliased to `reasoning_content`, tool-call arguments given as
    a JSON string parsed to an object, and an assistant turn's `<think>…</think>` split into
    reasoning_content exactly as the Qwen template itself would (so its markers cannot shift whitespace)."""
    if not isinstance(messages, list):
        raise InputError(f"messages: expected a list, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InputError(f"{where}: expected an object, got {type(message).__name__}")
        m = {k: v for k, v in _plain(message, where).items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str):
            raise InputError(f"{where}.role: missing or not a string")
        if role not in _ROLES:
            raise InputError(f"{where}.role: {role!r} is not one of {', '.join(_ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InputError(f"{where}.content: expected a string or a list of parts")
        if "reasoning_content" not in m and isinstance(m.get("reasoning"), str):
            m["reasoning_content"] = m["reasoning"]
        if role == "assistant":
            _split_reasoning(m)
            if "tool_calls" in m:
                m["tool_calls"] = _normalize_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(m)
    return out


def _split_reasoning(m: dict[str, Any]) -> None:
    content = m.get("content")
    if isinstance(m.get("reasoning_content"), str) or not isinstance(content, str):
        return
    trimmed = content.strip()
    if "</think>" not in trimmed:
        return
    m["reasoning_content"] = trimmed.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    m["content"] = trimmed.split("</think>")[-1].lstrip("\n")


def _normalize_tool_calls(calls: Any, where: str) -> list[Any]:
    if not isinstance(calls, list):
        raise InputError(f"{where}: expected a list")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise InputError(f"{where}[{j}]: expected an object")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InputError(f"{where}[{j}].function.name: missing or not a string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                raise InputError(f"{where}[{j}].function.arguments: not valid JSON") from None
            if not isinstance(parsed, dict):
                raise InputError(f"{where}[{j}].function.arguments: not a JSON object")
            fn = {**fn, "arguments": parsed}
            call = {**call, "function": fn} if "function" in call else fn
        out.append(call)
    return out


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A copy made only of JSON types (nothing with methods the sandbox does not know)."""
    if depth > 64:
        raise InputError(f"{where}: nested too deeply")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InputError(f"{where}: object keys must be strings")
            out[str.__str__(k)] = _plain(v, f"{where}.{k}", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise InputError(f"{where}: {type(value).__name__} is not a JSON value")
