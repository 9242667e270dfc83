"""Worker deaths: requests in flight fail fast, the worker restarts, a dead slot's pinned
requests run elsewhere, and a stop right after a death leaves no process behind."""

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

from tests.helpers.backend.server import (
    LONG,
    kill_worker_mid_stream,
    parallel_flags,
    processes_in,
    wait_until,
)


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
    # one completion on the live slot still runs
    assert status == 200 and isinstance(body, dict), body
    for _ in range(6):  # more than the proxy's default breaker threshold (5)
        status, body = b.post(
            "/infill",
            {"input_prefix": "def f(", "input_suffix": "\n", "n_predict": 2, "id_slot": 1},
        )
        assert status == 200 and body["id_slot"] == 0, body
    _, slots = b.get("/slots")
    # still in its back-off: really down
    assert [s["worker_state"] for s in slots] == ["ready", "error"]
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
