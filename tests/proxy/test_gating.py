"""Gating scenarios against the real fake upstream: bursts, supersede, disconnects, policies."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.gating.gate import Gate
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


def infill(seq: int, **extra: Any) -> dict[str, Any]:
    return {
        "id_slot": 0,
        "input_prefix": "def f():\n",
        "input_suffix": "",
        "prompt": "    re",
        "n_predict": 128,
        "stream": False,
        "cache_prompt": True,
        "seq": seq,
        **extra,
    }


def request_events(logs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["request_id"]: e for e in logs if e.get("event") == "request"}


async def test_runs_on_the_loop_its_id_names(request: pytest.FixtureRequest) -> None:
    """This suite runs on both loops (conftest.BOTH_LOOPS): each run is on the one it names."""
    loop_id = request.node.name.rsplit("[", 1)[1].rstrip("]")
    assert loop_id in ("asyncio", "uvloop")
    assert type(asyncio.get_running_loop()).__module__.split(".")[0] == loop_id


async def test_editor_burst_one_session(http: aiohttp.ClientSession) -> None:
    """20 keystrokes 50 ms apart, each abandoning the previous request, N=1."""
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.02)  # noqa: E731  ~0.4 s per generation
    async with (
        FakeUpstream(slots=1, abort_linger_s=0.15, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        with structlog.testing.capture_logs() as logs:

            async def one(i: int) -> tuple[int, bytes]:
                async with http.post(
                    px.url + "/infill",
                    json=infill(i),
                    headers={"X-Request-Id": f"k{i}", "User-Agent": "curl/8.5.0"},
                ) as r:
                    return r.status, await r.read()

            tasks: list[asyncio.Task[tuple[int, bytes]]] = []
            for i in range(20):
                if tasks:
                    tasks[-1].cancel()  # the editor closes the previous connection
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.05)  # the keystroke interval being simulated
            status, body = await tasks[-1]
            await asyncio.gather(*tasks[:-1], return_exceptions=True)
            await asyncio.wait_for(px.state.gate.wait_quiescent(), 10)
            await wait_until(lambda: len(request_events(logs)) == 20, what="20 canonical log lines")

        assert status == 200
        assert json.loads(body)["content"] == "".join(f"t{i} " for i in range(20))
        assert fake.max_concurrent == 1
        events = request_events(logs)
        reached = {r.body["seq"] for r in fake.generations}
        sent = {seq for seq in range(20) if events[f"k{seq}"]["reached_upstream"]}
        assert sent == reached  # the proxy's own view matches what the upstream saw
        for seq in set(range(20)) - reached:  # dropped before the upstream: never "completed"
            assert events[f"k{seq}"]["outcome"] in ("superseded", "cancelled_queued"), events[
                f"k{seq}"
            ]
        for seq in reached - {19}:  # abandoned by the editor while running
            assert events[f"k{seq}"]["outcome"] in ("superseded", "cancelled_inflight"), events[
                f"k{seq}"
            ]
        assert events["k19"]["outcome"] == "completed"
        assert 19 in reached and len(reached) < 10, reached
        assert all(r.body["id_slot"] == 0 for r in fake.generations)
        assert px.state.gate.free == 1


async def test_disconnect_while_queued_never_reaches_upstream(http: aiohttp.ClientSession) -> None:
    gate_open = asyncio.Event()

    def script(_p: str, body: dict[str, Any]) -> Script:
        return Script(tokens=3, token_delay_s=0.01)

    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.05) as fake,
        run_proxy(fake.url) as px,
    ):
        first = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "a", "seq": 1, "n_predict": 400},
                headers={"X-LLMProxy-Session": "one"},
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        second = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "b", "seq": 2},
                headers={"X-LLMProxy-Session": "two"},
            )
        )
        await wait_until(lambda: px.state.gate.queued == 1, what="second request queued")
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        await wait_until(lambda: px.state.gate.queued == 0, what="queued request dropped")
        gate_open.set()
        resp = await first
        assert resp.status == 200
        resp.release()
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
        assert [r.body["seq"] for r in fake.generations] == [1]


async def test_supersede_inflight_cancels_and_holds_permit_until_idle(
    http: aiohttp.ClientSession,
) -> None:
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.3) as fake,
        run_proxy(fake.url) as px,
    ):
        hdr = {"X-LLMProxy-Session": "ed"}
        first = asyncio.create_task(
            http.post(px.url + "/completion", json={"prompt": "a", "seq": 1}, headers=hdr)
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        second = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "b", "seq": 2, "n_predict": 3}, headers=hdr
            )
        )
        r1 = await first
        assert r1.status == 499
        assert (await r1.json())["error"]["type"] == "superseded"
        await fake.wait_for(lambda f: len(f.aborted) == 1)
        r2 = await second
        assert r2.status == 200 and (await r2.json())["content"] == "t0 t1 t2 "
        assert fake.max_concurrent == 1  # second started only after the abort linger ended
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)


async def test_finish_policy_drains_without_cancelling(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(kind="openai", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        assert px.state.policy(px.state.settings.on_disconnect) == "finish"
        task = asyncio.create_task(
            http.post(px.url + "/v1/completions", json={"prompt": "x", "seq": 1})
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fake.wait_for(lambda f: len(f.completed) == 1)
        assert fake.aborted == []
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)


async def test_no_slots_endpoint_falls_back_to_finish(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(slots=1, slots_endpoint=False) as fake, run_proxy(fake.url) as px:
        assert not px.state.adapter.can_confirm
        assert px.state.policy("auto") == "finish"


async def test_confirm_timeout_releases_loudly(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=30) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.3) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x"}))
            await fake.wait_for(lambda f: len(f.generations) == 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
        assert any(
            e["log_level"] == "error" and "confirmation timed out" in e["event"] for e in logs
        )
        assert px.state.metrics.confirm_timeouts._value.get() == 1


async def test_a_slot_whose_stop_was_not_confirmed_stays_out_of_the_gate_until_idle(
    http: aiohttp.ClientSession,
) -> None:
    """After ``confirm_timeout_s`` the slot may still run the stopped request: it is
    quarantined (shown in status and metrics, capacity counted down) instead of released,
    and a request pinned to it waits in the proxy's queue, not in the server's, until /slots
    shows it idle."""
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=1.0) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.2) as px,
    ):
        gate = px.state.gate
        task = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "x"}, headers={"X-LLMProxy-Session": "a"}
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(
            lambda: px.state.metrics.confirm_timeouts._value.get() == 1, what="the confirm timeout"
        )
        assert fake.slot_busy == [True]  # still lingering after the abort
        async with http.get(px.url + "/llmproxy/status") as r:
            status = await r.json()
        assert status["quarantine"] == {"slots": [0]} and status["permits"] == {
            "total": 0,
            "free": 0,
            "held": 0,
        }
        async with http.get(px.url + "/llmproxy/metrics") as r:
            text = await r.text()
        assert "llmproxy_permits_quarantined 1.0" in text and "llmproxy_permits_total 0.0" in text
        async with http.post(
            px.url + "/completion",
            json={"prompt": "y", "n_predict": 2},
            headers={"X-LLMProxy-Session": "b"},
        ) as r:
            assert r.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 1
        assert gate.quarantined == [] and gate.capacity == gate.free == 1
        await asyncio.wait_for(gate.wait_quiescent(), 5)


async def test_queue_full_429_and_queue_timeout_503(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=100, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, max_queue=1, queue_timeout_s=0.3, retry_after_s=2) as px,
    ):
        hold = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "a"}, headers={"X-LLMProxy-Session": "a"}
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        queued = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "b"}
            )
        )
        await wait_until(lambda: px.state.gate.queued == 1, what="one queued")
        async with http.post(
            px.url + "/completion", json={"prompt": "c"}, headers={"X-LLMProxy-Session": "c"}
        ) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "2"
            assert (await r.json())["error"]["src"] == "llmproxy"
        r = await queued
        assert r.status == 503 and (await r.json())["error"]["type"] == "queue_timeout"
        (await hold).release()
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
        assert len(fake.generations) == 1


async def test_warmup_is_not_superseded(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=30, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        hdr = {"X-LLMProxy-Session": "ed"}
        busy = asyncio.create_task(http.post(px.url + "/infill", json=infill(0), headers=hdr))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        warm = asyncio.create_task(
            http.post(px.url + "/infill", json=infill(1, n_predict=0), headers=hdr)
        )
        await wait_until(lambda: px.state.gate.queued == 1, what="warm-up queued")
        real = asyncio.create_task(http.post(px.url + "/infill", json=infill(2), headers=hdr))
        statuses = [(await t).status for t in (busy, warm, real)]
        assert statuses[1] == 200 and statuses[2] == 200
        assert sorted(r.body["seq"] for r in fake.generations) == [0, 1, 2]


@pytest.mark.parametrize(
    "path", ["/completion", "/infill", "/v1/completions", "/v1/chat/completions", "/api/chat"]
)
async def test_llamacpp_generation_routes_run_on_the_permits_slot(
    http: aiohttp.ClientSession, path: str
) -> None:
    """Permit i is slot i on every llama-server generation route, its Ollama-style
    ``/api/chat`` included (served by its chat-completions handler): a stop is confirmed
    on the slot the request really ran on."""
    async with FakeUpstream(slots=2) as fake, run_proxy(fake.url) as px:
        body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "stream": False}
        async with http.post(px.url + path, json=body) as r:
            assert r.status == 200
            await r.read()
        assert [g.body.get("id_slot") for g in fake.generations] == [0]


async def test_llamacpp_embeddings_are_finished_not_cancelled(http: aiohttp.ClientSession) -> None:
    """llama-server runs /v1/embeddings on any free slot (no ``id_slot``), so slot i idle
    would not prove the stop: under ``auto`` a client that leaves lets it finish, and the
    permit comes back when the upstream really ended; generation routes still cancel."""
    script = lambda _p, _b: Script(tokens=40, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        assert px.state.adapter.can_confirm
        assert px.state.policy("auto", "/v1/embeddings") == "finish"
        assert px.state.policy("auto", "/completion") == "cancel"
        async with http.get(px.url + "/llmproxy/status") as r:
            policies = (await r.json())["policies"]
        assert policies == {
            "supersede_inflight": "cancel",
            "on_disconnect": "cancel",  # no /api/generate on llama-server
            "unconfirmed_routes": [
                "/api/generate",
                "/embedding",
                "/embeddings",
                "/rerank",
                "/reranking",
                "/v1/embeddings",
                "/v1/rerank",
                "/v1/reranking",
            ],
        }
        task = asyncio.create_task(
            http.post(px.url + "/v1/embeddings", json={"input": "x", "model": "m"})
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        assert "id_slot" not in fake.generations[0].body
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert fake.completed or px.state.gate.free == 1  # held while the upstream still runs it
        await fake.wait_for(lambda f: len(f.completed) == 1)
        assert fake.aborted == []
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
        async with http.post(px.url + "/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 200
            assert len((await r.json())["data"][0]["embedding"]) == 40


async def test_n_cmpl_holds_one_permit_per_slot_it_runs_on(http: aiohttp.ClientSession) -> None:
    """llama.vscode's ``n_cmpl: 2`` runs on two llama-server slots at once: it must hold two
    permits, so that the upstream never has to defer a request the gate let through (its
    queue is unbounded and blind to supersede) and never runs more than N generations."""
    holds = {0: asyncio.Event(), 1: asyncio.Event()}  # the first two generations run until released
    script = lambda _p, b: Script(tokens=6, token_delay_s=0.001, hold=holds.get(b["seq"]))  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        gate = px.state.gate
        with structlog.testing.capture_logs() as logs:

            async def post(seq: int, session: str, **extra: Any) -> tuple[int, Any]:
                body = {"input_prefix": "x", "prompt": "", "seq": seq, **extra}
                async with http.post(
                    px.url + "/infill",
                    json=body,
                    headers={"X-LLMProxy-Session": session, "X-Request-Id": f"n{seq}"},
                ) as r:
                    return r.status, await r.json()

            first = asyncio.create_task(post(0, "a"))
            await fake.wait_for(lambda f: f.slot_busy == [True, False])
            wide = asyncio.create_task(post(1, "b", n_cmpl=2))
            await wait_until(lambda: gate.queued == 1, what="the wide request queued")
            third = asyncio.create_task(post(2, "c"))
            await wait_until(lambda: gate.queued == 2, what="the third request queued behind it")
            assert (
                gate.free == 1 and gate.held == 1
            )  # free, but the wide request needs two and is first
            holds[0].set()
            await fake.wait_for(lambda f: len(f.generations) == 2 and f.slot_busy == [True, True])
            async with http.get(px.url + "/llmproxy/status") as r:
                status = await r.json()
            assert status["permits"] == {"total": 2, "free": 0, "held": 2} and gate.queued == 1
            [running] = status["inflight"]
            assert running["slots"] == [0, 1]
            holds[1].set()
            results = await asyncio.gather(first, wide, third)
            await asyncio.wait_for(gate.wait_quiescent(), 5)
            px.flush_log()
            assert {"n0", "n1", "n2"} <= request_events(logs).keys()

        assert [s for s, _ in results] == [200, 200, 200]
        assert [(c["index"], c["id_slot"]) for c in results[1][1]] == [(0, 0), (1, 1)]
        assert fake.deferred == [] and fake.max_concurrent == 2
        assert [g.body["seq"] for g in fake.generations] == [
            0,
            1,
            2,
        ]  # FIFO: nobody overtook the wide one
        assert fake.generations[1].body["id_slot"] == running["slot"] == 0
        events = request_events(logs)
        assert events["n1"]["permits"] == 2 and "permits" not in events["n0"]
        assert gate.free == 2


@pytest.mark.parametrize(
    ("extra", "permits"),
    [
        ({"n_cmpl": 2}, 2),
        ({"n": 2}, 2),
        ({"n_cmpl": None, "n": 2}, 2),
        ({"n_cmpl": "x", "n": 2}, 2),
        ({"n_cmpl": 2.7}, 2),
        ({"n_cmpl": 1, "n": 2}, 1),
        ({"n_cmpl": True}, 1),
        ({"n_cmpl": 0}, 1),
        ({}, 1),
        ({"n_cmpl": float("inf"), "n": 2}, 2),
        ({"n_cmpl": float("nan")}, 1),
    ],  # Python's json reads Infinity, NaN
)
async def test_n_cmpl_is_read_as_llama_server_reads_it(
    http: aiohttp.ClientSession, extra: dict[str, Any], permits: int
) -> None:
    """``json_value(data, "n_cmpl", json_value(data, "n", 1))``: whatever makes the server run
    k completions makes the proxy hold k permits; the fake upstream runs them on k slots."""
    hold = asyncio.Event()
    async with (
        FakeUpstream(slots=2, script=lambda _p, _b: Script(tokens=1, hold=hold)) as fake,
        run_proxy(fake.url) as px,
    ):
        task = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x", **extra}))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        assert px.state.gate.held == permits and fake.slot_busy.count(True) == permits
        hold.set()
        async with await task as r:
            assert r.status == 200
        assert fake.deferred == []


async def test_n_cmpl_waits_for_a_lower_slot_granted_just_before_it_to_be_taken(
    http: aiohttp.ClientSession,
) -> None:
    """Two grants at once: x (a large body, still on its way) gets slot 0, the wide request
    slots 1 and 2. Sent at once, the small wide request would reach the server first and its
    extra completion would take slot 0, still idle there, so x would wait in the server's
    queue. The wide request is sent only once slot 0 is busy with x."""
    holds = {
        0: asyncio.Event(),
        1: asyncio.Event(),
    }  # x stays on its slot until the wide one is done
    script = lambda _p, b: Script(tokens=2, token_delay_s=0.001, hold=holds.get(b["seq"]))  # noqa: E731
    async with (
        FakeUpstream(slots=3, script=script) as fake,
        run_proxy(fake.url, settle_timeout_s=30) as px,
    ):
        gate = px.state.gate

        async def post(seq: int, session: str, **extra: Any) -> tuple[int, Any]:
            async with http.post(
                px.url + "/completion",
                json={"prompt": "p", "seq": seq, **extra},
                headers={"X-LLMProxy-Session": session},
            ) as r:
                return r.status, await r.json()

        first = asyncio.create_task(post(0, "h", n_cmpl=3))  # holds every slot until released
        await fake.wait_for(lambda f: f.slot_busy == [True, True, True])
        x = asyncio.create_task(post(1, "x", pad="y" * 900_000))
        await wait_until(lambda: gate.queued == 1, what="x queued")
        wide = asyncio.create_task(post(2, "w", n_cmpl=2))
        await wait_until(lambda: gate.queued == 2, what="the wide request queued")
        holds[0].set()
        (s2, bw) = await wide
        holds[1].set()
        (s0, _), (s1, bx) = await asyncio.gather(first, x)
        assert (s0, s1, s2) == (200, 200, 200)
        assert bx["id_slot"] == 0 and [c["id_slot"] for c in bw] == [1, 2]
        assert fake.deferred == [] and fake.max_concurrent == 3
        await asyncio.wait_for(gate.wait_quiescent(), 5)


async def test_settle_gives_up_loudly_and_is_cancellable(http: aiohttp.ClientSession) -> None:
    """A lower slot held for a pinned request that never shows busy: the wide request is sent
    after ``settle_timeout_s`` with a warning; a stop while settling ends it at once; a slot
    held for a request the server does not pin (embeddings) is not waited for."""
    async with FakeUpstream(slots=3) as fake, run_proxy(fake.url, settle_timeout_s=0.2) as px:
        adapter, gate = px.state.adapter, Gate(3, 5)  # a gate of our own: nothing reaches the fake
        x = gate.submit("x", supersedable=False, route="/completion")
        gate.take(x)
        wide = gate.submit("w", supersedable=False, route="/completion", permits=2)
        gate.take(wide)
        with structlog.testing.capture_logs() as logs:
            start = asyncio.get_running_loop().time()
            await adapter.settle(gate, wide)
        # uvloop's clock counts whole milliseconds: 4373.767 - 4373.567 is 0.19999... in floats
        assert round(asyncio.get_running_loop().time() - start, 3) >= 0.2
        assert [e["slots"] for e in logs if e["log_level"] == "warning"] == [[1, 2]]
        polls = sum(r.path == "/slots" for r in fake.received)
        task = asyncio.create_task(adapter.settle(gate, wide))
        await fake.wait_for(lambda f: sum(r.path == "/slots" for r in f.received) > polls)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wide.slots == (1, 2) and gate.settle_extras(wide, lambda _t: True) == {0}
        gate.settled(wide)
        gate.release(x)
        emb = gate.submit("e", supersedable=False, route="/v1/embeddings")
        gate.take(emb)  # slot 0 again, on any slot at the server: not waited for
        polls = sum(r.path == "/slots" for r in fake.received)
        await asyncio.wait_for(adapter.settle(gate, wide), 0.1)
        assert sum(r.path == "/slots" for r in fake.received) == polls


@pytest.mark.parametrize(
    ("inp", "permits", "vectors"),
    [
        ("x", 1, 1),
        (["a", "b"], 2, 2),
        (["a", "b", "c"], 2, 3),
        ([1, 2, 3], 1, 1),
        ([[1, 2], [3]], 2, 2),
        ([], 1, 1),
    ],
)
async def test_embeddings_batch_holds_a_permit_per_slot_it_takes(
    http: aiohttp.ClientSession, inp: Any, permits: int, vectors: int
) -> None:
    """llama-server runs each embeddings input as its own task on any idle slot: a batch of n
    holds min(n, capacity) permits, so a completion sent meanwhile waits in the proxy's
    queue (where supersede reaches it), not in the server's."""
    hold = asyncio.Event()
    script = lambda p, _b: Script(tokens=2, hold=hold if p == "/v1/embeddings" else None)  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        batch = asyncio.create_task(
            http.post(px.url + "/v1/embeddings", json={"input": inp, "model": "m"})
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        assert px.state.gate.held == permits and fake.slot_busy.count(True) == permits
        completion = asyncio.create_task(
            http.post(px.url + "/completion", json={"prompt": "x", "n_predict": 2})
        )
        if permits == 2:
            await wait_until(
                lambda: px.state.gate.queued == 1, what="the completion queued in the proxy"
            )
        hold.set()
        async with await batch as r:
            assert r.status == 200 and len((await r.json())["data"]) == vectors
        async with await completion as r:
            assert r.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 2


async def test_n_cmpl_over_capacity_is_refused_before_the_upstream(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream(slots=2) as fake, run_proxy(fake.url) as px:
        for path, body, field in (
            ("/infill", {"input_prefix": "x", "n_cmpl": 3}, "n_cmpl"),
            ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
        ):
            async with http.post(px.url + path, json=body) as r:
                assert r.status == 400, path
                err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error"
            assert err["message"].startswith(
                f"'{field}' = 3 needs 3 slots at once, llmproxy has 2: "
            ), err
        async with http.post(
            px.url + "/infill", json={"input_prefix": "x", "n_cmpl": 2, "n_predict": 2}
        ) as r:
            assert r.status == 200 and len(await r.json()) == 2
        assert len(fake.generations) == 1 and px.state.gate.free == 2
    async with FakeUpstream(slots=2) as fake, run_proxy(fake.url, capacity=1) as px:
        async with http.post(px.url + "/infill", json={"input_prefix": "x", "n_cmpl": 2}) as r:
            assert r.status == 400
            assert (
                "--capacity is below the upstream's 2 slots" in (await r.json())["error"]["message"]
            )
        assert fake.generations == []


async def test_cancelled_n_cmpl_holds_its_permits_until_every_slot_is_idle(
    http: aiohttp.ClientSession,
) -> None:
    """The client leaves a two-slot request: both permits stay held until /slots shows both
    slots idle (the upstream keeps aborted slots busy for a while), so the next request
    never waits inside the upstream."""
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=2, script=script, abort_linger_s=0.3) as fake,
        run_proxy(fake.url) as px,
    ):
        r = await http.post(
            px.url + "/completion",
            json={"prompt": "a", "n_cmpl": 2, "stream": True},
            headers={"X-LLMProxy-Session": "one"},
        )
        await r.content.readline()
        r.close()
        await fake.wait_for(lambda f: len(f.aborted) == 1)
        assert fake.slot_busy == [True, True]
        async with http.post(
            px.url + "/completion",
            json={"prompt": "b", "n_predict": 2},
            headers={"X-LLMProxy-Session": "two"},
        ) as r2:
            assert r2.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 2
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)


async def test_stop_confirmation_waits_for_every_slot_of_the_request(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    script = lambda _p, _b: Script(tokens=3, hold=hold)  # noqa: E731
    async with (
        FakeUpstream(slots=2, script=script) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.1) as px,
    ):
        adapter = px.state.adapter
        busy = asyncio.create_task(
            http.post(fake.url + "/completion", json={"prompt": "x", "id_slot": 1})
        )
        await fake.wait_for(lambda f: f.slot_busy == [False, True])
        assert await adapter.confirm_stopped((0,)) is True
        assert await adapter.confirm_stopped((0, 1)) is False  # slot 1 still busy: timed out
        hold.set()
        (await busy).release()
        await fake.wait_for(lambda f: f.slot_busy == [False, False])
        assert await adapter.confirm_stopped((0, 1)) is True
        assert await adapter.confirm_stopped((0, 5)) is False  # a slot the server does not list


class _NoNames(aiohttp.abc.AbstractResolver):
    """A resolver that fails like a name that does not resolve (no network needed)."""

    async def resolve(self, host: str, port: int = 0, family: int = 0) -> list[Any]:
        raise OSError(-2, "Name or service not known")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("failure", ["refused", "no-name"])
async def test_only_a_refused_connection_confirms_a_stop_at_once(failure: str) -> None:
    """Refused: nothing listens, so nothing runs: confirmed. A failure that says nothing about
    the server (a name that does not resolve now, no file descriptors) is not: the stop is
    polled until confirm_timeout_s, which then logs and counts the timeout."""
    from llmproxy.proxy.settings import ProxySettings
    from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
    from tests.helpers.net import closed_port

    base = (
        f"http://127.0.0.1:{closed_port()}"
        if failure == "refused"
        else "http://backend.internal:8012"
    )
    settings = ProxySettings(upstream=base, confirm_timeout_s=0.2)
    connector = aiohttp.TCPConnector(resolver=_NoNames()) if failure == "no-name" else None
    async with aiohttp.ClientSession(connector=connector) as session:
        adapter = LlamaCppAdapter(base, session, settings, slots=1)
        try:
            assert await adapter._busy_map() == ("down" if failure == "refused" else "unknown")
            assert await adapter.confirm_stopped([0]) is (failure == "refused")
        finally:
            adapter.close()


@pytest.mark.parametrize("how", ["client_left", "superseded"])
async def test_a_request_stopped_before_it_was_sent_never_reaches_the_upstream(
    http: aiohttp.ClientSession, how: str
) -> None:
    """Policy ``finish`` lets a request that was sent run to its end; one stopped between its
    grant and its send (here: while it waits to settle its ``n_cmpl`` slots behind a lower
    slot granted to a request still on its way) is never sent, whatever the policy."""
    async with (
        FakeUpstream(slots=3) as fake,
        run_proxy(
            fake.url, settle_timeout_s=1, on_disconnect="finish", supersede_inflight="finish"
        ) as px,
    ):
        gate = px.state.gate
        on_its_way = gate.submit(
            "x", supersedable=False, route="/completion"
        )  # slot 0, never busy upstream
        gate.take(on_its_way)
        polls = sum(r.path == "/slots" for r in fake.received)
        hdr = {"X-LLMProxy-Session": "editor", "X-Request-Id": "wide"}
        with structlog.testing.capture_logs() as logs:
            wide = asyncio.create_task(
                http.post(px.url + "/completion", json={"prompt": "p", "n_cmpl": 2}, headers=hdr)
            )
            await fake.wait_for(
                lambda f: sum(r.path == "/slots" for r in f.received) > polls
            )  # settling
            assert gate.inflight == 2 and fake.generations == []
            if how == "client_left":
                wide.cancel()
                await asyncio.gather(wide, return_exceptions=True)
            else:
                async with http.post(
                    px.url + "/completion",
                    json={"prompt": "q", "n_predict": 2},
                    headers={**hdr, "X-Request-Id": "newer"},
                ) as r:
                    assert r.status == 200
                async with await wide as r:
                    assert r.status == 499 and (await r.json())["error"]["type"] == "superseded"
            await wait_until(lambda: gate.inflight == 1, what="the stopped request's permits back")
            gate.release(on_its_way)
            await asyncio.wait_for(gate.wait_quiescent(), 5)
            px.flush_log()
        assert all("n_cmpl" not in g.body for g in fake.generations), fake.snapshot()
        line = request_events(logs)["wide"]
        assert line["reached_upstream"] is False
        assert line["outcome"] == ("cancelled_queued" if how == "client_left" else "superseded")


SLOT_USERS = [
    ("/embedding", {"content": "x"}),
    ("/embeddings", {"input": "x"}),
    ("/v1/embeddings", {"input": "x"}),
    ("/rerank", {"query": "q", "documents": ["a"]}),
    ("/reranking", {"query": "q", "texts": ["a"]}),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ("/v1/reranking", {"query": "q", "documents": ["a"]}),
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
    ),
]


@pytest.mark.parametrize(("path", "body"), SLOT_USERS, ids=[p for p, _ in SLOT_USERS])
async def test_every_llama_server_route_that_runs_on_a_slot_is_gated(
    http: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> None:
    """llama-server runs its own embeddings and rerank routes and Anthropic-style
    ``/v1/messages`` on its slots: each holds a permit, so a completion sent meanwhile waits
    in the proxy's queue (where supersede reaches it), not in the server's. ``/v1/messages``
    is chat: pinned with ``id_slot`` (stops confirmed); the others run on any slot."""
    hold = asyncio.Event()
    script = lambda p, _b: Script(tokens=2, hold=hold if p == path else None)  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        first = asyncio.create_task(
            http.post(px.url + path, json=body, headers={"X-LLMProxy-Session": "a"})
        )
        await fake.wait_for(lambda f: f.concurrent == 1)
        assert px.state.gate.held == 1
        completion = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "x", "n_predict": 2},
                headers={"X-LLMProxy-Session": "b"},
            )
        )
        await wait_until(
            lambda: px.state.gate.queued == 1, what="the completion queued in the proxy"
        )
        hold.set()
        for task in (first, completion):
            async with await task as r:
                assert r.status == 200
                await r.read()
        assert fake.deferred == [] and fake.max_concurrent == 1
        assert ("id_slot" in fake.generations[0].body) is (path == "/v1/messages")
        assert px.state.adapter.confirms(path) is (path == "/v1/messages")
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
