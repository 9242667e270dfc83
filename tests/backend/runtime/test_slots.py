"""Parallel slots: requests run at once, ``id_slot`` is honoured, ``n_cmpl`` takes several
slots at once (also through the proxy's gate), and a slot whose worker is down reads busy
while requests pinned to it run elsewhere."""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

import aiohttp
import pytest

from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams
from llmproxy.backend.settings import BackendSettings
from tests.helpers.backend.server import LONG, parallel_flags
from tests.helpers.proxy import run_proxy


@pytest.fixture(scope="module")
def two_slots(engine: str, start_backend: Any) -> Any:
    return start_backend(engine, *parallel_flags(engine, 2))


async def test_parallel_slots_run_at_once(two_slots: Any) -> None:
    assert [s["id"] for s in two_slots.slots()] == [0, 1]
    req = {**LONG, "n_predict": 200, "stream": False}
    async with aiohttp.ClientSession() as s:
        tasks = [
            asyncio.ensure_future(s.post(two_slots.url + "/completion", json=req)) for _ in range(2)
        ]
        both = False
        t_end = time.monotonic() + 30
        while not both and time.monotonic() < t_end and not all(t.done() for t in tasks):
            async with s.get(two_slots.url + "/slots") as r:
                sl = await r.json()
            both = all(x["is_processing"] and x["n_decoded"] > 0 for x in sl)
            await asyncio.sleep(0.01)
        results = []
        for t in tasks:
            r = await t
            results.append((r.status, await r.json()))
            r.release()
    assert both, "the two requests never ran at the same time"
    assert all(st == 200 and b["stop"] for st, b in results)
    assert sorted(b["id_slot"] for _, b in results) == [0, 1]


async def test_id_slot_honoured_and_busy_slot_waits(two_slots: Any) -> None:
    async with aiohttp.ClientSession() as s:
        long = asyncio.ensure_future(
            s.post(
                two_slots.url + "/completion",
                json={**LONG, "n_predict": 100, "stream": False, "id_slot": 1},
            )
        )
        t_end = time.monotonic() + 30
        while True:
            async with s.get(two_slots.url + "/slots") as r:
                if (await r.json())[1]["is_processing"]:
                    break
            assert time.monotonic() < t_end
            await asyncio.sleep(0.005)
        async with s.post(
            two_slots.url + "/completion", json={"prompt": "x", "n_predict": 2, "id_slot": 1}
        ) as r:
            short = await r.json()
        assert long.done(), "a request for a busy slot must wait for it"
        first = await long
        first_body = await first.json()
        first.release()
    assert first_body["id_slot"] == 1 and short["id_slot"] == 1


async def test_n_cmpl_runs_its_completions_at_once_and_a_client_leaving_stops_them(
    two_slots: Any,
) -> None:
    req = {**LONG, "n_predict": 200, "stream": False, "n_cmpl": 2}
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(two_slots.url + "/completion", json=req))
        t_end = time.monotonic() + 30
        while True:
            async with s.get(two_slots.url + "/slots") as r:
                sl = await r.json()
            if all(x["is_processing"] and x["n_decoded"] > 0 for x in sl):
                break  # both completions decoding at the same time
            assert time.monotonic() < t_end and not task.done(), sl
            await asyncio.sleep(0.01)
        task.cancel()  # the client leaves
        await asyncio.gather(task, return_exceptions=True)
        t_end = time.monotonic() + 30
        while True:
            async with s.get(two_slots.url + "/slots") as r:
                sl = await r.json()
            if not any(x["is_processing"] for x in sl):
                break
            assert time.monotonic() < t_end, sl
            await asyncio.sleep(0.01)
        assert all(x["n_decoded"] < 200 for x in sl), sl  # stopped, not run to the end
    assert two_slots.post("/completion", {"prompt": "Hi", "n_predict": 2})[0] == 200


async def test_n_cmpl_through_the_proxy_runs_on_the_slots_the_gate_granted(two_slots: Any) -> None:
    """Proxy + real backend: a two-slot request waits in the proxy's queue for both permits
    (not in the backend's), then runs on exactly the two slots the gate granted."""
    async with run_proxy(two_slots.url) as px, aiohttp.ClientSession() as s:
        gate = px.member.gate
        assert gate.capacity == 2

        async def post(session: str, **extra: Any) -> tuple[int, Any]:
            async with s.post(
                px.url + "/completion",
                json={"prompt": "x =", "n_predict": 8, **extra},
                headers={"X-LLMProxy-Session": session},
            ) as r:
                return r.status, await r.json()

        # runs until its client leaves
        endless = asyncio.ensure_future(post("a", n_predict=1800, ignore_eos=True))
        t_end = time.monotonic() + 30
        while not gate.inflight:
            assert time.monotonic() < t_end and not endless.done()
            await asyncio.sleep(0.01)
        wide = asyncio.ensure_future(post("b", n_cmpl=2))
        while not px.state.pool.queue:
            assert time.monotonic() < t_end and not wide.done()
            await asyncio.sleep(0.01)
        # it waits in the proxy
        assert [x["is_processing"] for x in two_slots.slots()] == [True, False]
        # its client leaves: the proxy stops it, confirms slot 0 idle, then grants both
        endless.cancel()
        await asyncio.gather(endless, return_exceptions=True)
        status, b = await wide
        # the injected id_slot's first
        assert status == 200 and [c["id_slot"] for c in b] == [0, 1], b
        assert all(c["stop"] for c in b)
        await asyncio.wait_for(gate.wait_quiescent(), 30)
        assert gate.free == 2


def test_n_cmpl_gives_an_array_of_completions(two_slots: Any) -> None:
    """llama.vscode's ``n_cmpl``: that many completions of the prompt as a JSON array
    (llama-server's shape), each on its own slot as llama-server places them (``id_slot``'s
    first, then the lowest other free one), 1 still a single object, more than the slots a
    400."""
    req = {
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n",
        "n_predict": 6,
        "seed": 7,
        "temperature": 0.8,
    }
    status, body = two_slots.post("/infill", {**req, "n_cmpl": 2})
    assert status == 200, body
    assert isinstance(body, list) and [r["index"] for r in body] == [0, 1]
    assert [r["id_slot"] for r in body] == [0, 1]
    status, pinned = two_slots.post("/infill", {**req, "n_cmpl": 2, "id_slot": 1})
    assert status == 200 and [r["id_slot"] for r in pinned] == [1, 0], pinned
    assert [r["generation_settings"]["seed"] for r in pinned] == [7, 8]
    assert all(
        r["stop"] is True and isinstance(r["content"], str) and r["tokens_predicted"] >= 1
        for r in body
    )
    assert [r["generation_settings"]["seed"] for r in body] == [7, 8]
    status, one = two_slots.post("/infill", {**req, "n_cmpl": 1})
    assert status == 200 and isinstance(one, dict) and one["index"] == 0
    for bad in (3, 0, "2"):
        status, err = two_slots.post("/infill", {**req, "n_cmpl": bad})
        assert status == 400 and "n_cmpl" in err["error"]["message"], (bad, err)
    status, alias = two_slots.post("/infill", {**req, "n": 2})  # llama-server's alias
    assert status == 200 and [r["index"] for r in alias] == [0, 1], alias
    status, err = two_slots.post("/infill", {**req, "n": 3})
    assert status == 400 and "'n'" in err["error"]["message"], err
    status, err = two_slots.post("/completion", {"prompt": "x", "n_cmpl": 2, "stream": True})
    assert status == 400 and "stream" in err["error"]["message"]


async def test_a_down_slot_stays_busy_while_any_request_pinned_to_it_runs_elsewhere() -> None:
    """The dispatcher's bookkeeping alone (no worker processes): with slot 1's worker down,
    requests pinned to it run on live slots, and slot 1 reads busy (``standins``) until the
    last of them ends, whatever order they end in; one that ran on its own slot leaves none."""
    from llmproxy.backend.runtime.dispatch import Dispatcher

    d = Dispatcher(BackendSettings(parallel=3))
    d._changed = asyncio.Event()
    for w in d.workers:
        w.state, w.inq = "ready", queue.SimpleQueue()
    d.workers[1].state = "error"
    # token ids: nothing to tokenize (no worker ever reported ready, so no tokenizer loaded)
    prompt, params = Prompt(kind="completion", tokens=(1,)), SamplingParams(n_predict=4)
    first = await d.start_request(prompt, params, id_slot=1)
    second = await d.start_request(prompt, params, id_slot=1)
    assert (first.slot.id, second.slot.id) == (0, 2) and d.slots[1].standins == {
        first.id,
        second.id,
    }
    d._finish(second, Done(second.id, "limit", 1, 4, 0.0, 0.0))  # the later one ends first
    assert d.slots[1].standins == {first.id}
    d._finish(first, Failed(first.id, 502, "worker died"))
    assert d.slots[1].standins == set()
    d.workers[1].state = "ready"
    own = await d.start_request(prompt, params, id_slot=1)
    assert own.slot.id == 1 and own.pinned is None and d.slots[1].standins == set()
