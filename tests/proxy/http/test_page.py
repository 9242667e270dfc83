"""The live page: its files ship in the package, and /llmproxy/events draws the gate's state."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.http.events import PAGES
from tests.helpers.page import Events
from tests.helpers.proxy import run_proxy

SECRET = "def very_secret_marker():"


def infill(session: str, prefix: str = SECRET, **extra: Any) -> dict[str, Any]:
    return {"input_prefix": prefix, "input_suffix": "", "n_predict": 8, **extra}


async def test_page_files_are_served_from_the_package(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream() as fake, run_proxy(fake.url) as px:
        async with http.get(px.url + "/llmproxy/") as r:
            html = await r.text()
            assert r.status == 200 and r.content_type == "text/html"
            assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        # nothing from elsewhere: every src and href is the proxy's own
        refs = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert refs and all(ref.startswith("/llmproxy/") for ref in refs), refs
        for ref in refs:
            async with http.get(px.url + ref) as r:
                assert r.status == 200, ref
                urls = set(re.findall(r"https?://[^\"' )]+", await r.text()))
                assert urls <= {"http://www.w3.org/2000/svg"}, urls  # a namespace, not a fetch
        async with http.post(px.url + "/llmproxy/") as r:
            assert r.status == 405


async def test_events_show_a_busy_slot_the_queue_and_a_superseded_request(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    scripts = {"a": Script(tokens=4, hold=hold)}
    script = lambda _p, body: scripts.get(body.get("tag"), Script(tokens=4))  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, log_flush_s=0) as px,
        http.get(px.url + "/llmproxy/events") as resp,
    ):
        assert resp.headers["Content-Type"] == "text/event-stream"
        ev = Events(resp)
        name, first = await ev.next()
        assert name == "picture"
        assert [s["state"] for s in first["upstreams"][0]["slots"]] == ["idle"]
        assert first["counters"]["never_sent"] == 0

        def post(session: str, tag: str) -> asyncio.Task[int]:
            async def go() -> int:
                headers = {"X-LLMProxy-Session": session}
                async with http.post(
                    px.url + "/infill", json=infill(session, tag=tag), headers=headers
                ) as r:
                    await r.read()
                    return r.status

            return asyncio.create_task(go())

        a = post("editor-a", "a")
        await ev.until(lambda e: e.slots()[0]["state"] == "generating", what="a busy slot")
        busy = ev.slots()[0]
        assert busy["route"] == "/infill" and busy["cls"] == "complete"
        assert len(busy["session"]) == 8
        b = post("editor-b", "b")
        await ev.until(
            lambda e: [p["kind"] for p in e.picture["queue"]["places"]] == ["waiting"],
            what="b waiting",
        )
        c = post("editor-b", "c")  # b's editor typed on: b is superseded in the queue
        assert await b == 499
        await ev.until(lambda e: "superseded" in e.outcomes(), what="b superseded")
        assert ev.picture["counters"]["never_sent"] == 1
        hold.set()
        assert await a == 200 and await c == 200
        await ev.until(lambda e: e.outcomes().count("completed") == 2, what="a and c completed")
        await ev.until(
            lambda e: e.picture["counters"]["keystroke_ms"]["n"] == 2, what="two latencies"
        )
        bars = {row["outcome"]: row for row in ev.timeline}
        assert bars["superseded"]["sent"] is False and bars["superseded"]["granted_ago_ms"] is None
        done = bars["completed"]
        assert done["arrived_ago_ms"] >= done["granted_ago_ms"] >= done["ended_ago_ms"] >= 0
        assert len(fake.generations) == 2
        assert SECRET.encode() not in ev.raw and b"very_secret" not in ev.raw


async def test_events_need_the_key_in_a_header(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream() as fake, run_proxy(fake.url, api_key="page-key") as px:
        async with http.get(px.url + "/llmproxy/events") as r:
            assert r.status == 401
        async with http.get(px.url + "/llmproxy/") as r:
            assert r.status == 200  # static, no data: a browser navigates there keyless
        auth = {"Authorization": "Bearer page-key"}
        async with http.get(px.url + "/llmproxy/events", headers=auth) as r:
            assert r.status == 200
            assert (await Events(r).next())[0] == "picture"


async def test_pages_are_capped_and_end_when_the_proxy_stops(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream() as fake:
        async with run_proxy(fake.url) as px:
            px.app[PAGES].cap = 1
            async with http.get(px.url + "/llmproxy/events") as first:
                await Events(first).next()
                async with http.get(px.url + "/llmproxy/events") as second:
                    assert second.status == 503
                px.app[PAGES].close()  # what on_shutdown does
                async with asyncio.timeout(2):
                    assert await first.content.read() == b""  # it ended
            await asyncio.sleep(0)  # the handler's finally ran: the count is back
            assert px.app[PAGES].open == 0


async def test_an_upstreams_own_root_passes_through(http: aiohttp.ClientSession) -> None:
    """Only the embedded backend's ``/`` leads to the page (tests/e2e/test_banner.py): a
    llama-server keeps its web UI there."""
    async with FakeUpstream() as fake, run_proxy(fake.url) as px:
        async with http.get(px.url + "/", allow_redirects=False) as r:
            assert r.status != 302
        assert fake.received[-1].path == "/"
