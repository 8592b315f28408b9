"""Rows E1-E4 against the real server process: loopback bind, Host check, no CORS reflection, API key."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
import pytest

from app.server.app import ROUTES as APP_ROUTES
from tests.conftest import REPO

KEY = "sk-test-0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--parallel", "2", "--allowed-host", "mybox.lan", "--cors-origin", "http://localhost:3000")


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server("--parallel", "1", "--api-key", KEY)


def _lan_addresses() -> list[str]:
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                out.append(a.address)
    return out


def test_e1_loopback_only_by_default(server):
    conns = [c for c in psutil.Process(server.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert len(conns) == 1
    assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in conns)
    for addr in _lan_addresses():
        with pytest.raises(OSError):
            socket.create_connection((addr, server.port), timeout=2).close()
    print(f"METRIC E1 sockets={len(conns)} non_loopback=0 refused_start=1")


def test_e1_network_bind_without_key_refuses_to_start(model_path):
    r = subprocess.run([sys.executable, "-m", "app", "serve", "--model", str(model_path), "--host", "0.0.0.0",
                        "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --host: 0.0.0.0 is not a loopback address")


HOSTS = [
    ("localhost", 200), ("localhost:8080", 200), ("127.0.0.1", 200), ("127.0.0.1:1", 200), ("[::1]", 200),
    ("[::1]:8080", 200), ("[0:0:0:0:0:0:0:1]:80", 200), ("LOCALHOST", 200), ("mybox.lan", 200),
    ("mybox.lan:8080", 200), ("evil.example", 403), ("localhost.evil.example", 403), ("127.0.0.1.nip.io", 403),
    ("localhost.", 403), ("", 403), ("::1", 403), ("127.0.0.1:abc", 403), ("[::2]", 403), ("mybox.lan.evil", 403),
]


def test_e2_host_header(server):
    correct = 0
    with server.client() as c:
        for host, want in HOSTS:
            for path in ("/health", "/v1/models"):
                r = c.get(path, headers={"Host": host})
                assert r.status_code == want, (host, path, r.status_code)
                if want == 403:
                    assert r.json()["error"]["param"] == "host"
            correct += 1
    # no Host header at all (HTTP/1.0 style request)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert s.recv(64).split(b" ")[1] == b"403"
    print(f"METRIC E2 hosts={len(HOSTS) + 1} correct={correct + 1}")


ORIGINS = ["http://evil.example", "null", "http://localhost:3001", "http://localhost", "https://localhost:3000",
           "http://127.0.0.1:3000", "file://", "http://localhost:3000.evil.example"]


def test_e3_no_cors_reflection(server):
    reflected = 0
    with server.client() as c:
        before = c.get("/metrics").text.count("mtpchat:requests_total{")
        for origin in ORIGINS:
            pre = c.options("/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            assert pre.status_code == 403
            r = c.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                       headers={"Origin": origin, "Content-Type": "text/plain"})
            assert r.status_code == 403
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Origin": origin})
            assert r.status_code == 403
            for resp in (pre, r):
                acao = resp.headers.get("access-control-allow-origin")
                reflected += acao is not None
        # text/plain without Origin is refused too (forces browsers into a preflight)
        r = c.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
        # the configured origin is matched exactly and echoed, never '*'
        ok = c.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                                                        "Access-Control-Request-Method": "POST"})
        assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "access-control-allow-credentials" not in ok.headers
        slots = c.get("/slots").json()
        assert all(s["next_token"]["n_decoded"] == 0 for s in slots)
        assert c.get("/metrics").text.count("mtpchat:requests_total{") == before
    assert reflected == 0
    print(f"METRIC E3 origins={len(ORIGINS) + 1} reflected=0 generations_started=0")


ROUTES = [(m, p) for m, p, _ in APP_ROUTES] + [("GET", "/no/such/route"), ("POST", "/health"), ("PUT", "/slots")]


def test_e4_api_key_on_every_route_but_health(keyed):
    unauth_ok = []
    body = {"prompt": "hi", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    variants = {"none": {}, "wrong": {"Authorization": "Bearer sk-wrong"},
                "scheme": {"Authorization": f"Token {KEY}"}, "basic": {"Authorization": f"Basic {KEY}"},
                "padded": {"Authorization": f"Bearer  {KEY}"},
                "lower": {"Authorization": f"bearer {KEY}"}, "prefix": {"Authorization": f"Bearer {KEY[:-1]}"}}
    with keyed.client() as c:
        for method, path in ROUTES:
            for name, hdrs in variants.items():
                r = c.request(method, path, json=body if method == "POST" else None, headers=hdrs)
                if r.status_code < 400:
                    unauth_ok.append((method, path, name))
                elif (method, path) != ("GET", "/health"):
                    assert r.status_code == 401, (method, path, name, r.status_code)
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert r.json()["error"]["type"] == "authentication_error"
            good = c.request(method, path, json=body if method == "POST" else None,
                             headers={"Authorization": f"Bearer {KEY}"})
            expect = 404 if path == "/no/such/route" else 405 if (method, path) in (("POST", "/health"),
                                                                                    ("PUT", "/slots")) else 200
            assert good.status_code == expect, (method, path, good.status_code, good.text[:200])
    assert sorted({(m, p) for m, p, _ in unauth_ok}) == [("GET", "/health")]
    print(f"METRIC E4 routes={len(ROUTES)} unauth_ok=1(/health) bypasses=0")


def test_key_never_logged(keyed):
    with keyed.client() as c:
        c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.alive()
    keyed.stop()
    assert "auth: on" in keyed.log and KEY not in keyed.log


def test_slots_out_of_range_via_http(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "model": "x-slot2"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert isinstance(r.json()["error"]["code"], (str, type(None)))


def test_e5_header_read_timeout(start_server):
    server = start_server("--parallel", "1", "--header-timeout", "1")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")   # headers never finished
        t0 = time.monotonic()
        assert s.recv(1024) == b""                                     # closed by the server
        assert 0.5 < time.monotonic() - t0 < 5
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:   # a slow but complete request
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
