"""Backend server processes for tests: start one, wait for it, kill its workers, find
what it left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from llmproxy.common.children import child_preexec

LONG = {"prompt": "Once upon a time", "n_predict": 500, "ignore_eos": True, "stream": True}


async def kill_worker_mid_stream(session: Any, url: str, pid: int, sig: int) -> tuple[Any, float]:
    """Start a long streamed completion, kill worker ``pid`` with ``sig`` after its first
    event, read the stream to its end; returns (last SSE event, seconds from kill to end)."""
    async with session.post(url + "/completion", json=LONG) as r:
        assert r.status == 200
        await r.content.readline()
        os.kill(pid, sig)
        t0 = time.perf_counter()
        last = None
        async for line in r.content:
            if line.startswith(b"data: "):
                last = json.loads(line[6:])
        return last, time.perf_counter() - t0


START_TIMEOUT_S = float(os.environ.get("LLMPROXY_TEST_START_TIMEOUT_S", "180"))


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie, i.e. exited but not reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(pred: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


class Backend:
    """A backend server subprocess; ``args`` add flags or replace the defaults below (a flag
    may be given once)."""

    def __init__(self, tmp: Path, engine: str, *args: str, cwd: Path | None = None) -> None:
        self.port_file = tmp / f"port-{engine}-{time.monotonic_ns()}"
        self.log_path = tmp / f"{self.port_file.name}.log"
        self.engine = engine
        defaults = {
            "--log-level": "warning",
            # shared CI boxes: 1 thread is steadier
            "--n-threads": os.environ.get("LLMPROXY_TEST_THREADS", "1"),
            "--n-predict-max": "512",
            "--restart-backoff-min-s": "0.2",
        }
        cmd = [sys.executable, "-m", "llmproxy.backend", "--port", "0",
               "--port-file", str(self.port_file), "--engine", engine, "--log-json"]  # fmt: skip
        cmd += [
            part for flag, value in defaults.items() if flag not in args for part in (flag, value)
        ]
        cmd += args
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, preexec_fn=child_preexec()
        )
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Backend:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"backend did not start (rc={self.proc.poll()}):\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.port = int(self.port_file.read_text().strip())
        while True:
            status, _ = self.get("/health")
            if status == 200:
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"backend not healthy (rc={self.proc.poll()}):\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 60
    ) -> tuple[int, Any]:
        data = (
            None
            if body is None
            else (body if isinstance(body, bytes) else json.dumps(body).encode())
        )
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            status = exc.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def get(self, path: str) -> tuple[int, Any]:
        try:
            return self.request("GET", path, timeout=5)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None

    def post(self, path: str, body: Any, timeout: float = 60) -> tuple[int, Any]:
        return self.request("POST", path, body, timeout)

    def worker_pids(self) -> list[int]:
        _, props = self.get("/props")
        return [w["pid"] for w in props["workers"]]

    def slots(self) -> list[dict[str, Any]]:
        status, body = self.get("/slots")
        assert status == 200, body
        return body

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def parallel_flags(engine: str, n: int) -> list[str]:
    """Flags giving ``n`` slots: llama-cpp = n processes, torch = one batch of n."""
    return ["--parallel", str(n)] if engine == "llama-cpp" else ["--max-batch-size", str(n)]


def processes_in(directory: Path) -> list[int]:
    """Live pids whose working directory is ``directory`` (a backend and the workers it spawned)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == directory and pid_alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
