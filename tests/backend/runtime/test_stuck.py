"""A worker stuck inside one step (here: stopped with SIGSTOP mid-generation, as a worker
lost in a minutes-long tokenizer call looks from outside) is reported by /health (503 with
the reason) and /slots, killed, and restarted by the supervisor; its request fails."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend.server import LONG, pid_alive, wait_until


@pytest.mark.slow
async def test_stuck_worker_is_reported_and_restarted(start_backend: Any) -> None:
    b = start_backend("llama-cpp", "--parallel", "1", "--step-timeout-s", "1")
    [old_pid] = b.worker_pids()
    seen: dict[str, Any] = {}

    def reported() -> bool:
        status, health = b.get("/health")
        if status != 503 or "stuck" not in health["error"]["message"]:
            return False
        seen["health"], seen["slots"] = health, b.slots()
        return True

    async with aiohttp.ClientSession() as s, s.post(b.url + "/completion", json=LONG) as r:
        assert r.status == 200
        await r.content.readline()
        os.kill(old_pid, signal.SIGSTOP)  # frozen in the middle of its work
        try:
            assert wait_until(reported, 20, 0.02), b.log_tail()
        finally:
            if pid_alive(old_pid):
                os.kill(old_pid, signal.SIGCONT)
        last = None
        async for line in r.content:
            if line.startswith(b"data: "):
                last = json.loads(line[6:])
    assert last is not None and last["error"]["code"] == 502, last
    slot = seen["slots"][0]
    assert slot["worker_state"] == "error" and "stuck" in slot["worker_message"], slot
    assert seen["health"]["status"] == "error", seen["health"]
    assert wait_until(lambda: b.get("/health")[0] == 200, 120, 0.1), b.log_tail()
    assert b.worker_pids()[0] != old_pid and not pid_alive(old_pid)
    assert b.post("/completion", {"prompt": "Hello", "n_predict": 2})[0] == 200
