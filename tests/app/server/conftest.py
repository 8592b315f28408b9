"""Start the real `mtpchat serve` process on an ephemeral port (tests drive it over HTTP)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, fixture_path

MODEL = "models/tiny-qwen35-f32.gguf"


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None):
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", "0", *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        line = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()}")
            m = re.search(r"listening on http://(\S+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
        else:
            raise RuntimeError("server did not start within 120 s")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = line
        self.pid = self.proc.pid

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if not self.proc.stderr.closed:
            self.log += self.proc.stderr.read()
            self.proc.stderr.close()
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def model_path() -> Path:
    return fixture_path(MODEL)


@pytest.fixture(scope="module")
def start_server(model_path):
    started: list[ServerProcess] = []

    def start(*args: str, env: dict | None = None) -> ServerProcess:
        s = ServerProcess(["--model", str(model_path), "--threads", "1", *args], env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def wait_idle(client: httpx.Client, slot: int, limit_s: float) -> float:
    """Seconds until /slots shows `slot` idle (polling every 20 ms); fails past `limit_s`."""
    t0 = time.monotonic()
    while True:
        slots = client.get("/slots").json()
        if not slots[slot]["is_processing"]:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit_s, f"slot {slot} still busy after {limit_s} s"
        time.sleep(0.02)
