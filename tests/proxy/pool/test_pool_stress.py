"""Property-based stress of a pool of upstreams (real loopback servers): random arrivals,
sessions, client aborts, upstream errors, one upstream dying mid-run and a reload that swaps
one upstream for another, over upstreams of different capacities and every routing policy.

Invariants: no upstream ever runs more generations than its slots; every upstream's permits
are free at quiescence; exactly one outcome per request; a request the proxy says never
reached an upstream was superseded, cancelled while queued, rejected, reused, or could not
connect anywhere; what the proxy says reached an upstream is a superset of what the
upstreams saw.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import aiohttp
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import RELOAD
from tests.helpers.net import wait_until
from tests.helpers.proxy import request_events, run_proxy

NOT_SENT = ("superseded", "cancelled_queued", "rejected", "reused")


@dataclass(frozen=True)
class Op:
    delay_ms: int
    session: int
    abort_ms: int | None
    stream: bool
    tokens: int
    fail: bool


ops_strategy = st.lists(
    st.builds(
        Op,
        delay_ms=st.integers(0, 15),
        session=st.integers(0, 4),
        abort_ms=st.none() | st.integers(0, 40),
        stream=st.booleans(),
        tokens=st.integers(1, 10),
        fail=st.sampled_from([False, False, False, True]),
    ),
    min_size=1,
    max_size=16,
)


def script(_path: str, body: dict[str, object]) -> Script:
    fail = "reset_mid_stream" if body.get("fail") else None
    return Script(tokens=int(str(body["tokens"])), token_delay_s=0.004, fail=fail)


async def scenario(
    ops: list[Op], slots: list[int], route: str, kill_ms: int | None, reload_ms: int | None
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(
                FakeUpstream(slots=n, script=script, abort_linger_s=0.01)
            )
            for n in [*slots, 2]  # the last one joins at the reload
        ]
        specs = [{"url": f.url, "name": f"u{i}"} for i, f in enumerate(fakes)]
        px = await stack.enter_async_context(
            run_proxy(
                None,
                upstreams=specs[:-1],
                route=route,
                health_interval_s=0.05,
                max_queue=8,
                queue_timeout_s=5,
                affinity_wait_s=0.02,
            )
        )
        pool = px.state.pool
        assert pool is not None
        http = await stack.enter_async_context(aiohttp.ClientSession())
        logs = stack.enter_context(structlog.testing.capture_logs())

        async def client(i: int, op: Op) -> None:
            await asyncio.sleep(op.delay_ms / 1000 * i)
            body = {"prompt": f"p{op.session}", "stream": op.stream, "tokens": op.tokens}
            headers = {"X-LLMProxy-Session": str(op.session), "X-Request-Id": f"r{i}"}

            async def call() -> None:
                async with http.post(
                    px.url + "/completion", json={**body, "fail": op.fail}, headers=headers
                ) as r:
                    await r.read()

            task = asyncio.create_task(call())
            if op.abort_ms is not None:
                done, _ = await asyncio.wait([task], timeout=op.abort_ms / 1000)
                if not done:
                    task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        async def kill() -> None:
            if kill_ms is not None:
                await asyncio.sleep(kill_ms / 1000)
                await fakes[0].stop()

        async def reload() -> None:
            if reload_ms is not None:
                await asyncio.sleep(reload_ms / 1000)
                px.app[RELOAD](ProxySettings(upstreams=specs[1:]))  # u0 leaves, the last joins

        await asyncio.gather(*(client(i, op) for i, op in enumerate(ops)), kill(), reload())
        await asyncio.wait_for(pool.wait_quiescent(), 15)
        if reload_ms is not None:
            await wait_until(lambda: len(pool.members) == len(slots), 10, what="reload done")
        px.flush_log()
        must = {f"r{i}" for i, op in enumerate(ops) if op.abort_ms is None}
        await wait_until(lambda: must <= set(request_events(logs)), 10, what="log lines")
        for m in pool.members:
            assert m.gate.free == m.gate.capacity and m.gate.inflight == 0, m.describe()
        for fake, n in zip(fakes, [*slots, 2], strict=True):
            assert fake.max_concurrent <= n, fake.snapshot()
        events = [e for e in logs if e.get("event") == "request"]
        ids = [e["request_id"] for e in events]
        assert len(ids) == len(set(ids)), "a request got more than one outcome"
        for e in events:
            if not e["reached_upstream"]:
                unreachable = e["outcome"] == "error" and "unreachable" in e.get("error", "")
                assert e["outcome"] in NOT_SENT or unreachable, e
        reached_proxy = {e["request_id"] for e in events if e["reached_upstream"]}
        reached_fakes = {r.headers["X-Request-Id"] for f in fakes for r in f.generations}
        assert reached_fakes <= reached_proxy, (reached_fakes, reached_proxy)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops_strategy,
    slots=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    route=st.sampled_from(["cache", "session", "least-busy", "round-robin"]),
    kill_ms=st.none() | st.integers(0, 60),
    reload_ms=st.none() | st.integers(0, 60),
)
def test_pool_invariants_under_random_load(
    ops: list[Op], slots: list[int], route: str, kill_ms: int | None, reload_ms: int | None
) -> None:
    asyncio.run(scenario(ops, slots, route, kill_ms, reload_ms))
