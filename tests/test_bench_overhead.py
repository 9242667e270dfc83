"""``llmproxy bench overhead`` end to end: fake upstream, proxy and both floors as children.

Checks the plumbing, not speed: every request of every target succeeds, the floor
forwarder and the TCP relay pass on the same bytes as the fake, and the table carries
the floor and raw columns.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import aiohttp
from yarl import URL

from llmproxy.proxy.bench.child import child
from llmproxy.proxy.bench.loadgen import LoadResult
from llmproxy.proxy.bench.overhead import OverheadSettings, _bench, format_table, proxy_command


def test_bench_measures_direct_raw_floor_and_proxy() -> None:
    settings = OverheadSettings(requests=12, warmup=3, concurrency=[1, 4], tokens=3, token_delay_ms=[1.0])
    cases = asyncio.run(_bench(settings))
    assert [(c.mode, c.concurrency) for c in cases] == [(m, n) for m in ("nonstream", "stream") for n in (1, 4)]
    for case in cases:
        for result in (case.direct, case.raw, case.floor, case.proxied):
            assert result is not None and result.ok == 12 and result.errors == 0
    table = format_table(cases, loop="uvloop")
    assert "floor +p50" in table and "raw +p50" in table and "1ms/tok stream c=4" in table
    assert "event loop of the proxy and the floors: uvloop" in table


async def test_forwarder_relays_bytes_unchanged(tmp_path: Path) -> None:
    fake_argv = [sys.executable, "-m", "llmproxy.proxy.bench.fake_upstream", "--port", "0", "--tokens", "3",
                 "--token-delay-ms", "0"]
    async with child("fake", fake_argv, tmp_path, 60) as (_fp, fake_url), child(
        "fwd", [sys.executable, "-m", "llmproxy.proxy.bench.forwarder", "--upstream", fake_url], tmp_path, 60
    ) as (_wp, fwd_url), aiohttp.ClientSession() as http:
        for stream in (False, True):
            body = json.dumps({"prompt": "x", "stream": stream}).encode()
            async with http.post(fake_url + "/completion", data=body) as d, http.post(fwd_url + "/completion", data=body) as f:
                assert f.status == d.status == 200
                assert f.headers["Content-Type"] == d.headers["Content-Type"]
                assert await f.read() == await d.read()


async def test_splice_relays_bytes_unchanged_and_keeps_connections(tmp_path: Path) -> None:
    """The TCP relay: same bytes as the fake, keep-alive across requests on one client
    connection (one upstream connection each), and a refused upstream closes the client."""
    fake_argv = [sys.executable, "-m", "llmproxy.proxy.bench.fake_upstream", "--port", "0", "--tokens", "3",
                 "--token-delay-ms", "0"]
    async with child("fake", fake_argv, tmp_path, 60) as (_fp, fake_url), child(
        "splice", [sys.executable, "-m", "llmproxy.proxy.bench.splice", "--upstream", fake_url], tmp_path, 60
    ) as (_sp, splice_url):
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as http:
            for stream in (False, True, False):
                body = json.dumps({"prompt": "x", "stream": stream}).encode()
                async with http.post(fake_url + "/completion", data=body) as d:
                    direct = (d.status, d.headers["Content-Type"], await d.read())
                async with http.post(splice_url + "/completion", data=body) as r:
                    assert (r.status, r.headers["Content-Type"], await r.read()) == direct
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        async with child(
            "splice-dead", [sys.executable, "-m", "llmproxy.proxy.bench.splice", "--upstream", dead_url], tmp_path, 60
        ) as (_dp, dead_splice):
            dead = URL(dead_splice)
            reader, writer = await asyncio.open_connection(dead.host, dead.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed, nothing relayed
            writer.close()


async def test_bench_proxy_runs_as_users_run_it(tmp_path: Path) -> None:
    """The measured proxy writes its canonical line per request (info, its own default):
    the logging it always does is part of the overhead. It runs on the loop users get
    (uvloop, installed with the speedups extra)."""
    fake_argv = [sys.executable, "-m", "llmproxy.proxy.bench.fake_upstream", "--port", "0", "--tokens", "2",
                 "--token-delay-ms", "0"]
    async with child("fake", fake_argv, tmp_path, 60) as (_fp, fake_url):
        async with child("proxy", proxy_command(OverheadSettings(), fake_url), tmp_path, 60) as (_pp, proxy_url):
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    async with http.post(proxy_url + "/completion", json={"prompt": "x"}) as r:
                        assert r.status == 200
                        await r.read()
    lines = [json.loads(x) for x in (tmp_path / "proxy.log").read_text().splitlines() if x.startswith("{")]
    assert [e["outcome"] for e in lines if e["event"] == "request"] == ["completed"] * 3
    assert [e["loop"] for e in lines if e["event"] == "listening"] == ["uvloop"]


def test_blocks_pool_into_one_result() -> None:
    a = LoadResult([0.002, 0.001], errors=1, elapsed_s=1.0, capped=False, cpu_s=(0.5, 0.25))
    b = LoadResult([0.003], errors=0, elapsed_s=2.0, capped=True, cpu_s=(0.25, 0.25))
    m = LoadResult.merged([a, b])
    assert m.latencies_s == [0.001, 0.002, 0.003] and m.errors == 1 and m.elapsed_s == 3.0
    assert m.capped and m.cpu_s == (0.75, 0.5) and m.rps == 1.0
