"""What one client can hold, through a real server: a queue cap (429 + Retry-After in the
envelope), a deadline on the request body (408) and on writes to a client that stopped
reading (its connection dropped, its generation stopped)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend.api import envelope
from tests.helpers.backend.server import wait_until

LONG = {"prompt": "Once upon a time", "n_predict": 500, "ignore_eos": True, "stream": True}
FLAGS = ("--max-queue", "1", "--body-read-timeout-s", "1", "--write-timeout-s", "1")


@pytest.fixture(scope="module")
def bounded(start_backend: Any) -> Any:
    return start_backend("llama-cpp", "--parallel", "1", "--metrics", *FLAGS)


def metric(b: Any, name: str) -> float:
    _, text = b.request("GET", "/metrics", timeout=5)
    line = next(ln for ln in text.splitlines() if ln.startswith(f"llamacpp:{name} "))
    return float(line.split()[1])


def log_has(b: Any, event: str) -> bool:
    return any(
        json.loads(ln).get("event") == event
        for ln in b.log_path.read_text(errors="replace").splitlines()
        if ln.startswith("{")
    )


async def test_queue_cap_answers_429(bounded: Any) -> None:
    async with aiohttp.ClientSession() as s:
        running = await s.post(bounded.url + "/completion", json=LONG)
        assert running.status == 200
        await running.content.readline()  # the slot is busy now
        queued = asyncio.create_task(
            s.post(bounded.url + "/completion", json={"prompt": "a", "n_predict": 2})
        )
        assert await asyncio.to_thread(
            wait_until, lambda: metric(bounded, "requests_deferred") == 1, 10
        )
        async with s.post(bounded.url + "/completion", json={"prompt": "b"}) as r:
            body = await r.json()
            envelope(r.status, body, 429)
            assert r.headers["Retry-After"] == "1", r.headers
        running.close()
        resp = await asyncio.wait_for(queued, 30)
        assert resp.status == 200, await resp.text()
        resp.release()


def test_body_not_sent_in_time_gets_408(bounded: Any) -> None:
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=20) as sock:
        sock.sendall(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
        )
        raw = b""
        while chunk := sock.recv(65536):  # the server answers, then closes the connection
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), raw
    envelope(408, json.loads(body), 408)


@pytest.mark.slow
def test_client_that_stops_reading_is_dropped(bounded: Any) -> None:
    body = json.dumps({**LONG, "model": "m" * 256, "max_tokens": 500}).encode()
    sock = socket.socket()
    # small buffers on both ends (a small MSS keeps the server's send buffer small too), so
    # the server's writes wait after some 100 KB rather than megabytes
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", bounded.port))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        # the client reads nothing: the server's buffers fill, the write waits, times out
        assert wait_until(lambda: log_has(bounded, "client_write_timeout"), 60, 0.1), (
            bounded.log_tail()
        )
        assert wait_until(lambda: not bounded.slots()[0]["is_processing"], 10)
        sock.settimeout(10)
        received = 0
        t0 = time.monotonic()
        try:
            while chunk := sock.recv(65536):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 10  # dropped, not left open
    finally:
        sock.close()
    assert bounded.post("/completion", {"prompt": "x", "n_predict": 2})[0] == 200
