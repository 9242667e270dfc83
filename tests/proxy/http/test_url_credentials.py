"""Credentials in an upstream URL (``http://user:pass@host``) become Basic auth on every
request to it, the proxy's probes included, and are never shown: not in
``/llmproxy/status``, the start-up log line, request logs or an error message."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.common.config import describe
from llmproxy.common.redact import redact_urls, strip_userinfo
from llmproxy.proxy.settings import ProxySettings
from tests.helpers.net import closed_port
from tests.helpers.proxy import run_proxy
from tests.helpers.serve import serve

PASSWORD = "s3cr3t-PASSWORD-in-url"
BASIC = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()


def _with_creds(url: str) -> str:
    return url.replace("http://", f"http://alice:{PASSWORD}@")


async def test_url_credentials_authenticate_and_are_masked_in_status() -> None:
    async with FakeUpstream(kind="llamacpp", slots=1) as fake:
        with structlog.testing.capture_logs() as logs:
            async with run_proxy(_with_creds(fake.url)) as px:
                # the probes (/props, /slots) were authenticated: detected as llama-server
                assert px.member.adapter.kind == "llamacpp"
                assert all(r.headers.get("Authorization") == BASIC for r in fake.received)
                async with aiohttp.ClientSession() as http:
                    async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                        assert r.status == 200
                    assert fake.received[-1].headers["Authorization"] == BASIC
                    async with http.get(px.url + "/llmproxy/status") as r:
                        status = await r.text()
                px.flush_log()
        assert PASSWORD not in status
        assert json.loads(status)["upstream"]["url"] == fake.url
        assert PASSWORD not in "\n".join(repr(e) for e in logs)


async def test_an_unreachable_upstream_error_names_no_credentials() -> None:
    url = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}"
    with structlog.testing.capture_logs() as logs:
        async with run_proxy(url, upstream_kind="llamacpp") as px:
            async with aiohttp.ClientSession() as http:
                async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                    body = await r.text()
                    assert r.status == 502
            px.flush_log()
    assert PASSWORD not in body
    assert PASSWORD not in "\n".join(repr(e) for e in logs)


async def test_pool_status_and_startup_line_mask_credentials(tmp_path: Path) -> None:
    async with FakeUpstream(kind="llamacpp", slots=1) as a, FakeUpstream(kind="llamacpp") as b:
        settings = ProxySettings(upstream=f"{_with_creds(a.url)},{_with_creds(b.url)}")
        assert PASSWORD not in json.dumps(describe(settings))
        async with run_proxy(settings.upstream) as px:
            async with aiohttp.ClientSession() as http:
                async with http.get(px.url + "/llmproxy/status") as r:
                    status = await r.text()
        assert PASSWORD not in status
        async with serve(tmp_path, "--upstream", _with_creds(a.url), "--log-level", "debug") as (
            proc,
            url,
        ):  # debug: the line with every setting
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
            assert proc.stderr is not None
            err = (await proc.stderr.read()).decode()
        assert "alice:***@" in err and PASSWORD not in err


def test_redaction_rules() -> None:
    assert redact_urls("see http://u:p@h:1/x and https://tok@h") == (
        "see http://u:***@h:1/x and https://***@h"
    )
    assert redact_urls("mail me@example.com") == "mail me@example.com"
    assert strip_userinfo("http://u:p%40ss@h:1/base") == "http://h:1/base"
