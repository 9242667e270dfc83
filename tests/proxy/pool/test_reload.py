"""Changing the set of upstreams while serving (SIGHUP, ``systemctl reload``): an added one
joins, a removed one drains and goes, and no request fails because of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import RELOAD
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.serve import serve


def steady(_path: str, _body: dict[str, Any]) -> Script:
    return Script(tokens=6, token_delay_s=0.01)


async def editors(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[int]:
    """Four editors sending requests one after another until ``stop``: their statuses."""
    statuses: list[int] = []

    async def editor(k: int) -> None:
        i = 0
        while not stop.is_set():
            headers = {"X-LLMProxy-Session": f"e{k}-{i}"}  # nothing superseded: all must end 200
            async with http.post(
                url + "/completion", json={"prompt": f"{k}"}, headers=headers
            ) as r:
                await r.read()
                statuses.append(r.status)
            i += 1

    await asyncio.gather(*(editor(k) for k in range(4)))
    return statuses


async def test_a_reload_under_load_adds_and_removes_upstreams(
    http: aiohttp.ClientSession,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        a, b, c = [
            await stack.enter_async_context(FakeUpstream(slots=2, script=steady)) for _ in "abc"
        ]
        specs = [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}]
        px = await stack.enter_async_context(run_proxy(None, upstreams=specs, route="least-busy"))
        pool = px.state.pool
        assert pool is not None
        stop = asyncio.Event()
        load = asyncio.create_task(editors(http, px.url, stop))
        await a.wait_for(lambda f: len(f.generations) >= 4)
        settings = ProxySettings(upstreams=[specs[1], {"url": c.url, "name": "c"}])
        px.app[RELOAD](settings)  # a leaves, c joins
        await wait_until(lambda: [m.name for m in pool.members] == ["b", "c"], what="a gone")
        left_a = len(a.generations)
        await c.wait_for(lambda f: len(f.generations) >= 4)  # c takes requests
        stop.set()
        statuses = await load
        assert statuses and set(statuses) == {200}
        assert len(a.generations) == left_a and a.concurrent == 0  # nothing after it drained
        assert all(f.max_concurrent <= 2 for f in (a, b, c))
        async with http.get(px.url + "/llmproxy/status") as r:
            assert [u["name"] for u in (await r.json())["upstreams"]] == ["b", "c"]
        async with http.get(px.url + "/llmproxy/metrics") as r:
            metrics = await r.text()
        assert 'llmproxy_upstream_permits_total{upstream="c"} 2.0' in metrics
        assert 'llmproxy_upstream_permits_total{upstream="a"}' not in metrics  # gone with it


async def test_one_upstream_table_is_a_pool_that_can_grow(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(script=steady) as a, FakeUpstream(script=steady) as b:
        async with run_proxy(None, upstreams=[{"url": a.url, "name": "a"}]) as px:
            pool = px.state.pool
            assert pool is not None
            px.app[RELOAD](ProxySettings(upstreams=[{"url": a.url, "name": "a"}, b.url]))
            await wait_until(lambda: len(pool.members) == 2, what="b joined")
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert r.status == 200


def write_config(path: Path, urls: list[str]) -> None:
    path.write_text(
        "".join(f'[[upstreams]]\nurl = "{u}"\nname = "u{i}"\n' for i, u in enumerate(urls))
    )


async def test_sighup_rereads_the_config_file(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """The real command: SIGHUP re-reads the TOML file; a file with a mistake changes nothing."""
    async with contextlib.AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(FakeUpstream(script=steady)) for _ in range(3)]
        cfg = tmp_path / "llmproxy.toml"
        write_config(cfg, [f.url for f in fakes[:2]])
        proc, url = await stack.enter_async_context(serve(tmp_path, "--config", str(cfg)))

        async def names() -> list[str]:
            async with http.get(url + "/llmproxy/status") as r:
                return [u["name"] for u in (await r.json())["upstreams"]]

        assert await names() == ["u0", "u1"]
        cfg.write_text("[[upstreams]]\nurl = 3\n")  # a mistake: refused, logged
        proc.send_signal(signal.SIGHUP)
        await _log_line(proc, "reload refused: invalid settings")
        write_config(cfg, [f.url for f in fakes])
        proc.send_signal(signal.SIGHUP)
        await _log_line(proc, "reload: upstreams changed")
        assert await names() == ["u0", "u1", "u2"]
        async with http.post(url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 200
        assert proc.returncode is None


async def _log_line(proc: asyncio.subprocess.Process, event: str) -> None:
    assert proc.stderr is not None
    async with asyncio.timeout(10):
        while line := await proc.stderr.readline():
            if line.startswith(b"{") and json.loads(line).get("event") == event:
                return
    raise AssertionError(f"no {event!r} line")
