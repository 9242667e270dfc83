"""Worker crashes and recovery, parallel slots and id_slot."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend import (
    LONG,
    kill_worker_mid_stream,
    parallel_flags,
    processes_in,
    wait_until,
)
from tests.helpers.proxy import run_proxy


@pytest.fixture(scope="module")
def crashy(engine: str, start_backend: Any) -> Any:
    """A server of its own: these tests kill its worker."""
    return start_backend(engine, *parallel_flags(engine, 1))


async def test_worker_sigkill_stream_fails_fast_and_recovers(crashy: Any) -> None:
    old_pid = crashy.worker_pids()[0]
    async with aiohttp.ClientSession() as s:
        last, elapsed = await kill_worker_mid_stream(s, crashy.url, old_pid, signal.SIGKILL)
        assert last is not None and "error" in last, last
        assert last["error"]["code"] == 502
        assert elapsed < 1.0, elapsed
        async with s.get(crashy.url + "/health") as h:
            body = await h.json()
            assert h.status == 503
            assert body["status"] in ("error", "loading")
            assert body["error"]["code"] == 503
        async with s.post(crashy.url + "/completion", json={"prompt": "x", "n_predict": 2}) as r:
            assert r.status == 503  # no worker to run it yet
    assert wait_until(lambda: crashy.get("/health")[0] == 200, 120, 0.1), crashy.log_tail()
    new_pid = crashy.worker_pids()[0]
    assert new_pid != old_pid
    status, body = crashy.post("/completion", {"prompt": "Hello", "n_predict": 4})
    assert status == 200, body
    _, props = crashy.get("/props")
    assert props["workers"][0]["restarts"] >= 1


async def test_worker_sigkill_non_stream_gets_502(crashy: Any) -> None:
    assert wait_until(lambda: crashy.get("/health")[0] == 200, 120, 0.1)
    pid = crashy.worker_pids()[0]
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(
            s.post(crashy.url + "/completion", json={**LONG, "stream": False})
        )
        t_end = time.monotonic() + 30
        while True:
            async with s.get(crashy.url + "/slots") as r:
                sl = (await r.json())[0]
            if sl["is_processing"] and sl["n_decoded"] >= 2:
                break
            assert time.monotonic() < t_end
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        resp = await task
        body = await resp.json()
        elapsed = time.perf_counter() - t0
        resp.release()
    assert resp.status == 502
    assert body["error"]["code"] == 502 and "worker" in body["error"]["message"]
    assert elapsed < 1.0
    assert wait_until(lambda: crashy.get("/health")[0] == 200, 120, 0.1)
    assert crashy.post("/completion", {"prompt": "Hi", "n_predict": 2})[0] == 200


@pytest.fixture(scope="module")
def two_slots(engine: str, start_backend: Any) -> Any:
    return start_backend(engine, *parallel_flags(engine, 2))


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
        gate = px.state.gate
        assert gate.capacity == 2

        async def post(session: str, **extra: Any) -> tuple[int, Any]:
            async with s.post(
                px.url + "/completion",
                json={"prompt": "x =", "n_predict": 8, **extra},
                headers={"X-LLMProxy-Session": session},
            ) as r:
                return r.status, await r.json()

        endless = asyncio.ensure_future(
            post("a", n_predict=1800, ignore_eos=True)
        )  # until its client leaves
        t_end = time.monotonic() + 30
        while not gate.inflight:
            assert time.monotonic() < t_end and not endless.done()
            await asyncio.sleep(0.01)
        wide = asyncio.ensure_future(post("b", n_cmpl=2))
        while not gate.queued:
            assert time.monotonic() < t_end and not wide.done()
            await asyncio.sleep(0.01)
        assert [x["is_processing"] for x in two_slots.slots()] == [
            True,
            False,
        ]  # it waits in the proxy
        endless.cancel()  # its client leaves: the proxy stops it, confirms slot 0 idle, then grants both
        await asyncio.gather(endless, return_exceptions=True)
        status, b = await wide
        assert status == 200 and [c["id_slot"] for c in b] == [0, 1], (
            b
        )  # the injected id_slot's first
        assert all(c["stop"] for c in b)
        await asyncio.wait_for(gate.wait_quiescent(), 30)
        assert gate.free == 2


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


def test_slot_down_n_cmpl_is_503_pinned_runs_elsewhere(
    engine: str, start_backend: Any, tmp_path: Path
) -> None:
    """llama-cpp runs one worker per slot: with one of two restarting, two completions at
    once cannot start, so the request is answered 503 instead of waiting through the
    restart's back-off while its caller holds two permits. A request pinned to the dead
    slot (the proxy keeps an editor's session on its slot) runs on the live one instead of
    a 503 each time, which would trip the proxy's breaker for every editor."""
    if engine != "llama-cpp":
        pytest.skip("one worker process per slot: llama-cpp only (torch runs its slots in one)")
    b = start_backend(
        engine,
        *parallel_flags(engine, 2),
        "--restart-backoff-min-s",
        "60",
        "--restart-backoff-max-s",
        "60",
        cwd=tmp_path,
    )
    os.kill(b.worker_pids()[1], signal.SIGKILL)
    assert wait_until(lambda: "worker_died" in b.log_tail(), 10), b.log_tail()
    status, body = b.post(
        "/completion", {"prompt": "x", "n_predict": 2, "n_cmpl": 2, "id_slot": 0}, timeout=20
    )
    assert status == 503, body
    status, body = b.post("/completion", {"prompt": "x", "n_predict": 2, "n": 1, "id_slot": 0})
    assert status == 200 and isinstance(body, dict), (
        body
    )  # one completion on the live slot still runs
    for _ in range(6):  # more than the proxy's default breaker threshold (5)
        status, body = b.post(
            "/infill",
            {"input_prefix": "def f(", "input_suffix": "\n", "n_predict": 2, "id_slot": 1},
        )
        assert status == 200 and body["id_slot"] == 0, body
    _, slots = b.get("/slots")
    assert [s["worker_state"] for s in slots] == [
        "ready",
        "error",
    ]  # still in its back-off: really down
    assert [s["is_processing"] for s in slots] == [False, False]
    # While one pinned to the dead slot runs on slot 0, /slots shows slot 1 busy too: the
    # proxy confirms a cancelled request's stop by polling the slot it pinned.
    seen: list[Any] = []

    def running_on_slot_0() -> bool:
        seen.append(b.get("/slots")[1])
        return bool(seen[-1][0]["is_processing"])

    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(
            b.post, "/completion", {**LONG, "n_predict": 48, "stream": False, "id_slot": 1}
        )
        assert wait_until(running_on_slot_0, 30, 0.005)
        status, body = long.result(60)
    assert status == 200 and body["id_slot"] == 0, body
    assert [s["is_processing"] for s in seen[-1]] == [True, True], seen[-1]  # one snapshot
    _, after = b.get("/slots")
    assert [s["is_processing"] for s in after] == [False, False]


@pytest.mark.parametrize("backoff_s", ["5", "0"])
def test_stop_right_after_a_worker_death(
    engine: str, start_backend: Any, tmp_path: Path, backoff_s: str
) -> None:
    """SIGTERM once a worker's death was handled: its restart ends first (``5``: cancelled in
    its back-off; ``0``: its new process starting at once, which then gets the poison pill),
    the server exits 0, and no process of it is left."""
    b = start_backend(engine, "--restart-backoff-min-s", backoff_s, cwd=tmp_path)
    os.kill(b.worker_pids()[0], signal.SIGKILL)
    assert wait_until(lambda: "worker_died" in b.log_tail(), 10), b.log_tail()
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(30) == 0, b.log_tail()
    assert wait_until(lambda: not processes_in(tmp_path), 10), processes_in(tmp_path)
    assert "Traceback" not in b.log_tail()


def test_n_cmpl_gives_an_array_of_completions(two_slots: Any) -> None:
    """llama.vscode's ``n_cmpl``: that many completions of the prompt as a JSON array
    (llama-server's shape), each on its own slot as llama-server places them (``id_slot``'s
    first, then the lowest other free one), 1 still a single object, more than the slots a 400."""
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
