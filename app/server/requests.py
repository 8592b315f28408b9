"""Validation of /v1/chat/completions and /v1/completions bodies into one typed request.

Every field is checked for type and range before any work (reliability-matrix E5); the message
shapes are checked so that nothing malformed reaches the template or the engine (E6). Errors name the
field in `param`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from app.server.errors import ApiError, bad_request
from app.server.pinning import resolve_pin

MTP_MODES = ("off", "on", "adaptive", "auto")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_DRAFT = 16


@dataclass(frozen=True)
class Limits:
    n_ctx_slot: int
    n_vocab: int
    n_parallel: int
    aliases: tuple[str, ...]


@dataclass
class Sampling:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class ApiRequest:
    kind: str                              # "chat" | "completion"
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    sampling: Sampling
    slot: int | None                       # pinned slot, None = any
    mtp: str | None                        # per-request mode, None = server default
    n_draft: int | None
    n_draft_min: int | None
    mtp_adaptive: bool | None              # the seed's flat key "speculative.mtp_adaptive"
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    enable_thinking: bool | None = None
    ignore_eos: bool = False
    return_tokens: bool = False
    prompt: str | list[int] | None = None


# ---------------------------------------------------------------- scalar checks

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def opt_int(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"{key}: must be an integer, got {_kind(v)}", param=key)
    if not lo <= v <= hi:
        raise bad_request(f"{key}: {v} is out of range [{lo}, {hi}]", param=key)
    return v


def opt_num(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise bad_request(f"{key}: must be a finite number, got {_kind(v)}", param=key)
    ok = (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise bad_request(f"{key}: {v} is out of range {interval}", param=key)
    return float(v)


def opt_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(f"{key}: must be a boolean, got {_kind(v)}", param=key)
    return v


def opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"{key}: must be a string, got {_kind(v)}", param=key)
    return v


def _kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number" if math.isfinite(v) else "non-finite number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


# ---------------------------------------------------------------- common fields

def _common(body: dict, lim: Limits, kind: str, default_max_tokens: int | None) -> ApiRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model: must be a string, got {_kind(model)}", param="model")
    slot = resolve_pin(body, lim.aliases, lim.n_parallel)
    stream = bool(opt_bool(body, "stream"))
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options: must be an object", param="stream_options")
        include_usage = bool(opt_bool(so, "include_usage"))
    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        if key == "n_predict" and body.get(key) == -1:
            continue  # llama.cpp's "until the context is full"
        v = opt_int(body, key, 1, lim.n_ctx_slot)
        if v is not None and max_tokens is None:
            max_tokens = v
    if max_tokens is None:
        max_tokens = default_max_tokens
    n = opt_int(body, "n", 1, 1)
    del n
    stop = _stop(body.get("stop"))
    sampling = Sampling()
    t = opt_num(body, "temperature", 0.0, 2.0)
    if t is not None:
        sampling.temperature = t
    p = opt_num(body, "top_p", 0.0, 1.0, lo_open=True)
    if p is not None:
        sampling.top_p = p
    k = opt_int(body, "top_k", 0, lim.n_vocab)
    if k is not None:
        sampling.top_k = k
    mp = opt_num(body, "min_p", 0.0, 1.0)
    if mp is not None:
        sampling.min_p = mp
    sampling.seed = opt_int(body, "seed", 0, 2**63 - 1)
    for key, attr in (("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty")):
        v = opt_num(body, key, -2.0, 2.0)
        if v is not None:
            setattr(sampling, attr, v)
    for key in ("repeat_penalty", "repetition_penalty"):
        v = opt_num(body, key, 0.0, 10.0, lo_open=True)
        if v is not None:
            sampling.repeat_penalty = v
    sampling.logit_bias = _logit_bias(body.get("logit_bias"), lim.n_vocab)
    if opt_bool(body, "logprobs"):
        raise bad_request("logprobs: not supported by this server", param="logprobs", code="unsupported_parameter")
    if opt_int(body, "top_logprobs", 0, 20):
        raise bad_request("top_logprobs: not supported by this server", param="top_logprobs",
                          code="unsupported_parameter")
    mtp = opt_str(body, "mtp")
    if mtp is not None and mtp not in MTP_MODES:
        raise bad_request(f"mtp: {mtp!r} is not one of {', '.join(MTP_MODES)}", param="mtp")
    mtp_adaptive = opt_bool(body, "speculative.mtp_adaptive")
    n_draft = opt_int(body, "speculative.n_max", 0, MAX_DRAFT)
    n_draft_min = opt_int(body, "speculative.n_min", 0, MAX_DRAFT)
    if n_draft is not None and n_draft_min is not None and n_draft_min > n_draft:
        raise bad_request(f"speculative.n_min: {n_draft_min} exceeds speculative.n_max {n_draft}",
                          param="speculative.n_min")
    opt_num(body, "speculative.p_min", 0.0, 1.0)
    spec = body.get("speculative")
    if spec is not None:
        if not isinstance(spec, dict):
            raise bad_request("speculative: must be an object", param="speculative")
        v = opt_bool(spec, "mtp_adaptive")
        if v is not None:
            mtp_adaptive = v
        v = opt_int(spec, "n_max", 0, MAX_DRAFT)
        if v is not None:
            n_draft = v
    return ApiRequest(kind=kind, model=model, stream=stream, include_usage=include_usage,
                      max_tokens=max_tokens, stop=stop, sampling=sampling, slot=slot, mtp=mtp,
                      n_draft=n_draft, n_draft_min=n_draft_min, mtp_adaptive=mtp_adaptive,
                      ignore_eos=bool(opt_bool(body, "ignore_eos")),
                      return_tokens=bool(opt_bool(body, "return_tokens")))


def _stop(v: object) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise bad_request(f"stop: must be a string or an array of strings, got {_kind(v)}", param="stop")
    if len(v) > MAX_STOP:
        raise bad_request(f"stop: {len(v)} strings, at most {MAX_STOP}", param="stop")
    for s in v:
        if not isinstance(s, str):
            raise bad_request(f"stop: every entry must be a string, got {_kind(s)}", param="stop")
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise bad_request(f"stop: strings must have 1..{MAX_STOP_CHARS} characters, got {len(s)}",
                              param="stop")
    return tuple(v)


def _logit_bias(v: object, n_vocab: int) -> dict[int, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request("logit_bias: must be an object of token id -> bias", param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: {len(v)} entries, at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 9 or int(key) >= n_vocab:
            raise bad_request(f"logit_bias: token id {key!r} is not in [0, {n_vocab})", param="logit_bias")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias: bias for {key} must be a number in [-100, 100]", param="logit_bias")
        out[int(key)] = float(bias)
    return out


# ---------------------------------------------------------------- chat

def parse_chat(body: dict, lim: Limits) -> ApiRequest:
    req = _common(body, lim, "chat", None)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: must be a non-empty array of message objects", param="messages")
    req.messages = [_message(m, i) for i, m in enumerate(msgs)]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools: must be an array", param="tools")
        req.tools = [_tool(t, i) for i, t in enumerate(tools)] or None
    tc = body.get("tool_choice")
    if tc is not None:
        if isinstance(tc, str):
            if tc not in ("none", "auto", "required"):
                raise bad_request(f"tool_choice: {tc!r} is not none, auto, required or a function",
                                  param="tool_choice")
        elif isinstance(tc, dict):
            fn = tc.get("function")
            if tc.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                  param="tool_choice")
            names = {t["function"]["name"] for t in req.tools or []}
            if fn["name"] not in names:
                raise bad_request(f"tool_choice: function {fn['name']!r} is not among the tools",
                                  param="tool_choice")
        else:
            raise bad_request("tool_choice: must be a string or an object", param="tool_choice")
        req.tool_choice = tc
    ptc = opt_bool(body, "parallel_tool_calls")
    if ptc is not None:
        req.parallel_tool_calls = ptc
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad_request("response_format: only {\"type\": \"text\"} is supported", param="response_format",
                          code="unsupported_parameter")
    ctk = body.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise bad_request("chat_template_kwargs: must be an object", param="chat_template_kwargs")
        unknown = sorted(set(ctk) - {"enable_thinking"})
        if unknown:
            raise bad_request(f"chat_template_kwargs: unsupported key {unknown[0]!r} (allowed: enable_thinking)",
                              param="chat_template_kwargs")
        req.enable_thinking = opt_bool(ctk, "enable_thinking")
    return req


def _message(m: object, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{param}: must be an object", param=param)
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role: {role!r} is not one of {', '.join(ROLES)}", param=f"{param}.role")
    out: dict = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    if content is None:
        if role != "assistant" or not m.get("tool_calls"):
            raise bad_request(f"{param}.content: required for role {role}", param=f"{param}.content")
        out["content"] = ""
    elif isinstance(content, str):
        out["content"] = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", param=f"{param}.content")
            parts.append(part["text"])
        out["content"] = "".join(parts)
    else:
        raise bad_request(f"{param}.content: must be a string, an array of text parts or null",
                          param=f"{param}.content")
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"{param}.name: must be a string", param=f"{param}.name")
        out["name"] = name
    rc = m.get("reasoning_content")
    if rc is not None:
        if not isinstance(rc, str):
            raise bad_request(f"{param}.reasoning_content: must be a string", param=f"{param}.reasoning_content")
        if role == "assistant":
            out["reasoning_content"] = rc
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad_request(f"{param}.tool_calls: must be an array", param=f"{param}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        tcid = m.get("tool_call_id")
        if tcid is not None and not isinstance(tcid, str):
            raise bad_request(f"{param}.tool_call_id: must be a string", param=f"{param}.tool_call_id")
        if tcid is not None:
            out["tool_call_id"] = tcid
    return out


def _tool_call(c: object, param: str) -> dict:
    if not isinstance(c, dict):
        raise bad_request(f"{param}: must be an object", param=param)
    fn = c.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{param}.function.name: required string", param=param)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        import json
        try:
            args_obj = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{param}.function.arguments: not valid JSON", param=param) from None
    elif isinstance(args, dict):
        args_obj = args
    else:
        raise bad_request(f"{param}.function.arguments: must be a JSON string or an object", param=param)
    if not isinstance(args_obj, dict):
        raise bad_request(f"{param}.function.arguments: must encode a JSON object", param=param)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args_obj}}
    if isinstance(c.get("id"), str):
        out["id"] = c["id"]
    return out


def _tool(t: object, i: int) -> dict:
    param = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise bad_request(f"{param}: expected {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 256:
        raise bad_request(f"{param}.function.name: required string of 1..256 characters", param="tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{param}.function.description: must be a string", param="tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{param}.function.parameters: must be a JSON Schema object", param="tools")
    out = {"type": "function", "function": {"name": name}}
    if desc is not None:
        out["function"]["description"] = desc
    if params is not None:
        out["function"]["parameters"] = params
    return out


# ---------------------------------------------------------------- completions

def parse_completion(body: dict, lim: Limits) -> ApiRequest:
    req = _common(body, lim, "completion", 16)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt: must not be empty", param="prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < lim.n_vocab]
        if bad:
            raise bad_request(f"prompt: token id {bad[0]} is not in [0, {lim.n_vocab})", param="prompt")
    else:
        raise bad_request("prompt: must be a non-empty string or a non-empty array of token ids", param="prompt")
    if body.get("echo") is True:
        raise bad_request("echo: not supported by this server", param="echo", code="unsupported_parameter")
    if body.get("suffix") is not None:
        raise bad_request("suffix: not supported by this server", param="suffix", code="unsupported_parameter")
    req.prompt = prompt
    return req


__all__ = ["ApiError", "ApiRequest", "Limits", "Sampling", "parse_chat", "parse_completion"]
