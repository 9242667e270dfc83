"""Issue 41's hostile inputs through ``llmproxy serve`` and its embedded backend (real
SmolLM2, real processes), on every gated route the backend serves.

Raw surrogate bytes (``ED A0 80``) in each text field, a special-token flood, a chat of
more messages than the context has tokens, wrong types, a huge stop list, a body sent in
part, a stream nobody reads: none may get a 5xx (a refusal is a 4xx in an error envelope,
the proxy's or the backend's), neither process may log a traceback, and afterwards the
proxy must hold no permit and quarantine no slot, and the backend's slots be idle, within
a bound.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmproxy.common.children import child_preexec
from tests.helpers.serve import LLMPROXY

pytestmark = pytest.mark.slow

# the gated routes the embedded backend serves, and how each takes its text
COMPLETION_ROUTES = ("/completion", "/completions", "/v1/completions")
CHAT_ROUTES = ("/v1/chat/completions", "/chat/completions")
SURROGATE = b"\xed\xa0\x80"  # a UTF-16 surrogate encoded as if it were a character
SETTLE_S = 60  # permits back, slots idle, after the last hostile request


def body_for(route: str, text: str = "hi", **extra: Any) -> dict[str, Any]:
    if route in CHAT_ROUTES:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}
    if route == "/infill":
        return {"input_prefix": text, "input_suffix": "", "n_predict": 2, **extra}
    return {"prompt": text, "n_predict": 2, **extra}


def raw_with_surrogate(route: str, field: str) -> bytes:
    """The route's body with raw surrogate bytes inside ``field`` (a JSON string)."""
    body = body_for(route)
    if field == "stop":
        body["stop"] = ["MARK"]
    elif field == "model":
        body["model"] = "MARK"
    elif field == "text":
        body = body_for(route, "MARK")
    raw = json.dumps(body).encode()
    assert b"MARK" in raw
    return raw.replace(b"MARK", b"a" + SURROGATE + b"b")


def hostile_cases() -> list[tuple[str, str, bytes]]:
    """(name, route, raw body) for every hostile body of issue 41 on every route."""
    cases: list[tuple[str, str, bytes]] = []
    routes = (*COMPLETION_ROUTES, "/infill", *CHAT_ROUTES)
    flood = "<|im_end|>" * 150_000  # 1.5 MB: seconds to minutes of llama.cpp's tokenizer

    def dumps(route: str, text: str = "hi", **extra: Any) -> bytes:
        return json.dumps(body_for(route, text, **extra)).encode()

    for route in routes:
        for field in ("text", "stop", "model"):
            cases.append((f"surrogate-{field}", route, raw_with_surrogate(route, field)))
        cases.append(("flood", route, dumps(route, flood)))
        wrong: dict[str, Any] = {"stream": "false", "top_k": 2**32 + 1, "ignore_eos": "true"}
        for key, value in wrong.items():
            cases.append((f"wrong-{key}", route, dumps(route, **{key: value})))
        cases.append(("n_probs", route, dumps(route, n_probs=5)))
        stops = ["x" * 1400 + str(i) for i in range(1500)]
        cases.append(("huge-stop", route, dumps(route, stop=stops)))
        if route == "/infill":
            extra = [{"filename": "a.py", "text": flood}]
            cases.append(("flood-extra", route, dumps(route, input_extra=extra)))
    for route in CHAT_ROUTES:
        many = {"messages": [{"role": "user", "content": "<|im_end|>"}] * 200_000, "max_tokens": 2}
        cases.append(("many-messages", route, json.dumps(many).encode()))
    return cases


@asynccontextmanager
async def embedded(tmp_path: Path) -> AsyncIterator[tuple[str, list[bytes]]]:
    """``llmproxy serve`` with its embedded backend (one slot, one thread); yields its URL
    and the lines of both processes' stderr (read as they come, so the pipe never fills)."""
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY, "serve", "--port", "0", "--port-file", str(port_file), "--log-json",
        "--n-threads", "1", "--backend-start-timeout-s", "120",
        env=env, stderr=asyncio.subprocess.PIPE, preexec_fn=child_preexec(),
    )  # fmt: skip
    lines: list[bytes] = []

    async def drain() -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            lines.append(line)

    reader = asyncio.create_task(drain())
    try:
        async with asyncio.timeout(150):
            while not port_file.exists():
                assert proc.returncode is None, b"".join(lines)[-3000:]
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{int(port_file.read_text())}", lines
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await asyncio.wait_for(reader, 10)


async def send(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    async with http.post(url, data=io.BytesIO(raw), headers=headers) as r:
        data = await r.read()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data[:300]


async def half_body(url: str) -> asyncio.StreamWriter:
    """A connection that announced a body and sent a third of it (left open)."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    body = b'{"prompt": "hello there", "n_predict": 4}'
    writer.write(
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 3]
    )
    await writer.drain()
    return writer


async def unread_stream(url: str) -> asyncio.StreamWriter:
    """A streamed generation whose client reads nothing (left open)."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(
        {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "stream": True,
         "stop": ["y" * 500 + str(i) for i in range(64)]}
    ).encode()  # fmt: skip
    writer.write(
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    return writer


async def test_hostile_inputs_through_the_proxy_and_embedded_backend(tmp_path: Path) -> None:
    async with embedded(tmp_path) as (url, lines), aiohttp.ClientSession() as http:
        async with http.post(url + "/completion", json={"prompt": "x", "n_predict": 1}) as r:
            assert r.status == 200, await r.text()
        open_conns = [await half_body(url), await unread_stream(url)]
        answers: list[tuple[str, str, int, Any]] = []
        try:
            for name, route, raw in hostile_cases():
                status, body = await send(http, url + route, raw)
                answers.append((name, route, status, body))
        finally:
            for writer in open_conns:
                writer.close()
        five = [a for a in answers if a[2] >= 500]
        assert not five, five
        refused = [a for a in answers if a[2] >= 400]
        for name, route, status, body in refused:
            assert isinstance(body, dict) and body["error"]["message"], (name, route, status, body)
        must = {  # the cases that must be refused (a trimmed infill may run)
            *("surrogate-text", "surrogate-stop", "surrogate-model", "flood", "n_probs"),
            *("wrong-stream", "wrong-top_k", "wrong-ignore_eos", "huge-stop", "many-messages"),
        }
        for name, route, status, body in answers:
            if name in must and not (name == "flood" and route == "/infill"):  # cut to fit
                assert 400 <= status < 500, (name, route, status, body)

        async def settled() -> dict[str, Any]:
            async with http.get(url + "/llmproxy/status") as r:
                status = await r.json()
            async with http.get(url + "/slots") as r:
                slots = await r.json()
            return {
                "free": status["permits"]["free"] == status["permits"]["total"],
                "held": status["permits"]["held"],
                "quarantine": [s for u in status["upstreams"] for s in u["quarantine"]],
                "queued": status["queue"]["depth"],
                "busy": [s["id"] for s in slots if s["is_processing"]],
            }

        want = {"free": True, "held": 0, "quarantine": [], "queued": 0, "busy": []}
        state: dict[str, Any] = {}
        async with asyncio.timeout(SETTLE_S):  # polled: the state is in two other processes
            while (state := await settled()) != want:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert state == want
        async with http.post(url + "/completion", json={"prompt": "x", "n_predict": 1}) as r:
            assert r.status == 200, await r.text()
    log = b"".join(lines).decode(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    events = [json.loads(ln) for ln in lines if ln.startswith(b"{")]
    errors = [e for e in events if e.get("level") in ("error", "critical")]
    assert not errors, errors[:5]
