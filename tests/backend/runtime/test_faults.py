"""Backend faults: a worker killed by SIGSEGV, and a model that crashes its worker on every load."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.child import cpu_seconds
from tests.helpers.backend.server import kill_worker_mid_stream, parallel_flags, wait_until


def log_events(backend: Any, event: str) -> list[dict[str, Any]]:
    lines = backend.log_path.read_text(errors="replace").splitlines()
    return [
        e for e in (json.loads(ln) for ln in lines if ln.startswith("{")) if e.get("event") == event
    ]


@pytest.mark.slow
async def test_worker_sigsegv_fails_stream_and_recovers(engine: str, start_backend: Any) -> None:
    if engine != "llama-cpp":
        pytest.skip(
            "the supervisor's path is engine-independent (SIGKILL is covered for both); "
            "torch reloads are slow"
        )
    b = start_backend(engine, *parallel_flags(engine, 1))
    old_pid = b.worker_pids()[0]
    async with aiohttp.ClientSession() as s:
        last, elapsed = await kill_worker_mid_stream(s, b.url, old_pid, signal.SIGSEGV)
    assert last is not None and last["error"]["code"] == 502, last
    assert elapsed < 2.0, elapsed
    assert wait_until(lambda: b.get("/health")[0] == 200, 120, 0.1), b.log_tail()
    assert b.worker_pids()[0] != old_pid
    assert b.post("/completion", {"prompt": "Hello", "n_predict": 4})[0] == 200
    died = log_events(b, "worker_died")
    assert died and died[0]["exitcode"] == -signal.SIGSEGV and died[0]["pid"] == old_pid


@pytest.mark.slow
def test_corrupt_model_backs_off_stays_up_and_idle(
    tmp_path: Path, engine: str, start_backend: Any
) -> None:
    if engine != "llama-cpp":
        pytest.skip("a corrupt GGUF is a llama-cpp fault")
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(4096))  # right magic, garbage after
    b = start_backend(engine, "--model", str(bad), "--restart-backoff-max-s", "1.6", wait=False)
    deadline = time.monotonic() + 60
    while not b.port_file.exists():
        assert b.proc.poll() is None and time.monotonic() < deadline, b.log_tail()
        time.sleep(0.05)
    b.port = int(b.port_file.read_text())
    # a few deaths: the delays double from 0.2 s (0.2, 0.4, 0.8, 1.6, 1.6 ...)
    assert wait_until(lambda: len(log_events(b, "worker_died")) >= 4, 60, 0.1), b.log_tail()
    delays = [e["restart_in_s"] for e in log_events(b, "worker_died")]
    assert delays[:4] == [0.2, 0.4, 0.8, 1.6], delays
    cpu0, t0 = cpu_seconds(b.proc.pid), time.monotonic()
    for _ in range(10):  # the web server answers promptly meanwhile
        s0 = time.monotonic()
        status, body = b.get("/health")
        assert status == 503 and body["error"]["code"] == 503, body
        assert body["status"] in ("error", "loading"), body
        status, body = b.post("/completion", {"prompt": "x", "n_predict": 2}, timeout=5)
        assert status == 503 and body["error"]["code"] == 503, body
        assert time.monotonic() - s0 < 1.0
        time.sleep(0.3)
    used, wall = cpu_seconds(b.proc.pid) - cpu0, time.monotonic() - t0
    assert used < 0.25 * wall, f"server process used {used:.2f}s CPU in {wall:.2f}s: busy loop?"
    assert b.proc.poll() is None
    _, props = b.get("/props")
    assert props["workers"][0]["restarts"] >= 3
