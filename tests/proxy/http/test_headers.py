"""Headers on the way through: hop-by-hop dropped, our request id, redirects unfollowed, no
cookie jar."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.proxy.upstream.headers import proxied_location, response_headers
from tests.helpers.net import serve_app
from tests.helpers.proxy import run_proxy


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
        # prefix, default port
        ("http://localhost:80/llama", "http://LocalHost/llama/v1/models/", "/v1/models/"),
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
                # a new client each time, no cookies of its own
                async with aiohttp.ClientSession() as client:
                    async with client.post(px.url + "/v1/completions", json={"prompt": "a"}) as r:
                        assert r.status == 200 and r.headers["Set-Cookie"].startswith(
                            "sess=client-a-secret"
                        )
    assert cookies == [None, None]
