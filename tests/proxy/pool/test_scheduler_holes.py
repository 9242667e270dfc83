"""Holes two admission paths left, each through the real app against the fake llama-server
(with ``/slots``): the one scheduler (pool/pool.py) closes them for one upstream and several.

1. a breaker probe handed to a request that is then superseded while it waits;
2. and 3. a reload that changes an upstream's entry: its live slot state (permits held,
   quarantined slots) stays with the server;
5. a reload never waits on a drain;
7. a keystroke answered by type-through supersedes the session's queued request, under
   ``--supersede-inflight finish`` too.

(4 and 6 are rules of the scheduler's grant, tested without HTTP in test_pool_queue.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog

from llmproxy.bench.fake.script import Script
from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.proxy.pool.health import probe_round
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import RELOAD
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


def _post(
    http: aiohttp.ClientSession, url: str, session: str, prompt: str, **body: Any
) -> asyncio.Task[tuple[int, dict[str, Any]]]:
    async def go() -> tuple[int, dict[str, Any]]:
        async with http.post(
            url + "/completion",
            json={"prompt": prompt, **body},
            headers={"X-LLMProxy-Session": session},
        ) as r:
            return r.status, await r.json(content_type=None)

    return asyncio.create_task(go())


async def test_a_superseded_waiter_never_keeps_the_breaker_probe(
    http: aiohttp.ClientSession,
) -> None:
    """Half-open upstream; S's request waits for S's stopping slot; S's next keystroke
    supersedes it. The probe must not leave with it: S's last keystroke and everyone after
    are served (it was lost for good: the upstream stayed half-open, every request 503)."""

    def script(_path: str, body: dict[str, Any]) -> Script:
        if body.get("prompt") == "fail":
            return Script(status=500)
        return Script(tokens=400, token_delay_s=0.01)

    async with (
        FakeUpstream(slots=2, script=script, abort_linger_s=0.5) as fake,
        run_proxy(
            None,
            upstreams=[{"url": fake.url, "name": "a"}],
            breaker_threshold=1,
            breaker_cooldown_s=0.2,
            affinity_wait_s=30,
            supersede_inflight="cancel",
        ) as px,
    ):
        member = px.state.pool.members[0]
        first = _post(http, px.url, "S", "one", n_predict=400)
        await fake.wait_for(lambda f: len(f.generations) == 1)
        failing = _post(http, px.url, "F", "fail")  # slot 1: 500, the breaker opens
        assert (await failing)[0] == 500
        await wait_until(lambda: member.breaker.state == "half_open", what="half-open")
        second = _post(http, px.url, "S", "two", n_predict=4)  # waits for S's slot 0
        await wait_until(lambda: fake.slot_busy == [True, False], what="slot 1 idle")
        third = _post(http, px.url, "S", "three", n_predict=4)  # supersedes the second
        assert (await second)[0] == 499
        assert (await third)[0] == 200
        assert (await first)[0] in (200, 499)
        assert member.breaker.state == "closed"
        later = _post(http, px.url, "T", "four", n_predict=4)
        assert (await later)[0] == 200


async def test_a_reload_that_changes_an_entry_keeps_its_permits_held(
    http: aiohttp.ClientSession,
) -> None:
    """A new weight for a 1-slot upstream while its slot runs a request: the next request
    waits for that slot (a second member with fresh permits ran both at once) and the
    upstream's permit gauge stays."""
    hold = asyncio.Event()
    script = lambda _p, b: Script(tokens=2, hold=hold if b.get("prompt") == "held" else None)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(None, upstreams=[{"url": fake.url, "name": "a"}]) as px,
    ):
        held = _post(http, px.url, "S", "held")
        await fake.wait_for(lambda f: len(f.generations) == 1)
        new = ProxySettings(upstreams=[{"url": fake.url, "name": "a", "weight": 2}])
        px.app[RELOAD](new)
        await wait_until(
            lambda: any(m.spec.weight == 2 for m in px.state.pool.members), what="the reload"
        )
        other = _post(http, px.url, "T", "other")
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the second one queued")
        hold.set()
        assert [(await held)[0], (await other)[0]] == [200, 200]
        assert fake.deferred == [] and fake.max_concurrent == 1
        async with http.get(px.url + "/llmproxy/metrics") as r:
            assert 'llmproxy_upstream_permits_total{upstream="a"} 1.0' in await r.text()


async def test_a_quarantined_slot_stays_quarantined_across_a_reload(
    http: aiohttp.ClientSession,
) -> None:
    """A slot whose stop was not confirmed, then a reload that changes its upstream's entry:
    the slot stays out of the grants until the server shows it idle (the new member granted
    it at once, and the old one was closed under its quarantine watcher)."""
    script = lambda _p, _b: Script(tokens=300, token_delay_s=0.01)  # noqa: E731
    with structlog.testing.capture_logs() as logs:
        async with (
            FakeUpstream(slots=1, script=script, abort_linger_s=1.0) as fake,
            run_proxy(
                None, upstreams=[{"url": fake.url, "name": "a"}], confirm_timeout_s=0.2
            ) as px,
        ):
            task = _post(http, px.url, "S", "x")
            await fake.wait_for(lambda f: len(f.generations) == 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            gate = px.state.pool.members[0].gate
            await wait_until(lambda: gate.quarantined == [0], what="the quarantine")
            px.app[RELOAD](ProxySettings(upstreams=[{"url": fake.url, "name": "b"}]))
            await wait_until(
                lambda: [m.name for m in px.state.pool.members if not m.draining] == ["b"],
                what="the reload",
            )
            later = _post(http, px.url, "T", "y", n_predict=2)
            assert (await later)[0] == 200
            assert fake.deferred == [] and fake.max_concurrent == 1
    expected = "stop confirmation timed out"
    errors = [
        e
        for e in logs
        if e.get("log_level") in ("error", "critical") and not e["event"].startswith(expected)
    ]
    assert errors == []


async def test_a_reload_is_applied_while_an_earlier_one_drains(
    http: aiohttp.ClientSession,
) -> None:
    """Removing an upstream that runs a long generation, then adding another: the second
    reload is applied at once, not after the drain."""
    hold = asyncio.Event()
    script = lambda _p, _b: Script(tokens=2, hold=hold)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as a,
        FakeUpstream(slots=1, script=script) as b,
        FakeUpstream(slots=1) as c,
        run_proxy(None, upstreams=[{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}]) as px,
    ):
        running = [_post(http, px.url, f"s{i}", f"p{i}") for i in range(2)]
        await wait_until(lambda: len(a.generations) + len(b.generations) == 2, what="both run")
        px.app[RELOAD](ProxySettings(upstreams=[{"url": a.url, "name": "a"}]))
        await wait_until(
            lambda: [m.draining for m in px.state.pool.members] == [False, True], what="b leaves"
        )
        px.app[RELOAD](
            ProxySettings(upstreams=[{"url": a.url, "name": "a"}, {"url": c.url, "name": "c"}])
        )
        await wait_until(lambda: "c" in [m.name for m in px.state.pool.members], 3, what="c joins")
        assert not hold.is_set()  # b's generation still runs
        hold.set()
        assert [(await t)[0] for t in running] == [200, 200]


async def test_a_keystroke_answered_by_type_through_supersedes_the_queued_one(
    http: aiohttp.ClientSession,
) -> None:
    """``--supersede-inflight finish``, one slot: S's generation runs, S's next keystroke
    (another prompt) queues, S's third continues the running generation and is answered
    from it. The queued one is stale: superseded, it never reaches the server."""
    script = lambda _p, _b: Script(tokens=40, token_delay_s=0.02)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(
            None,
            upstreams=[{"url": fake.url, "name": "a"}],
            supersede_inflight="finish",
            type_through="on",
        ) as px,
    ):
        first = _post(http, px.url, "S", "def main():", n_predict=40)
        await fake.wait_for(lambda f: len(f.generations) == 1)
        stale = _post(http, px.url, "S", "import os", n_predict=40)
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the stale one queued")
        typed = _post(http, px.url, "S", "def main():t0", n_predict=40)
        status, _ = await stale
        assert status == 499
        assert (await typed)[0] == 200
        assert (await first)[0] == 499  # superseded by the stale one; its generation finished
        assert len(fake.generations) == 1


async def test_an_upstream_is_not_probed_while_it_runs_our_requests(
    http: aiohttp.ClientSession,
) -> None:
    """A health probe is a request too: llama-cpp-python's server interrupts its running
    generation for it, and a busy server's slow answer would take it out of rotation. While
    a request runs there, its outcome is the upstream's health."""
    hold = asyncio.Event()
    script = lambda _p, _b: Script(tokens=2, hold=hold)  # noqa: E731
    async with (
        FakeUpstream(slots=2, script=script) as fake,
        run_proxy(fake.url, health_interval_s=3600) as px,
    ):
        probes = lambda: sum(r.path == "/health" for r in fake.received)  # noqa: E731
        await probe_round(px.state.pool)
        assert probes() == 1
        running = _post(http, px.url, "S", "x")
        await fake.wait_for(lambda f: len(f.generations) == 1)
        await probe_round(px.state.pool)
        assert probes() == 1 and px.state.pool.members[0].healthy
        hold.set()
        assert (await running)[0] == 200
        await probe_round(px.state.pool)
        assert probes() == 2


async def test_an_openai_compatible_upstream_is_probed_without_a_request() -> None:
    """llama-cpp-python's server interrupts the generation it runs (anyone's) for any
    request: an OpenAI-compatible upstream is probed by a connection only."""
    async with FakeUpstream(kind="openai", slots=1) as fake:
        async with run_proxy(fake.url, health_interval_s=3600) as px:
            before = len(fake.received)
            await probe_round(px.state.pool)
            assert len(fake.received) == before and px.state.pool.members[0].healthy
            port = int(fake.url.rsplit(":", 1)[1])
        async with run_proxy(f"http://127.0.0.1:{port}", upstream_kind="openai") as px:
            await fake.stop()
            await probe_round(px.state.pool)
            assert not px.state.pool.members[0].healthy
