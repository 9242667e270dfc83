"""``llmproxy bench overhead`` end to end: fake upstream, proxy and both floors as children.

Checks the plumbing, not speed: every request of every target succeeds, the floor
forwarder and the TCP relay pass on the same bytes as the fake, and the table carries
the floor and raw columns.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import aiohttp
from yarl import URL

from llmproxy.bench.child import child, cpu_seconds
from llmproxy.bench.loadgen import LoadResult
from llmproxy.bench.overhead.cpu import format_split, split
from llmproxy.bench.overhead.run import OverheadSettings, _bench, format_table, proxy_command
from llmproxy.bench.overhead.table import Case


def test_bench_measures_direct_raw_floor_and_proxy() -> None:
    settings = OverheadSettings(
        requests=12, warmup=3, concurrency=[1, 4], tokens=3, token_delay_ms=[1.0]
    )
    cases = asyncio.run(_bench(settings))
    assert [(c.mode, c.concurrency) for c in cases] == [
        (m, n) for m in ("nonstream", "stream") for n in (1, 4)
    ]
    for case in cases:
        for result in (case.direct, case.raw, case.floor, case.proxied):
            assert result is not None and result.ok == 12 and result.errors == 0
    table = format_table(cases, loop="uvloop")
    assert "floor +p50" in table and "raw +p50" in table and "1ms/tok stream c=4" in table
    assert "event loop of the proxy and the floors: uvloop" in table


async def test_forwarder_relays_bytes_unchanged(tmp_path: Path) -> None:
    fake_argv = [
        sys.executable,
        "-m",
        "llmproxy.bench.fake.upstream",
        "--port",
        "0",
        "--tokens",
        "3",
        "--token-delay-ms",
        "0",
    ]
    async with (
        child("fake", fake_argv, tmp_path, 60) as (_fp, fake_url),
        child(
            "fwd",
            [sys.executable, "-m", "llmproxy.bench.overhead.forwarder", "--upstream", fake_url],
            tmp_path,
            60,
        ) as (_wp, fwd_url),
        aiohttp.ClientSession() as http,
    ):
        for stream in (False, True):
            body = json.dumps({"prompt": "x", "stream": stream}).encode()
            async with (
                http.post(fake_url + "/completion", data=body) as d,
                http.post(fwd_url + "/completion", data=body) as f,
            ):
                assert f.status == d.status == 200
                assert f.headers["Content-Type"] == d.headers["Content-Type"]
                assert await f.read() == await d.read()


def _splice_argv(upstream_url: str) -> list[str]:
    return [sys.executable, "-m", "llmproxy.bench.overhead.splice", "--upstream", upstream_url]


async def test_splice_relays_the_same_responses_over_one_kept_alive_connection(
    tmp_path: Path,
) -> None:
    """The TCP relay: the fake's responses unchanged, and three requests on one client
    connection (the relay keeps it and its upstream connection open between requests)."""
    fake_argv = [
        sys.executable,
        "-m",
        "llmproxy.bench.fake.upstream",
        "--port",
        "0",
        "--tokens",
        "3",
        "--token-delay-ms",
        "0",
    ]
    opened: list[str] = []

    async def on_connect(_session: object, _ctx: object, _params: object) -> None:
        opened.append("connection")

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_connect)
    async with (
        child("fake", fake_argv, tmp_path, 60) as (_fp, fake_url),
        child("splice", _splice_argv(fake_url), tmp_path, 60) as (_sp, splice_url),
    ):
        async with (
            aiohttp.ClientSession() as direct_http,
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]
            ) as http,
        ):
            for stream in (False, True, False):
                body = json.dumps({"prompt": "x", "stream": stream}).encode()
                async with direct_http.post(fake_url + "/completion", data=body) as d:
                    direct = (
                        d.status,
                        d.headers["Content-Type"],
                        d.headers.get("Transfer-Encoding"),
                        await d.read(),
                    )
                async with http.post(splice_url + "/completion", data=body) as r:
                    relayed = (
                        r.status,
                        r.headers["Content-Type"],
                        r.headers.get("Transfer-Encoding"),
                        await r.read(),
                    )
                assert relayed == direct
    assert opened == ["connection"]


async def test_splice_passes_a_half_close_on_and_closes_on_a_refused_upstream(
    tmp_path: Path,
) -> None:
    """A client that half-closes (shutdown SHUT_WR) still gets the reply of an upstream that
    reads to EOF before answering; with nothing listening upstream the client sees a close."""

    async def answer_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        writer.write(b"got:" + data)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_after_eof, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with (
        server,
        child("splice", _splice_argv(f"http://127.0.0.1:{port}"), tmp_path, 60) as (_sp, url),
    ):
        relay = URL(url)
        reader, writer = await asyncio.open_connection(relay.host, relay.port)
        try:
            writer.write(b"hello")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 30) == b"got:hello"
        finally:
            writer.close()

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    async with child("splice-dead", _splice_argv(dead_url), tmp_path, 60) as (_dp, dead_splice):
        dead = URL(dead_splice)
        reader, writer = await asyncio.open_connection(dead.host, dead.port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                got = await asyncio.wait_for(reader.read(), 30)
            except (
                ConnectionResetError
            ):  # the relay closed with our bytes unread: a reset, also a close
                got = b""
            assert got == b""  # closed, nothing relayed
        finally:
            writer.close()


async def test_bench_proxy_runs_as_users_run_it(tmp_path: Path) -> None:
    """The measured proxy writes its canonical line per request (info, its own default):
    the logging it always does is part of the overhead. It runs on the loop users get
    (uvloop, installed with the speedups extra)."""
    fake_argv = [
        sys.executable,
        "-m",
        "llmproxy.bench.fake.upstream",
        "--port",
        "0",
        "--tokens",
        "2",
        "--token-delay-ms",
        "0",
    ]
    async with child("fake", fake_argv, tmp_path, 60) as (_fp, fake_url):
        async with child("proxy", proxy_command(OverheadSettings(), fake_url), tmp_path, 60) as (
            _pp,
            proxy_url,
        ):
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    async with http.post(proxy_url + "/completion", json={"prompt": "x"}) as r:
                        assert r.status == 200
                        await r.read()
    lines = [
        json.loads(x)
        for x in (tmp_path / "proxy.log").read_text().splitlines()
        if x.startswith("{")
    ]
    assert [e["outcome"] for e in lines if e["event"] == "request"] == ["completed"] * 3
    assert [e["loop"] for e in lines if e["event"] == "listening"] == ["uvloop"]


def test_blocks_pool_into_one_result() -> None:
    a = LoadResult([0.002, 0.001], errors=1, elapsed_s=1.0, capped=False, cpu_s=(0.5, 0.25))
    b = LoadResult([0.003], errors=0, elapsed_s=2.0, capped=True, cpu_s=(0.25, 0.25))
    m = LoadResult.merged([a, b])
    assert m.latencies_s == [0.001, 0.002, 0.003] and m.errors == 1 and m.elapsed_s == 3.0
    assert m.capped and m.cpu_s == (0.75, 0.5) and m.rps == 1.0


def test_table_says_which_goals_the_references_miss_too() -> None:
    """A goal that the floor (or the byte relay) misses in the same run is named on its row
    and in the footer: out of any proxy's reach on that stack and machine."""
    ms = lambda *v: [x / 1000 for x in v]  # noqa: E731
    direct = LoadResult(ms(80, 80, 80, 81), 0, 1.0, False, (0.1,))
    proxied = LoadResult(ms(80.5, 80.5, 80.5, 86), 0, 1.0, False, (0.1, 0.2))
    floor = LoadResult(ms(80.4, 80.4, 80.4, 85), 0, 1.0, False, (0.1, 0.15))
    raw = LoadResult(ms(80.1, 80.1, 80.1, 81.5), 0, 1.0, False, (0.1, 0.05))
    both = [
        Case("stream", 32, direct, proxied, 5.0, floor, raw),
        Case("nonstream", 1, direct, proxied, 5.0, raw, raw),
    ]
    table = format_table(both, loop="uvloop")
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines() if "ms/tok" in line}
    assert rows["5ms/tok stream c=32"].endswith("p50 PASS, p99 FAIL, thr PASS, (floor misses p99)")
    assert rows["5ms/tok nonstream c=1"].endswith(
        "p50 PASS, p99 FAIL, thr PASS"
    )  # its references meet every goal
    assert "overall (paced upstream rows): FAIL" in table
    assert (
        "rows where a reference misses a goal too, in the same run: 5ms/tok stream c=32 (" in table
    )


def test_overhead_bench_direct_half() -> None:
    """The overhead bench's own plumbing: fake upstream child, load, table (no proxy)."""
    settings = OverheadSettings(
        requests=20, warmup=2, concurrency=[1, 3], proxy=False, tokens=4, token_delay_ms=[1.0, 0.0]
    )
    cases = asyncio.run(_bench(settings))
    shapes = [(m, c) for m in ("nonstream", "stream") for c in (1, 3)]
    assert [(c.token_delay_ms, c.mode, c.concurrency) for c in cases] == [
        (d, *mc) for d in (1.0, 0.0) for mc in shapes
    ]
    assert all(c.direct.ok == 20 and c.direct.errors == 0 and c.proxied is None for c in cases)
    # CPU was read (clock ticks are 10 ms, so a short case may show 0, never NaN or < 0)
    assert all(c.direct.cpu_us_per_request(0) >= 0 for c in cases)
    assert cpu_seconds(os.getpid()) > 0
    assert all(
        c.direct.percentile_ms(50) >= 4 for c in cases if c.token_delay_ms == 1.0
    )  # 4 tokens x 1 ms
    table = format_table(cases, loop="asyncio")
    assert "1ms/tok stream c=3" in table and "instant nonstream c=1" in table
    assert "overall (paced upstream rows): n/a" in table


def test_cprofile_splits_the_proxys_cpu_per_request_by_part(tmp_path: Path) -> None:
    """``--cprofile``: the proxy child runs under cProfile, writes its statistics when the
    bench stops it, and the split counts the gated requests it served and the own time of
    its parts (the import machinery left out)."""
    out = tmp_path / "proxy.prof"
    settings = OverheadSettings(
        requests=20,
        warmup=5,
        concurrency=[2],
        modes=["nonstream"],
        tokens=2,
        token_delay_ms=[0.0],
        floor=False,
        raw=False,
        cprofile=out,
    )
    assert proxy_command(settings, "http://127.0.0.1:9")[1:5] == [
        "-m",
        "cProfile",
        "-o",
        str(out.resolve()),
    ]
    asyncio.run(_bench(settings))
    requests, parts = split(out)
    assert requests == 25  # warm-up and measured, through the proxy only
    named = dict(parts)
    assert "startup" not in named
    assert named["proxy/pool"] > 0 and named["proxy/upstream"] > 0 and named["aiohttp"] > 0
    table = format_split(out, top=len(parts))
    assert "(25 requests;" in table and "| proxy/pool |" in table and "others" not in table
