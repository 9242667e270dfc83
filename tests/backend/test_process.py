"""``python -m llmproxy.backend --port 0 --port-file F`` end to end; no orphan workers."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from llmproxy.common.children import child_preexec
from tests.helpers.backend.server import parallel_flags, pid_alive, processes_in, wait_until


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
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5, 0.05), [
        p for p in pids if pid_alive(p)
    ]


_PARENT = """
import subprocess, sys, time
from pathlib import Path
repo, tmp, how = sys.argv[1:4]
sys.path.insert(0, repo)
from tests.helpers.backend.server import Backend
if how == "helper":  # as the tests start their servers
    pid = Backend(Path(tmp), "llama-cpp", cwd=Path(tmp)).wait_ready().proc.pid
elif how == "bench":  # as llmproxy bench engine starts its server
    import argparse, os
    from llmproxy.bench.engine.server import Server
    os.chdir(tmp)
    pid = Server(argparse.Namespace(model=None, n_ctx=2048, n_batch=16), 1).proc.pid
else:  # a wrapper that sets nothing up for its child: the backend's own flag
    port_file = Path(tmp) / "port"
    proc = subprocess.Popen([sys.executable, "-m", "llmproxy.backend", "--port", "0",
                             "--port-file", str(port_file), "--exit-with-parent",
                             "--n-threads", "1", "--log-level", "warning"], cwd=tmp)
    while not port_file.exists():
        if proc.poll() is not None:
            sys.exit(f"the backend exited: {proc.returncode}")
        time.sleep(0.05)
    pid = proc.pid
print(pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
@pytest.mark.parametrize("how", ["helper", "bench", "flag"])
def test_backend_dies_with_the_process_that_started_it(tmp_path: Path, how: str) -> None:
    """A backend whose parent is killed (SIGKILL: no cleanup) stops, workers included: one
    started by the tests' helper (it dies with the test process) or by ``llmproxy bench
    engine``, and one started with ``--exit-with-parent`` by a parent that sets nothing up."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(Path(__file__).parents[2]), str(tmp_path), how],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=child_preexec(),
    )
    backend = 0
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, "the parent did not start a backend"
        backend = int(line)
        assert pid_alive(backend) and len(processes_in(tmp_path)) >= 2  # the backend and its worker
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not processes_in(tmp_path), 30, 0.05), (
            "the backend outlived its parent"
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        for pid in processes_in(tmp_path):  # what a failure left
            os.kill(pid, signal.SIGKILL)
