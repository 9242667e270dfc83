"""Wire behaviour: errors and envelope, streaming relay, passthrough, headers, auth, paths."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
import structlog
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.errors import Superseded
from llmproxy.proxy.upstream.headers import proxied_location, response_headers
from llmproxy.proxy.upstream.responder import Responder, stream_error_bytes
from tests.helpers.net import closed_port, serve_app, wait_until
from tests.helpers.proxy import run_proxy


def assert_envelope(body: dict, status: int, type_: str) -> None:
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": type_,
            "code": status,
            "src": "llmproxy",
        }
    }


async def test_upstream_down_is_502_quickly(http: aiohttp.ClientSession) -> None:
    async with run_proxy(f"http://127.0.0.1:{closed_port()}", upstream_kind="llamacpp") as px:
        t0 = time.monotonic()
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 502
            assert_envelope(await r.json(), 502, "upstream_unreachable")
        assert time.monotonic() - t0 < 2
        with structlog.testing.capture_logs() as logs:
            async with http.get(
                px.url + "/health", headers={"X-Request-Id": "h"}
            ) as r:  # passthrough too
                assert r.status == 502
            px.flush_log()
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 2)
    line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "h")
    assert line["reached_upstream"] is False and line["outcome"] == "error"


async def test_upstream_hang_is_504(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(fail="hang_before_headers")  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, slots_endpoint=False) as fake,
        run_proxy(fake.url, read_timeout_s=0.3) as px,
    ):
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 504
            assert_envelope(await r.json(), 504, "upstream_timeout")
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 2)


async def test_malformed_and_wrong_types_are_400(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with run_proxy(fake.url) as px:
        for body in (b"{bad", b"[1,2]", b"", b'{"n_predict":"many"}', b"\xff\xfe{}", b"[" * 100000):
            async with http.post(px.url + "/completion", data=body) as r:
                assert r.status == 400, body[:20]
                assert_envelope(await r.json(), 400, "invalid_request_error")
        assert fake.received == [] or all(r.path != "/completion" for r in fake.received)


async def test_oversize_body_is_413(fake: FakeUpstream, http: aiohttp.ClientSession) -> None:
    async with run_proxy(fake.url, max_body_bytes=1024) as px:
        big = json.dumps({"prompt": "x" * 5000}).encode()
        async with http.post(px.url + "/completion", data=big) as r:
            assert r.status == 413
            assert_envelope(await r.json(), 413, "request_too_large")

        async def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b"x" * 512

        async with http.post(px.url + "/completion", data=chunked()) as r:
            assert r.status == 413
        assert not fake.generations


@pytest.mark.parametrize(
    ("kind", "path", "body", "ctype"),
    [
        ("llamacpp", "/completion", {"prompt": "x", "stream": True}, "text/event-stream"),
        (
            "llamacpp",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True},
            "text/event-stream",
        ),
        ("ollama", "/api/generate", {"model": "m", "prompt": "x"}, "application/x-ndjson"),
    ],
)
async def test_streams_relayed_chunk_by_chunk(
    http: aiohttp.ClientSession, kind: str, path: str, body: dict, ctype: str
) -> None:
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.05)  # noqa: E731
    async with FakeUpstream(kind=kind, slots=1, script=script) as fake, run_proxy(fake.url) as px:
        async with http.post(px.url + path, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith(ctype)
            first = await r.content.readline()
            assert first.strip()
            assert (
                fake.completed == []
            )  # the client saw data before the upstream sent its last chunk
            rest = await r.read()
        direct = await http.post(fake.url + path, json=body)
        # byte for byte, except the per-request ids/counters the upstream puts in each chunk
        norm = lambda b: re.sub(rb'"(id|id_slot|created)":("[^"]*"|\d+)', b"", b)  # noqa: E731
        assert norm(first + rest) == norm(await direct.read())


@pytest.mark.parametrize("stream", [False, True])
async def test_response_body_exact_and_request_id_echoed(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    # non-streamed: the whole body arrives at once and goes out as one response (relay.py)
    async with FakeUpstream(slots=1) as fake, run_proxy(fake.url) as px:
        body = {"prompt": "x", "stream": stream}
        async with http.post(
            px.url + "/completion", json=body, headers={"X-Request-Id": "rid-7"}
        ) as r:
            got = await r.read()
            assert r.status == 200 and r.headers["X-Request-Id"] == "rid-7"
            if not stream:
                assert r.headers["Content-Length"] == str(len(got))
        async with http.post(fake.url + "/completion", json=body) as d:
            direct = await d.read()
            assert r.headers["Content-Type"] == d.headers["Content-Type"]
        norm = lambda b: re.sub(rb'"(id|id_slot|created)":("[^"]*"|\d+)', b"", b)  # noqa: E731
        assert norm(got) == norm(direct) and got


async def test_error_after_stream_start_is_an_event(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.01, fail="reset_mid_stream")  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        async with http.post(px.url + "/completion", json={"prompt": "x", "stream": True}) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        last = [ln for ln in text.split("\n\n") if ln.strip()][-1]
        assert last.startswith("data: ")
        assert json.loads(last[6:])["error"]["src"] == "llmproxy"
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)


async def test_error_after_ndjson_stream_start_is_an_ollama_error_line(
    http: aiohttp.ClientSession,
) -> None:
    """Ollama's own in-stream error is ``{"error": "<message>"}``; its clients throw
    ``Error(line.error)``, so the message must be the string there."""
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.01, fail="reset_mid_stream")  # noqa: E731
    async with (
        FakeUpstream(kind="ollama", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        async with http.post(px.url + "/api/generate", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/x-ndjson")
            lines = (await r.read()).decode().splitlines()
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
    tokens, last = [json.loads(ln) for ln in lines[:-1]], json.loads(lines[-1])
    assert tokens and all("response" in t and not t["done"] for t in tokens)  # relayed as sent
    assert isinstance(last["error"], str) and last["error"]
    assert last["src"] == "llmproxy" and last["code"] == 502 and last["type"] == "upstream_error"


def test_stream_error_bytes_formats() -> None:
    err = Superseded("superseded")
    sse = stream_error_bytes("text/event-stream; charset=utf-8", err)
    assert (
        sse is not None
        and sse.startswith(b"data: ")
        and sse.endswith(b"\n\n")
        and sse.count(b"\n") == 2
    )
    assert json.loads(sse[6:]) == err.envelope()
    for ctype, rs in [("application/x-ndjson", b""), ("application/json-seq", b"\x1e")]:
        line = stream_error_bytes(ctype, err)
        assert (
            line is not None
            and line.startswith(rs)
            and line.endswith(b"\n")
            and line.count(b"\n") == 1
        )
        assert json.loads(line[len(rs) :]) == {
            "error": "superseded",
            "type": "superseded",
            "code": 499,
            "src": "llmproxy",
        }
    assert (
        stream_error_bytes("application/json", err) is None
    )  # no event format: the relay closes instead
    # after bytes that left an event or line open, it is ended first
    for tail, prefix in [
        (b"", b""),
        (b'"}\n\n', b""),
        (b"\r\n\r\n", b""),
        (b'"a"}\n', b"\n"),
        (b'"a', b"\n\n"),
        (b'"a"}\r', b"\n\n"),
    ]:  # "\r" + "\n" is one line end: two more are needed
        assert stream_error_bytes("text/event-stream", err, tail) == prefix + sse, tail
    for tail, prefix in [(b"", b""), (b"}\n", b""), (b'{"a', b"\n")]:
        assert stream_error_bytes("application/x-ndjson", err, tail) == prefix + line.removeprefix(
            b"\x1e"
        ), tail


@pytest.mark.parametrize(
    ("ctype", "sent"),
    [
        ("text/event-stream", [b'data: {"content":"a"}\n\n', b'data: {"content":"b']),
        (
            "text/event-stream",
            [b'data: {"content":"a"}\n', b"data: {"],
        ),  # cut after a line, inside the event
        ("application/x-ndjson", [b'{"response":"a","done":false}\n', b'{"response":"b']),
    ],
    ids=["sse-mid-line", "sse-mid-event", "ndjson-mid-line"],
)
async def test_stream_cut_inside_an_event_ends_with_an_error_event_that_parses(
    http: aiohttp.ClientSession, ctype: str, sent: list[bytes]
) -> None:
    """The upstream dies in the middle of an event: the relayed part is as sent, then the
    open event or line is ended, and the proxy's error event stands on its own."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": ctype})
        await resp.prepare(request)
        for piece in sent:
            await resp.write(piece)
        assert request.transport is not None
        request.transport.abort()  # gone mid-event
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve_app(app) as upstream, run_proxy(upstream, upstream_kind="openai") as px:
        async with http.post(px.url + "/v1/completions", json={"prompt": "a", "stream": True}) as r:
            body = await r.read()
    relayed = b"".join(sent)
    assert body.startswith(relayed)
    if ctype == "text/event-stream":
        events = body.split(b"\n\n")  # as a client splits the stream into events
        assert events[-1] == b"" and events[-2].startswith(b"data: {"), (
            body
        )  # its own event, the last
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    else:
        error = json.loads(body.splitlines()[-1])
        assert body.splitlines()[:-1] == relayed.splitlines()
    assert error["src"] == "llmproxy" and error["code"] == 502, body


async def test_passthrough_is_ungated(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=100, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        busy = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x"}))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        with structlog.testing.capture_logs() as logs:
            for path in ("/health", "/props", "/slots", "/v1/models"):
                async with http.get(px.url + path) as r, http.get(fake.url + path) as d:
                    assert r.status == d.status
                    assert r.headers["Content-Type"] == d.headers["Content-Type"]
            px.flush_log()
        (await busy).release()
    lines = [e for e in logs if e.get("event") == "request"]
    assert [(e["route"], e["reached_upstream"], e["upstream_status"]) for e in lines] == [
        (p, True, 200) for p in ("/health", "/props", "/slots", "/v1/models")
    ]


async def test_id_slot_injected_per_permit(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        assert px.state.gate.capacity == 2  # from /props total_slots
        reqs = [
            http.post(
                px.url + "/infill",
                json={"id_slot": 0, "input_prefix": "x", "seq": i},
                headers={"X-LLMProxy-Session": f"s{i}"},
            )
            for i in range(4)
        ]
        for r in await asyncio.gather(*reqs):
            assert r.status == 200
            r.release()
        assert fake.max_concurrent == 2
        assert {r.body["id_slot"] for r in fake.generations} == {0, 1}


async def test_hop_by_hop_headers_not_forwarded(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with run_proxy(fake.url) as px:
        headers = {
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "X-End-To-End": "yes",
            "Proxy-Authorization": "Basic abc",
        }
        async with http.post(px.url + "/completion", json={"prompt": "x"}, headers=headers) as r:
            assert r.status == 200
        got = {k.lower() for k in fake.generations[-1].headers}
        assert "x-end-to-end" in got
        assert not got & {"x-secret-hop", "keep-alive", "proxy-authorization"}


async def test_api_key(fake: FakeUpstream, http: aiohttp.ClientSession) -> None:
    async with run_proxy(fake.url, api_key="s3cret") as px:
        for hdr in (
            {},
            {"Authorization": "Bearer undefined"},
            {"Authorization": ""},
            {"api-key": ""},
            {"Authorization": "Bearer s3cre"},
        ):
            async with http.post(px.url + "/completion", json={"prompt": "x"}, headers=hdr) as r:
                assert r.status == 401, hdr
                assert_envelope(await r.json(), 401, "authentication_error")
        for hdr in (
            {"Authorization": "Bearer s3cret"},
            {"api-key": "s3cret"},
            {"x-api-key": "s3cret"},
        ):
            async with http.post(px.url + "/completion", json={"prompt": "x"}, headers=hdr) as r:
                assert r.status == 200, hdr
        assert not any(
            "s3cret" in json.dumps(list(g.headers.items())) for g in fake.received
        )  # key not forwarded
        async with http.get(px.url + "/llmproxy/health") as r:
            assert r.status == 200


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read(65536)
    writer.close()
    await writer.wait_closed()
    return data


@pytest.mark.parametrize(
    "target",
    [b"http://example.com/completion", b"/../etc/passwd", b"/v1/%2e%2e/secret", b"//evil.com/x"],
)
async def test_path_tricks_rejected(fake: FakeUpstream, target: bytes) -> None:
    async with run_proxy(fake.url) as px:
        port = int(px.url.rsplit(":", 1)[1])
        before = len(fake.received)  # start-up detection probes
        resp = await _raw(
            port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert resp.startswith(b"HTTP/1.1 400"), resp[:80]
        assert b'"src":"llmproxy"' in resp
        assert len(fake.received) == before


async def test_status_and_metrics(fake: FakeUpstream, http: aiohttp.ClientSession) -> None:
    async with run_proxy(fake.url) as px:
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 200
        async with http.post(px.url + "/completion", data=b"{") as r:
            assert r.status == 400
        await wait_until(lambda: px.state.gate.inflight == 0)
        async with http.get(px.url + "/llmproxy/status") as r:
            st = await r.json()
        assert st["permits"] == {"total": 1, "free": 1, "held": 0}
        assert st["queue"]["depth"] == 0 and st["upstream"]["kind"] == "llamacpp"
        async with http.get(px.url + "/llmproxy/metrics") as r:
            text = await r.text()
        for name in (
            "llmproxy_queue_depth",
            "llmproxy_inflight",
            "llmproxy_permits_free",
            "llmproxy_upstream_latency_seconds_bucket",
            "llmproxy_upstream_ttfb_seconds_bucket",
            "llmproxy_permit_hold_seconds_bucket",
            "llmproxy_confirm_wait_seconds_bucket",
        ):
            assert name in text, name
        assert 'llmproxy_requests_total{outcome="completed",route="/completion"} 1.0' in text
        assert 'llmproxy_requests_total{outcome="rejected",route="/completion"} 1.0' in text


async def test_llmproxy_prefix_is_never_forwarded(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """/llmproxy/ is the proxy's own: another method on its endpoints is a 405 (with Allow),
    an unknown path under it a 404, both in the envelope, and none reaches the upstream."""
    async with run_proxy(fake.url) as px:
        before = len(fake.received)
        for method, path in (
            ("POST", "/llmproxy/status"),
            ("DELETE", "/llmproxy/metrics"),
            ("PUT", "/llmproxy/health"),
        ):
            async with http.request(method, px.url + path, json={"x": 1}) as r:
                assert r.status == 405 and r.headers["Allow"] == "GET, HEAD", (method, path)
                assert_envelope(await r.json(), 405, "invalid_request_error")
        for method in ("GET", "POST"):
            async with http.request(method, px.url + "/llmproxy/slots") as r:
                assert r.status == 404
                assert_envelope(await r.json(), 404, "not_found_error")
        async with http.head(px.url + "/llmproxy/status") as r:
            assert r.status == 200
        assert len(fake.received) == before


@pytest.mark.parametrize(
    ("kind", "expected", "capacity"),
    [("llamacpp", "llamacpp", 3), ("ollama", "ollama", 1), ("openai", "openai", 1)],
)
async def test_adapter_detection(kind: str, expected: str, capacity: int) -> None:
    async with FakeUpstream(kind=kind, slots=3) as fake, run_proxy(fake.url) as px:
        assert px.state.adapter.kind == expected
        assert px.state.gate.capacity == capacity
        assert px.state.adapter.can_confirm is (expected == "llamacpp")


@pytest.mark.parametrize("stream", [False, True])
async def test_our_request_id_replaces_an_upstreams(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    """The client gets the id of our log line, even when the upstream sends its own."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {"X-Request-ID": "from-upstream"}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}]}, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve_app(app) as upstream, run_proxy(upstream, upstream_kind="openai") as px:
        async with http.post(
            px.url + "/v1/completions",
            json={"prompt": "a", "stream": stream},
            headers={"X-Request-Id": "rid-9"},
        ) as r:
            assert r.status == 200 and b"x" in await r.read()
            assert r.headers.getall("X-Request-Id") == ["rid-9"]


_SELF = "{self}/elsewhere?a=1"  # the upstream's own absolute URL (filled in by the handler)


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ("/elsewhere?a=1", "/elsewhere?a=1"),
        (_SELF, "/elsewhere?a=1"),  # made relative: the client's follow-up comes back through us
        ("//example.com/x", "//example.com/x"),  # scheme-relative: not ours, as sent
        ("http://[bad", "http://[bad"),  # unparsable: as sent, never a 500
    ],
    ids=["relative", "into-upstream", "scheme-relative", "malformed"],
)
@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/completions/"], ids=["gated", "passthrough"]
)
async def test_upstream_redirect_goes_to_the_client_unfollowed(
    http: aiohttp.ClientSession, path: str, sent: str, expected: str
) -> None:
    """A 3xx reaches the client, not followed by the proxy: following it would send bodies
    wherever Location points, and a trailing-slash redirect (vLLM, Ollama) of an ungated
    path would run a generation that never held a permit. A Location into the upstream
    itself (Starlette builds it from its own host) is made relative."""
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.path == "/elsewhere":
            return web.json_response({"choices": [{"text": "followed"}]})
        own = str(request.url.origin())
        return web.Response(status=307, headers={"Location": sent.replace("{self}", own)})

    app = web.Application()
    app.router.add_post(path, handler)
    app.router.add_route("*", "/elsewhere", handler)
    async with serve_app(app) as upstream, run_proxy(upstream, upstream_kind="openai") as px:
        async with http.post(px.url + path, json={"prompt": "a"}, allow_redirects=False) as r:
            assert r.status == 307 and r.headers["Location"] == expected
            await r.read()
    assert seen == [path]


@pytest.mark.parametrize(
    ("base", "location", "expected"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080", "/"),
        ("http://127.0.0.1:8080", "HTTP://127.0.0.1:8080/y#f", "/y#f"),
        (
            "http://localhost:80/llama",
            "http://LocalHost/llama/v1/models/",
            "/v1/models/",
        ),  # prefix, default port
        ("http://localhost/llama", "http://localhost/llama", "/"),
        ("http://[::1]:8080", "http://[::1]:8080/z?q=%20", "/z?q=%20"),
        ("http://localhost/llama", "http://localhost/other", None),  # outside the base path
        ("http://localhost/llama", "http://localhost/llamas/x", None),
        ("http://127.0.0.1:8080", "http://127.0.0.1:9999/x", None),
        ("http://127.0.0.1:8080", "https://127.0.0.1:8080/x", None),
        ("http://127.0.0.1:8080", "/x", None),
        ("http://127.0.0.1:8080", "//127.0.0.1:8080/x", None),
        ("http://127.0.0.1:8080", "http://[bad", None),
    ],
)
def test_proxied_location(base: str, location: str, expected: str | None) -> None:
    assert proxied_location(location, URL(base)) == expected
    out = response_headers(CIMultiDict({"Location": location}), URL(base))["Location"]
    assert out == (expected or location)


async def test_upstream_cookies_are_not_kept_between_clients(http: aiohttp.ClientSession) -> None:
    """The proxy has no cookie jar: an upstream's Set-Cookie goes to its client and is never
    replayed on another client's request (aiohttp's default jar keeps them per host name)."""
    cookies: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        return web.json_response(
            {"choices": []}, headers={"Set-Cookie": "sess=client-a-secret; Path=/"}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve_app(app) as upstream:
        async with run_proxy(
            upstream.replace("127.0.0.1", "localhost"), upstream_kind="openai"
        ) as px:
            for _ in range(2):
                async with (
                    aiohttp.ClientSession() as client
                ):  # a new client each time, no cookies of its own
                    async with client.post(px.url + "/v1/completions", json={"prompt": "a"}) as r:
                        assert r.status == 200 and r.headers["Set-Cookie"].startswith(
                            "sess=client-a-secret"
                        )
    assert cookies == [None, None]


async def test_passthrough_bug_after_the_start_ends_the_stream_not_the_wire(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception in an ungated relay once the response started (a fault
    injected into the second piece's write) ends the stream with the error event, as an
    upstream failure does; before, the middleware's 500 went out as a second status line
    inside the chunked body."""

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in (1, 2):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.05)  # read apart at the proxy: pieces 1 and 2, then the last
        await resp.write_eof(b"data: 3\n\n")
        return resp

    upstream = web.Application()
    upstream.router.add_get("/events", events)
    real_piece = Responder.piece
    pieces = 0

    async def faulty_piece(self: Responder, data: bytes) -> None:
        nonlocal pieces
        pieces += 1
        if pieces == 2:
            raise RuntimeError("injected bug")
        await real_piece(self, data)

    monkeypatch.setattr(Responder, "piece", faulty_piece)
    async with serve_app(upstream) as up, run_proxy(up, upstream_kind="openai") as px:
        with structlog.testing.capture_logs() as logs:
            async with http.get(px.url + "/events") as r:
                assert r.status == 200
                body = await r.read()
            px.flush_log()
    events_out = [e for e in body.split(b"\n\n") if e]
    assert events_out[0] == b"data: 1" and len(events_out) == 2, body
    error = json.loads(events_out[1].removeprefix(b"data: "))["error"]
    assert error["src"] == "llmproxy" and error["code"] == 500 and error["type"] == "server_error"
    [line] = [e for e in logs if e.get("event") == "request"]
    assert line["outcome"] == "error" and line["route"] == "/events"
