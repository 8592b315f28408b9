"""The server's front door, as one ASGI middleware that runs before routing (reliability-matrix E2-E5).

Order: Host header (DNS rebinding, 403) -> Origin (no CORS reflection, 403) -> API key (deny by default,
only `GET /health` public, 401) -> POST content type (415) -> body size (413, also while reading chunked
bodies). It never logs the key.
"""

from __future__ import annotations

import hmac
import ipaddress

from app.server.errors import ApiError

MAX_BODY_BYTES = 16 * 1024 * 1024
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
PUBLIC_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})


class BodyTooLarge(ApiError):
    """Raised from inside the app while reading a body past the limit; the app's ApiError handler
    answers it (413) after the rest of the body has been drained."""


def host_name(value: str) -> str | None:
    """The host part of a Host header (port dropped, lower-cased), or None when malformed."""
    value = value.strip()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1:]
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    else:
        name, _, port = value.partition(":")
        rest = ":" + port if _ else ""
        if not name:
            return None
    if rest and not (rest.startswith(":") and rest[1:].isdigit() and len(rest) <= 6):
        return None
    return name.lower()


def canonical_ipv6(name: str) -> str:
    """`[0:0::1]` -> `[::1]` so that every spelling of the loopback address is accepted."""
    if name.startswith("[") and name.endswith("]"):
        try:
            return "[" + ipaddress.IPv6Address(name[1:-1]).compressed + "]"
        except ValueError:
            return name
    return name


class GuardMiddleware:
    def __init__(self, app, *, allowed_hosts: frozenset[str] = frozenset(), cors_origins: frozenset[str] = frozenset(),
                 api_key: str | None = None, max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.allowed_hosts = LOOPBACK_HOSTS | {canonical_ipv6(h.lower()) for h in allowed_hosts}
        self.cors_origins = frozenset(cors_origins)
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, list[str]] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))
        method, path = scope["method"], scope["path"]
        origin_hdrs = headers.get("origin", [])
        origin = origin_hdrs[0] if len(origin_hdrs) == 1 else None
        cors_ok = origin is not None and origin in self.cors_origins
        extra: list[tuple[bytes, bytes]] = []
        if cors_ok:
            extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        try:
            self._check_host(headers.get("host", []))
            if origin_hdrs and not cors_ok:
                raise ApiError(403, "origin: cross-origin requests from this origin are not allowed "
                                    "(configure --cors-origin)", param="origin")
            if method == "OPTIONS" and cors_ok:
                return await self._preflight(send, extra)
            if self.api_key is not None and (method, path) not in PUBLIC_ROUTES:
                self._check_key(headers.get("authorization", []))
            if method == "POST":
                self._check_post(headers)
        except ApiError as exc:
            hdrs = dict((k.decode(), v.decode()) for k, v in extra)
            if exc.status == 401:
                hdrs["WWW-Authenticate"] = "Bearer"
            if exc.status == 413:
                await self._drain(receive, 0)
            return await exc.response(hdrs)(scope, receive, send)

        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    if message.get("more_body", False):
                        await self._drain(receive, received)
                    raise BodyTooLarge(413, f"request body: larger than {self.max_body} bytes",
                                       code="request_too_large")
            return message

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                if extra:
                    message = dict(message)
                    message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        await self.app(scope, limited_receive, send_with_cors)

    async def _drain(self, receive, already: int) -> None:
        """Read and discard an oversized body (up to 4x the limit, never stored) so that the client,
        still uploading, gets the 413 instead of a connection reset."""
        total = already
        while total <= 4 * self.max_body:
            message = await receive()
            if message["type"] != "http.request":
                return
            total += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _check_host(self, values: list[str]) -> None:
        if len(values) != 1:
            raise ApiError(403, "host: missing or repeated Host header", param="host")
        name = host_name(values[0])
        if name is None or canonical_ipv6(name) not in self.allowed_hosts:
            raise ApiError(403, f"host: {values[0]!r} is not an allowed host name (see --allowed-host)",
                           param="host")

    def _check_key(self, values: list[str]) -> None:
        ok = False
        if len(values) == 1:
            scheme, _, token = values[0].partition(" ")
            if scheme == "Bearer":
                ok = hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self.api_key)
        if not ok:
            raise ApiError(401, "authorization: missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def _check_post(self, headers: dict[str, list[str]]) -> None:
        ctype = (headers.get("content-type") or [""])[0]
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise ApiError(415, f"content-type: {ctype or 'missing'!s}; POST bodies must be application/json",
                           param="content-type")
        lengths = headers.get("content-length", [])
        if lengths:
            try:
                n = int(lengths[0])
            except ValueError:
                raise ApiError(400, "content-length: not an integer", param="content-length") from None
            if n > self.max_body:
                raise self._too_large()

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body: larger than {self.max_body} bytes", code="request_too_large")

    async def _preflight(self, send, extra):
        await send({"type": "http.response.start", "status": 204, "headers": extra + [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"Authorization, Content-Type"),
            (b"access-control-max-age", b"600"),
        ]})
        await send({"type": "http.response.body", "body": b""})
