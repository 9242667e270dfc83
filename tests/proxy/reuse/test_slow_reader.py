"""A keystroke answered from a running generation (type-through) whose client stops
reading is dropped after ``client_write_timeout_s``, as a gated request's client is
(tests/proxy/upstream/test_slow_client.py): the answer goes through the same Responder."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.proxy.upstream.test_slow_client import dropped

HEADERS = {"X-LLMProxy-Session": "editor"}


async def raw_post(
    url: str, path: str, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client of the editor's session that sends ``body`` and reads only the response
    head, then nothing (a small receive buffer: the proxy's writes soon wait for it)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-LLMProxy-Session: editor\r\nX-Request-Id: stalled\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    return reader, writer  # the writer kept: its collection would close the connection


async def test_a_reused_answer_to_a_client_that_takes_nothing_is_dropped(
    http: aiohttp.ClientSession,
) -> None:
    script = lambda _p, _b: Script(tokens=2048, token_delay_s=0.002, padding=16384)  # noqa: E731
    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script, abort_linger_s=0.01) as fake,
        run_proxy(
            fake.url, type_through="on", client_buffer_bytes=65536, client_write_timeout_s=0.5
        ) as px,
    ):
        generations = px.state.generations
        assert generations is not None
        body = {"prompt": "x = ", "n_predict": 2048, "stream": True}
        with structlog.testing.capture_logs() as logs:
            first = await http.post(px.url + "/completion", json=body, headers=HEADERS)
            await first.content.readline()  # the generation runs: "t0 " on its way
            reader, writer = await raw_post(px.url, "/completion", {**body, "prompt": "x = t"})
            first.close()  # superseded by the keystroke that continues its generation anyway
            # once the stalled keystroke is dropped nobody reads the generation: it is
            # stopped, seconds before its 2048 tokens would end
            await wait_until(lambda: len(px.state.jobs) == 0, what="the generation stopped")
            assert fake.completed == [] and len(fake.aborted) == 1
            assert await asyncio.wait_for(dropped(reader), 5)
            writer.close()
            px.flush_log()
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "stalled")
        assert line["outcome"] == "reused" and "dropped" in line["error"]
