"""The OpenAI-compatible HTTP app: routes over the slot scheduler (spec/mtp-speculation.md §6, §7).

A thin adapter: validate (requests.py), render the prompt (chat.py), submit to the scheduler, turn its
events into OpenAI JSON or SSE chunks. Every error leaves OpenAI-shaped; no request can stop the
engine thread or the process (reliability-matrix E10).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

import prometheus_client
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.server.bridge import EventBridge
from app.server.chat import ChatText, OutputParser
from app.server.errors import ApiError, bad_request, error_body
from app.server.guard import GuardMiddleware
from app.server.jsonbody import parse_json_object
from app.server.metrics import CONTENT_TYPE, ServerMetrics
from app.server.requests import ApiRequest, Limits, parse_chat, parse_completion
from engine.errors import MtpchatError
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.types import Assigned, Finished, GenerationRequest, TextDelta

log = logging.getLogger("mtpchat.server")
DISCONNECT_POLL_S = 0.25


@dataclass
class ServerConfig:
    alias: str
    model_path: str
    n_parallel: int
    n_ctx_slot: int
    n_vocab: int
    model_meta: dict
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    slots_endpoint: bool = True


class ServerState:
    def __init__(self, cfg: ServerConfig, scheduler: Scheduler, chat: ChatText):
        self.cfg = cfg
        self.scheduler = scheduler
        self.chat = chat
        self.created = int(time.time())
        self.limits = Limits(n_ctx_slot=cfg.n_ctx_slot, n_vocab=cfg.n_vocab, n_parallel=cfg.n_parallel,
                             aliases=(cfg.alias,))
        prometheus_client.disable_created_metrics()
        self.metrics = ServerMetrics(scheduler, cfg.alias)
        scheduler.add_listener(self.metrics.on_event)


# ---------------------------------------------------------------------------------------------- app

# Every route the app serves: (method, path, handler). The guard denies all but GET /health without the
# key; tests enumerate this table (reliability-matrix E4).
ROUTES = (
    ("GET", "/health", "health"),
    ("GET", "/v1/models", "models"),
    ("GET", "/models", "models"),
    ("GET", "/slots", "slots"),
    ("GET", "/metrics", "metrics"),
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("POST", "/chat/completions", "chat_completions"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/completions", "completions"),
)

def build_app(state: ServerState) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        cfg = state.cfg
        base = {"object": "model", "created": state.created, "owned_by": "mtpchat", "max_model_len": cfg.n_ctx_slot}
        data = [{"id": cfg.alias, **base, "meta": dict(cfg.model_meta)}]
        for i in range(cfg.n_parallel):
            data.append({"id": f"{cfg.alias}-slot{i}", **base, "meta": {**cfg.model_meta, "slot_pinned": i}})
        return JSONResponse({"object": "list", "data": data})

    async def slots(request: Request) -> Response:
        if not state.cfg.slots_endpoint:
            raise ApiError(404, "slots: this endpoint is disabled (--no-slots)")
        snaps = await asyncio.to_thread(state.scheduler.slots)
        return JSONResponse([s.as_dict() for s in snaps])

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    async def chat_completions(request: Request) -> Response:
        body = parse_json_object(await request.body())
        req = parse_chat(body, state.limits)
        return await _generate(state, request, req)

    async def completions(request: Request) -> Response:
        body = parse_json_object(await request.body())
        req = parse_completion(body, state.limits)
        return await _generate(state, request, req)

    handlers = {"health": health, "models": models, "slots": slots, "metrics": metrics,
                "chat_completions": chat_completions, "completions": completions}
    routes = [Route(path, handlers[name], methods=[method]) for method, path, name in ROUTES]

    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        msg = {404: f"{request.url.path}: no such route", 405: f"{request.method} {request.url.path}: "
               "method not allowed"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, msg).response()

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    app = Starlette(routes=routes, exception_handlers={
        ApiError: api_error, HTTPException: http_error, Exception: internal_error})
    app.state.mtpchat = state
    cfg = state.cfg
    return GuardMiddleware(app, allowed_hosts=frozenset(cfg.allowed_hosts), cors_origins=frozenset(cfg.cors_origins),
                           api_key=cfg.api_key)


# ---------------------------------------------------------------------------------------------- generation

def _to_generation(state: ServerState, req: ApiRequest, prompt: list[int], boundaries: tuple[int, ...]
                   ) -> GenerationRequest:
    n_ctx = state.cfg.n_ctx_slot
    if len(prompt) >= n_ctx:
        raise bad_request(f"prompt: {len(prompt)} tokens do not fit the slot context of {n_ctx} tokens",
                          param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else n_ctx - len(prompt)
    if len(prompt) + max_tokens > n_ctx:
        raise bad_request(f"max_tokens: {len(prompt)} prompt tokens + {max_tokens} exceed the slot context of "
                          f"{n_ctx} tokens", param="max_tokens", code="context_length_exceeded")
    s = req.sampling
    return GenerationRequest(
        prompt=tuple(prompt), max_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        min_p=s.min_p, seed=s.seed, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repeat_penalty=s.repeat_penalty, logit_bias=tuple(sorted(s.logit_bias.items())), stop=req.stop,
        mtp=req.mtp, n_draft=req.n_draft, mtp_adaptive=req.mtp_adaptive, slot=req.slot,
        checkpoint_at=boundaries, ignore_eos=req.ignore_eos)


async def _generate(state: ServerState, request: Request, req: ApiRequest) -> Response:
    try:
        thinking_open = False
        if req.kind == "chat":
            prompt, boundaries, thinking_open = await asyncio.to_thread(state.chat.render, req)
        else:
            prompt = state.chat.encode_prompt(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
            boundaries = ()
        greq = _to_generation(state, req, prompt, boundaries)
        parser = state.chat.output_parser(req, thinking_open) if req.kind == "chat" else None
    except MtpchatError as exc:
        raise bad_request(str(exc), param="messages" if req.kind == "chat" else "prompt") from None
    bridge = EventBridge(asyncio.get_running_loop())
    try:
        handle = state.scheduler.submit(greq, sink=bridge.put)
    except MtpchatError as exc:
        raise bad_request(str(exc)) from None
    state.metrics.submitted(handle.task)
    rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    model = req.model or state.cfg.alias
    try:
        # Wait for the slot (or a refusal) before answering, so that errors keep their status.
        first = await _next_event(bridge, request, handle)
        if first is None:
            return Response(status_code=499)
        if isinstance(first, Finished) and first.error:
            raise ApiError(first.error_status or 500, first.error,
                           type_="server_error" if first.error_status >= 500 else None)
    except BaseException:
        handle.cancel()
        raise
    ids = {"X-Mtpchat-Task": str(handle.task)}
    if isinstance(first, Assigned):
        ids["X-Mtpchat-Slot"] = str(first.slot)
    if req.stream:
        gen = _stream(state, request, req, handle, bridge, first, parser, rid, model)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **ids})
    try:
        resp = await _complete(request, req, handle, bridge, first, parser, rid, model)
        resp.headers.update(ids)
        return resp
    finally:
        handle.cancel()  # no-op when finished; frees the slot when the client went away


async def _next_event(bridge: EventBridge, request: Request, handle):
    """Next event, or None once the client has disconnected (the request is then cancelled). The
    connection is checked at least every DISCONNECT_POLL_S, also while events keep arriving."""
    now = time.monotonic()
    last = request.scope.setdefault("mtpchat.disconnect_checked", now)
    while True:
        if time.monotonic() - last >= DISCONNECT_POLL_S:
            last = request.scope["mtpchat.disconnect_checked"] = time.monotonic()
            if await request.is_disconnected():
                handle.cancel()
                return None
        ev = await bridge.get(DISCONNECT_POLL_S)
        if ev is not None:
            return ev


def _timings_and_usage(fin: Finished) -> tuple[dict, dict]:
    usage = {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
             "total_tokens": fin.prompt_tokens + fin.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": fin.timings.cache_n}}
    return fin.timings.as_dict(), usage


async def _complete(request, req, handle, bridge, ev, parser: OutputParser | None, rid, model) -> Response:
    text: list[str] = []
    tokens: list[int] = []
    fin = None
    while ev is not None:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
            tokens.extend(ev.token_ids)
        elif isinstance(ev, Finished):
            fin = ev
            break
        ev = await _next_event(bridge, request, handle)
    if fin is None:
        return Response(status_code=499)
    if fin.error:
        raise ApiError(fin.error_status or 500, fin.error, type_="server_error")
    timings, usage = _timings_and_usage(fin)
    full = "".join(text)
    reason = _finish_reason(fin)
    extra = {"tokens": tokens} if req.return_tokens else {}
    if req.kind == "completion":
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                             "choices": [{"index": 0, "text": full, "finish_reason": reason, "logprobs": None}],
                             "usage": usage, "timings": timings, "id_slot": fin.slot, **extra})
    msg = parser.parse_full(full)
    message: dict = {"role": "assistant", "content": msg.content or None if msg.tool_calls else msg.content}
    if msg.reasoning:
        message["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        message["tool_calls"] = msg.tool_calls
        if reason == "stop":
            reason = "tool_calls"
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                         "choices": [{"index": 0, "message": message, "finish_reason": reason}],
                         "usage": usage, "timings": timings, "id_slot": fin.slot, **extra})


def _finish_reason(fin: Finished) -> str:
    return "length" if fin.finish_reason == "length" else "stop"


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(state, request, req, handle, bridge, ev, parser: OutputParser | None, rid, model):
    created = int(time.time())
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict, **extra) -> bytes:
        return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra})

    try:
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        had_tools = False
        while ev is not None:
            if isinstance(ev, TextDelta) and ev.text:
                if chat:
                    for delta in parser.feed(ev.text):
                        had_tools |= "tool_calls" in delta
                        yield chunk({"index": 0, "delta": delta, "finish_reason": None})
                else:
                    yield chunk({"index": 0, "text": ev.text, "finish_reason": None, "logprobs": None})
            elif isinstance(ev, Finished):
                if ev.error:
                    yield _sse(error_body(ev.error, "server_error"))
                    yield _sse("[DONE]")
                    return
                if ev.finish_reason == "cancelled":
                    return
                timings, usage = _timings_and_usage(ev)
                reason = _finish_reason(ev)
                if chat:
                    for delta in parser.finish():
                        had_tools |= "tool_calls" in delta
                        yield chunk({"index": 0, "delta": delta, "finish_reason": None})
                    if had_tools and reason == "stop":
                        reason = "tool_calls"
                    yield chunk({"index": 0, "delta": {}, "finish_reason": reason}, timings=timings, id_slot=ev.slot)
                else:
                    yield chunk({"index": 0, "text": "", "finish_reason": reason, "logprobs": None},
                                timings=timings, id_slot=ev.slot)
                if req.include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": usage})
                yield _sse("[DONE]")
                return
            ev = await bridge.get(None)
    finally:
        handle.cancel()
