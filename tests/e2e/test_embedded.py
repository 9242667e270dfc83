"""``llmproxy serve`` with no upstream: embedded backend, real model, real processes.

From a clean environment (no LLMPROXY_* variables): the proxy starts the backend child,
serves completions through the llamacpp adapter, survives an editor burst with the
backend never running more than its one slot, and leaves no process behind on a
terminal's Ctrl-C (SIGINT to the whole foreground process group: the backend ignores it,
the proxy finishes its in-flight request before stopping the backend) or when the proxy
itself is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from llmproxy.common.children import child_preexec
from tests.helpers.net import wait_until

pytestmark = pytest.mark.slow
LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))


def descendants(pid: int) -> set[int]:
    """All live descendant pids of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def parent(pid: int) -> int:
    """The parent pid of ``pid`` (from /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def start(tmp_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        "serve",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--log-json",
        "--backend-start-timeout-s",
        "120",
        env=env,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group, as a shell runs a job
        preexec_fn=child_preexec(),
    )
    await wait_until(
        lambda: port_file.exists() or proc.returncode is not None, 150, what="proxy listening"
    )
    assert proc.returncode is None
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


async def test_embedded_backend_end_to_end(tmp_path: Path) -> None:
    proc, url = await start(tmp_path)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/llmproxy/status") as r:
                status = await r.json()
            assert status["upstream"]["kind"] == "llamacpp" and status["upstream"]["can_confirm"]
            body = {
                "input_prefix": "def add(a, b):\n    ",
                "input_suffix": "\n",
                "n_predict": 8,
                "temperature": 0,
                "id_slot": 0,
                "cache_prompt": True,
            }
            async with http.post(url + "/infill", json=body) as r:
                raw = await r.read()
            assert r.status == 200 and b'"content":"' in raw  # compact JSON, as llama.vim needs
            assert json.loads(raw)["tokens_predicted"] >= 1

            # an editor burst: 8 keystrokes, each abandoning the previous request
            async def one(i: int) -> dict:
                async with http.post(
                    url + "/completion", json={"prompt": f"x = {i}", "n_predict": 24}
                ) as r:
                    return await r.json()

            busy_max = 0
            tasks: list[asyncio.Task[dict]] = []
            for i in range(8):
                if tasks:
                    tasks[-1].cancel()
                tasks.append(asyncio.create_task(one(i)))
                async with http.get(url + "/slots") as r:  # passthrough to the backend's own view
                    busy_max = max(busy_max, sum(s["is_processing"] for s in await r.json()))
                await asyncio.sleep(0.05)  # the keystroke interval being simulated
            last = await tasks[-1]
            await asyncio.gather(*tasks, return_exceptions=True)
            assert last["stop"] is True and last["tokens_predicted"] >= 1
            assert busy_max <= 1
            async with http.get(url + "/llmproxy/status") as r:
                assert (await r.json())["permits"]["total"] == 1
            kids = descendants(proc.pid)
            assert len(kids) >= 2  # backend server + its worker

            # Ctrl-C with a generation in flight: it still completes (a backend acting on the
            # SIGINT itself would cut it after its 0.5 s drain)
            async def long() -> dict:
                body = {"prompt": "x = 99", "n_predict": 256, "ignore_eos": True}
                async with http.post(url + "/completion", json=body) as r:
                    return await r.json()

            inflight = asyncio.create_task(long())
            async with asyncio.timeout(30):  # until the backend's slot is busy with it
                while True:
                    async with http.get(url + "/slots") as r:
                        if any(s["is_processing"] for s in await r.json()):
                            break
            os.killpg(proc.pid, signal.SIGINT)
            late = await asyncio.wait_for(inflight, 60)
            assert late.get("stop") is True and late["tokens_predicted"] == 256, late
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await wait_until(lambda: not any(alive(k) for k in kids), 10, what="no orphan processes")
        log = [
            json.loads(ln)
            for ln in (await proc.stderr.read()).decode().splitlines()
            if ln.startswith("{")
        ]
        outcomes = [
            e["outcome"]
            for e in log
            if e.get("event") == "request" and e.get("route") == "/completion"
        ]
        assert outcomes.count("completed") >= 2 and len(outcomes) == 9
        # both processes run on the default loop (auto: uvloop, installed with the speedups extra)
        starts = [
            (e["event"], e["loop"])
            for e in log
            if e.get("event") in ("listening", "backend_listening")
        ]
        assert sorted(starts) == [("backend_listening", "uvloop"), ("listening", "uvloop")]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_no_orphans_when_proxy_is_killed(tmp_path: Path) -> None:
    proc, _url = await start(tmp_path)
    kids = descendants(proc.pid)
    assert kids
    proc.kill()
    await proc.wait()
    await wait_until(lambda: not any(alive(k) for k in kids), 20, what="backend and workers gone")


async def test_backend_death_stops_the_proxy_with_a_failure_status(tmp_path: Path) -> None:
    """The embedded backend dies on its own (OOM killer, a bug): the proxy must not go on
    answering 502 with a healthy /llmproxy/health; it stops with status 1, so that systemd's
    ``Restart=on-failure`` (or the user) starts it again, and leaves nothing behind."""
    proc, url = await start(tmp_path)
    kids = descendants(proc.pid)
    backend = [k for k in kids if parent(k) == proc.pid]
    assert len(backend) == 1, backend
    os.kill(backend[0], signal.SIGKILL)
    try:
        assert await asyncio.wait_for(proc.wait(), 60) == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.stderr is not None
    events = [
        json.loads(line)
        for line in (await proc.stderr.read()).decode().splitlines()
        if line.startswith("{")
    ]
    died = [e for e in events if e["event"].startswith("embedded backend exited unexpectedly")]
    assert len(died) == 1 and died[0]["exit_code"] == -signal.SIGKILL, died
    await wait_until(lambda: not any(alive(k) for k in kids), 20, what="workers gone")


def _seen_by_ps(pid: int) -> tuple[list[bytes], list[bytes], int]:
    """A process's argv and environment (from /proc), and the port its --port-file names."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    port_file = Path(argv[argv.index(b"--port-file") + 1].decode())
    return argv, environ, int(port_file.read_text())


async def test_the_embedded_backend_wants_its_per_start_key(tmp_path: Path) -> None:
    """``--api-key`` cannot be walked around by calling the backend's loopback port: it
    wants a random key the proxy gave it in its environment, not on its command line."""
    proc, url = await start(tmp_path)
    try:
        backend = [k for k in descendants(proc.pid) if parent(k) == proc.pid]
        assert len(backend) == 1, backend
        argv, environ, port = _seen_by_ps(backend[0])
        keys = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"LLMPROXY_API_KEY=")]
        assert len(keys) == 1 and len(keys[0]) >= 32
        assert not any(keys[0] in arg for arg in argv)  # ps shows argv to every user
        direct = f"http://127.0.0.1:{port}"
        body = {"prompt": "x = 1", "n_predict": 2}
        async with aiohttp.ClientSession() as http:
            for method, path in (("GET", "/slots"), ("GET", "/props"), ("POST", "/completion")):
                async with http.request(method, direct + path, json=body) as r:
                    assert r.status == 401, path
                async with http.request(
                    method, direct + path, json=body, headers={"Authorization": "Bearer wrong"}
                ) as r:
                    assert r.status == 401, path
                async with http.request(method, url + path, json=body) as r:
                    assert r.status == 200, path  # the proxy sends the key
            async with http.get(direct + "/health") as r:
                assert r.status == 200  # public, as llama-server's
    finally:
        proc.terminate()
        await proc.wait()
