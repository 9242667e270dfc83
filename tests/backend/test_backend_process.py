"""``python -m llmproxy.backend --port 0 --port-file F`` end to end; no orphan workers."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from backend_helpers import parallel_flags, pid_alive, wait_until


def test_sigterm_drains_and_leaves_no_workers(engine: str, start_backend: Any) -> None:
    b = start_backend(engine, *parallel_flags(engine, 2))
    pids = b.worker_pids()
    assert len(pids) == (2 if engine == "llama-cpp" else 1)
    assert all(pid_alive(p) for p in pids)
    # an in-flight request finishes during the graceful shutdown
    result: dict[str, Any] = {}

    def run() -> None:
        result["r"] = b.post("/completion", {"prompt": "Once", "n_predict": 48, "ignore_eos": True})

    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: any(s["is_processing"] for s in b.slots()), 10, 0.005)
    t0 = time.monotonic()
    rc = b.stop(signal.SIGTERM)
    t.join(10)
    assert rc == 0, b.log_tail()
    assert time.monotonic() - t0 < 15
    status, body = result["r"]
    assert status == 200 and body["tokens_predicted"] == 48
    assert not any(pid_alive(p) for p in pids)


def test_sigkill_parent_leaves_no_orphans(engine: str, start_backend: Any) -> None:
    b = start_backend(engine, *parallel_flags(engine, 2))
    pids = b.worker_pids()
    assert all(pid_alive(p) for p in pids)
    b.stop(signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5, 0.05), [p for p in pids if pid_alive(p)]
