"""The real app and scheduler served by uvicorn on a thread of the test process, for tests that need
to reach inside (fault injection, E10)."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from app.cli import build_parser
from app.commands.serve import build_state
from app.server.app import build_app
from app.server.run import bind_socket


class InProcessServer:
    def __init__(self, *argv: str):
        args = build_parser().parse_args(["serve", *argv])
        self.state = build_state(args)
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self.state), http="h11", ws="none", lifespan="off", log_level="warning",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.02)

    @property
    def backend(self):
        return self.state.scheduler.backend

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.state.scheduler.close()
