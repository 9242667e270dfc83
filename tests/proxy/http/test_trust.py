"""Who may use the proxy: Host and Origin checks, CORS, client keys (http/trust.py).

Each attack is sent as a browser would send it, over a real socket (a forged ``Host`` in a
raw request), against the proxy in front of a fake llama-server that, like the real one,
echoes a request's ``Origin`` in ``Access-Control-Allow-Origin`` and wants its API key.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.llama_fakes import KeyedFake
from tests.helpers.net import raw_exchange
from tests.helpers.proxy import run_proxy

COMPLETION = b'{"prompt":"def f():","n_predict":2}'


class CorsKeyedFake(KeyedFake):
    """llama-server with ``--api-key K``: it echoes ``Origin`` in its CORS headers."""

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._dispatch(request)
        origin = request.headers.get("Origin")
        if origin is not None and not resp.prepared:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Allow-Credentials"] = "true"
        return resp


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _raw(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    resp = await raw_exchange(url, "\r\n".join(lines).encode() + body)
    head, _, payload = resp.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    got = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        got[name.strip().lower()] = value.strip()
    if got.get("transfer-encoding") == "chunked":
        from tests.helpers.net import dechunk

        payload = dechunk(payload)
    return int(status_line.split()[1]), got, payload


def _refused(status: int, body: bytes, code: int = 403) -> None:
    assert status == code, body
    err = json.loads(body)["error"]
    assert err["code"] == code and err["src"] == "llmproxy", err


async def test_a_rebinding_page_name_in_host_is_refused_and_never_forwarded() -> None:
    async with FakeUpstream(kind="llamacpp", slots=1) as fake, run_proxy(fake.url) as px:
        port = _port(px.url)
        before = len(fake.received)
        for path, method, body in (("/slots", "GET", b""), ("/completion", "POST", COMPLETION)):
            status, _, payload = await _raw(
                px.url, method, path, {"Host": f"rebind.attacker.example:{port}"}, body
            )
            _refused(status, payload)
            assert b"rebind.attacker.example" in payload
        assert len(fake.received) == before  # nothing reached the upstream
        assert not fake.generations
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
            status, _, payload = await _raw(px.url, "GET", "/slots", {"Host": host})
            assert status == 200, (host, payload)


async def test_allowed_hosts_add_names_and_star_turns_the_check_off() -> None:
    async with FakeUpstream(kind="llamacpp", slots=1) as fake:
        async with run_proxy(fake.url, allowed_hosts=["gpu-box.lan"]) as px:
            assert (await _raw(px.url, "GET", "/slots", {"Host": "gpu-box.lan:1"}))[0] == 200
            assert (await _raw(px.url, "GET", "/slots", {"Host": "other.lan"}))[0] == 403
            # an IP address that is not this one's, with a loopback bind: refused
            assert (await _raw(px.url, "GET", "/slots", {"Host": "10.1.2.3"}))[0] == 403
        async with run_proxy(fake.url, allowed_hosts=["*"]) as px:
            assert (await _raw(px.url, "GET", "/slots", {"Host": "any.example"}))[0] == 200


async def test_a_cross_site_text_plain_post_is_refused_before_the_model() -> None:
    async with FakeUpstream(kind="llamacpp", slots=1) as fake, run_proxy(fake.url) as px:
        status, headers, payload = await _raw(
            px.url,
            "POST",
            "/completion",
            {
                "Host": f"127.0.0.1:{_port(px.url)}",
                "Origin": "https://evil.example",
                "Content-Type": "text/plain",
            },
            COMPLETION,
        )
        _refused(status, payload)
        assert "access-control-allow-origin" not in headers
        assert not fake.generations


async def test_same_origin_requests_and_requests_without_origin_are_served() -> None:
    """llama-server's web UI served through the proxy posts with the page's own origin."""
    async with FakeUpstream(kind="llamacpp", slots=1) as fake, run_proxy(fake.url) as px:
        port = _port(px.url)
        for host, origin in (
            (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
            (f"localhost:{port}", f"http://localhost:{port}"),
            (f"127.0.0.1:{port}", None),
        ):
            headers = {"Host": host, "Content-Type": "application/json"}
            if origin is not None:
                headers["Origin"] = origin
            status, got, payload = await _raw(px.url, "POST", "/completion", headers, COMPLETION)
            assert status == 200, payload
            assert "access-control-allow-origin" not in got  # same-origin: no CORS needed
        # the same page on another port is another origin
        status, _, payload = await _raw(
            px.url,
            "POST",
            "/completion",
            {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port + 1}"},
            COMPLETION,
        )
        _refused(status, payload)


async def test_an_allowed_origin_gets_the_proxy_own_cors_answers() -> None:
    origin = "https://notebook.example"
    async with (
        FakeUpstream(kind="llamacpp", slots=1) as fake,
        run_proxy(fake.url, allowed_origins=[origin + "/"]) as px,
    ):
        host = f"127.0.0.1:{_port(px.url)}"
        received = len(fake.received)
        status, got, _ = await _raw(
            px.url,
            "OPTIONS",
            "/completion",
            {
                "Host": host,
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, authorization",
            },
        )
        assert status == 204
        assert got["access-control-allow-origin"] == origin
        assert "POST" in got["access-control-allow-methods"]
        assert got["access-control-allow-headers"] == "content-type, authorization"
        assert len(fake.received) == received  # a preflight is never forwarded
        status, got, _ = await _raw(
            px.url,
            "POST",
            "/completion",
            {"Host": host, "Origin": origin, "Content-Type": "application/json"},
            COMPLETION,
        )
        assert status == 200 and got["access-control-allow-origin"] == origin
        # another origin's preflight: refused
        status, got, payload = await _raw(
            px.url,
            "OPTIONS",
            "/completion",
            {
                "Host": host,
                "Origin": "https://evil.example",
                "Access-Control-Request-Method": "POST",
            },
        )
        _refused(status, payload)
        assert "access-control-allow-origin" not in got


async def test_a_keyed_upstream_is_no_confused_deputy_for_web_pages() -> None:
    """With upstream_api_key and no client key, the proxy keys requests for local programs
    only: a page's cross-origin read gets 403, never the upstream's echoed CORS headers."""
    async with (
        CorsKeyedFake(kind="llamacpp", slots=1) as fake,
        run_proxy(fake.url, upstream_api_key="K") as px,
    ):
        host = f"127.0.0.1:{_port(px.url)}"
        async with aiohttp.ClientSession() as http:  # the attack works directly on a keyless...
            async with http.get(
                fake.url + "/slots", headers={"Origin": "https://evil.example"}
            ) as r:
                assert r.status == 401  # ... and is refused by the keyed server
        for method, path in (
            ("GET", "/slots"),
            ("GET", "/props"),
            ("POST", "/slots/0?action=erase"),
        ):
            sent = len(fake.received)
            status, got, payload = await _raw(
                px.url, method, path, {"Host": host, "Origin": "https://evil.example"}
            )
            _refused(status, payload)
            assert "access-control-allow-origin" not in got
            assert len(fake.received) == sent
        # a local program (no Origin) is keyed through, and the upstream's CORS echo of an
        # allowed request is never relayed either
        status, got, payload = await _raw(px.url, "GET", "/slots", {"Host": host})
        assert status == 200, payload
        assert fake.received[-1].headers["Authorization"] == "Bearer K"
        status, got, _ = await _raw(
            px.url, "GET", "/slots", {"Host": host, "Origin": f"http://{host}"}
        )
        assert status == 200 and "access-control-allow-origin" not in got
        assert "access-control-allow-credentials" not in got


async def test_named_keys_and_key_files_are_required_on_every_route_but_health(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "alice.key"
    key_file.write_text("alice-secret\n")
    keys = [{"name": "alice", "key_file": str(key_file)}, {"name": "bob", "key": "bob-secret"}]
    async with FakeUpstream(kind="llamacpp", slots=1) as fake, run_proxy(fake.url, keys=keys) as px:
        async with aiohttp.ClientSession() as http:
            for path in ("/llmproxy/status", "/llmproxy/metrics", "/slots", "/v1/models"):
                async with http.get(px.url + path) as r:
                    assert r.status == 401, path
                for key in ("alice-secret", "bob-secret"):
                    async with http.get(px.url + path, headers={"api-key": key}) as r:
                        assert r.status == 200, path
            async with http.get(px.url + "/llmproxy/health") as r:
                assert r.status == 200
            async with http.post(
                px.url + "/completion",
                data=COMPLETION,
                headers={"Authorization": "Bearer alice-secret"},
            ) as r:
                assert r.status == 200
            # the client's key is the proxy's: never forwarded
            assert "Authorization" not in fake.received[-1].headers
            for bad in ({"Authorization": "Bearer undefined"}, {"api-key": ""}, {}):
                async with http.post(px.url + "/completion", data=COMPLETION, headers=bad) as r:
                    assert r.status == 401


def test_keys_need_names_of_their_own_and_readable_files(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from llmproxy.proxy.settings import ProxySettings

    with pytest.raises(ValidationError, match="name of its own"):
        ProxySettings(keys=[{"name": "a", "key": "x"}, {"name": "a", "key": "y"}])
    with pytest.raises(ValidationError, match="cannot read key file"):
        ProxySettings(api_key_file=tmp_path / "missing")
    with pytest.raises(ValidationError, match="exactly one of key and key_file"):
        ProxySettings(keys=[{"name": "a"}])
    with pytest.raises(ValidationError, match="needs a client key"):
        ProxySettings(host="0.0.0.0")
    assert ProxySettings(host="0.0.0.0", api_key="k").client_keys() == (("default", b"k"),)
