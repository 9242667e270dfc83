"""Which routes hold permits and on which slots they run: id_slot per permit, embeddings,
rerank, detection."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


@pytest.mark.parametrize(
    ("kind", "expected", "capacity"),
    [("llamacpp", "llamacpp", 3), ("ollama", "ollama", 1), ("openai", "openai", 1)],
)
async def test_adapter_detection(kind: str, expected: str, capacity: int) -> None:
    async with FakeUpstream(kind=kind, slots=3) as fake, run_proxy(fake.url) as px:
        assert px.member.adapter.kind == expected
        assert px.member.gate.capacity == capacity
        assert px.member.adapter.can_confirm is (expected == "llamacpp")


async def test_id_slot_injected_per_permit(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        assert px.member.gate.capacity == 2  # from /props total_slots
        reqs = [
            http.post(
                px.url + "/infill",
                json={"id_slot": 0, "input_prefix": "x", "seq": i},
                headers={"X-LLMProxy-Session": f"s{i}"},
            )
            for i in range(4)
        ]
        for r in await asyncio.gather(*reqs):
            assert r.status == 200
            r.release()
        assert fake.max_concurrent == 2
        assert {r.body["id_slot"] for r in fake.generations} == {0, 1}


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
        assert px.member.adapter.can_confirm
        assert px.policy("auto", "/v1/embeddings") == "finish"
        assert px.policy("auto", "/completion") == "cancel"
        async with http.get(px.url + "/llmproxy/status") as r:
            policies = (await r.json())["policies"]
        assert policies == {
            "route": "cache",
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
        assert fake.completed or px.member.gate.free == 1  # held while the upstream still runs it
        await fake.wait_for(lambda f: len(f.completed) == 1)
        assert fake.aborted == []
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        async with http.post(px.url + "/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 200
            assert len((await r.json())["data"][0]["embedding"]) == 40


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
        assert px.member.gate.held == permits and fake.slot_busy.count(True) == permits
        completion = asyncio.create_task(
            http.post(px.url + "/completion", json={"prompt": "x", "n_predict": 2})
        )
        if permits == 2:
            await wait_until(
                lambda: len(px.state.pool.queue) == 1, what="the completion queued in the proxy"
            )
        else:
            await fake.wait_for(lambda f: f.concurrent == 2)
        hold.set()
        async with await batch as r:
            assert r.status == 200 and len((await r.json())["data"]) == vectors
        async with await completion as r:
            assert r.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 2


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
        assert px.member.gate.held == 1
        completion = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "x", "n_predict": 2},
                headers={"X-LLMProxy-Session": "b"},
            )
        )
        await wait_until(
            lambda: len(px.state.pool.queue) == 1, what="the completion queued in the proxy"
        )
        hold.set()
        for task in (first, completion):
            async with await task as r:
                assert r.status == 200
                await r.read()
        assert fake.deferred == [] and fake.max_concurrent == 1
        assert ("id_slot" in fake.generations[0].body) is (path == "/v1/messages")
        assert px.member.adapter.confirms(path) is (path == "/v1/messages")
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)


async def test_embeddings_wait_until_a_lower_slot_granted_before_them_is_taken(
    http: aiohttp.ClientSession,
) -> None:
    """Two grants at once: x (a completion with a large body, still on its way) gets slot 0,
    the embeddings slot 1. The server runs embeddings on its lowest idle slot: sent at once,
    they would reach it first and take slot 0, and x, pinned there by ``id_slot``, would
    wait in the server's queue. The embeddings are sent only once slot 0 is busy with x."""
    holds = {"first": asyncio.Event(), "e": asyncio.Event()}
    script = lambda _p, b: Script(tokens=2, token_delay_s=0.001, hold=holds.get(b["tag"]))  # noqa: E731

    def post(path: str, body: dict[str, Any]) -> Any:
        return http.post(px.url + path, json=body, headers={"X-LLMProxy-Session": body["tag"]})

    async with (
        FakeUpstream(slots=2, script=script) as fake,
        run_proxy(fake.url, settle_timeout_s=30, classes="off") as px,
    ):
        first = asyncio.create_task(
            post("/completion", {"prompt": "h", "n_cmpl": 2, "tag": "first"})
        )
        await fake.wait_for(lambda f: f.slot_busy == [True, True])
        x = asyncio.create_task(
            post("/completion", {"prompt": "x", "tag": "x", "pad": "y" * 900_000})
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="x queued")
        e = asyncio.create_task(post("/v1/embeddings", {"input": "e", "tag": "e"}))
        await wait_until(lambda: len(px.state.pool.queue) == 2, what="the embeddings queued")
        holds["first"].set()
        await fake.wait_for(lambda f: len(f.generations) == 3)
        holds["e"].set()
        for task in (first, x, e):
            async with await task as r:
                assert r.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 2, fake.snapshot()
        await asyncio.wait_for(px.member.gate.wait_quiescent(), 5)
