"""Run the HTTP app with uvicorn on a socket bound here (so `--port 0` reports the real port).

Refuses a non-loopback bind without an API key unless `--allow-no-auth` (reliability-matrix E1) and
logs the address and whether auth is on.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import InputError

log = logging.getLogger("mtpchat.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, allow_no_auth: bool) -> None:
    if not is_loopback(host) and not api_key and not allow_no_auth:
        raise InputError(f"--host: {host} is not a loopback address; set --api-key (or MTPCHAT_API_KEY), or pass "
                         "--allow-no-auth to serve the network without authentication")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    # proto given: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose proto is
    # IPPROTO_TCP, and a socket made with proto 0 passes 0 on to them. With Nagle on, a response's second
    # write (Starlette sends headers, then the body; SSE sends one event per token) waited for the client's
    # delayed ACK: every /health took ~44 ms on loopback and each streamed chunk up to ~40 ms more
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]") if host != "localhost" else "127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise InputError(f"--port: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for the request line and headers (reliability-matrix E5: a
    client trickling header bytes cannot hold a connection open). Armed when the connection opens and
    after each response; disarmed once a request's headers are complete."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _disarm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


def serve(app, host: str, port: int, *, auth: bool, header_timeout_s: float = 10.0) -> None:
    sock = bind_socket(host, port)
    real_port = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
    sys.stderr.write(f"mtpchat serve: listening on http://{shown}:{real_port} (auth: {'on' if auth else 'off'})\n")
    sys.stderr.flush()
    protocol = type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(app, http=protocol, ws="none", lifespan="off", log_level="warning", access_log=False,
                            timeout_keep_alive=10, server_header=False, date_header=True)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
