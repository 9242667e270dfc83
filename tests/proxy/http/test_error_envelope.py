"""Every error the proxy answers itself is in its JSON envelope: upstream failures, bad
bodies, API keys, paths."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import closed_port
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
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 2)
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
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 2)


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


async def test_bom_and_utf16_bodies_are_400(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with run_proxy(fake.url) as px:
        for body in (b'\xef\xbb\xbf{"prompt":"a"}', '{"prompt":"a"}'.encode("utf-16")):
            async with http.post(px.url + "/infill", data=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["src"] == "llmproxy"
        assert not fake.generations


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
        # key not forwarded
        assert not any("s3cret" in json.dumps(list(g.headers.items())) for g in fake.received)
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
            port, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        assert resp.startswith(b"HTTP/1.1 400"), resp[:80]
        assert b'"src":"llmproxy"' in resp
        assert len(fake.received) == before


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
