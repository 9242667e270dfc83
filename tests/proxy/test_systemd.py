"""systemd units: generated units pass ``systemd-analyze verify``; socket activation works for real.

The activation test does what systemd does: it creates the listening socket, puts it on
fd 3 of the service's process and sets LISTEN_FDS=1 / LISTEN_PID=<that pid>, then runs
the ExecStart line of the generated unit, sends a request through the socket and stops
the process with SIGTERM while a request is in flight (it must drain and exit 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.common.children import child_preexec
from llmproxy.proxy.systemd import repo_copies
from tests.helpers.leftovers import live_descendants

ROOT = Path(__file__).resolve().parents[2]
LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))
# what systemd does at activation: the socket on fd 3, LISTEN_PID = the exec'ed process
# (and no other copy of it: the fd it was passed on is closed)
ACTIVATE = (
    "import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); fd == 3 or os.close(fd); "
    "os.environ.update(LISTEN_FDS='1', LISTEN_PID=str(os.getpid())); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def socket_holders(pids: list[int], inode: int) -> set[int]:
    """The processes among ``pids`` with a descriptor on the socket ``inode`` (from /proc)."""
    return {
        pid
        for pid in pids
        for fd in Path(f"/proc/{pid}/fd").iterdir()
        if os.readlink(fd) == f"socket:[{inode}]"
    }


def environ(pid: int) -> bytes:
    """The environment ``pid`` was started with (from /proc)."""
    return Path(f"/proc/{pid}/environ").read_bytes()


def install(tmp: Path, *extra: str, config: str = "") -> Path:
    (tmp / "config.toml").write_text(config)
    subprocess.run(
        [
            LLMPROXY,
            "systemd",
            "install",
            "--user",
            "--dir",
            str(tmp / "units"),
            "--config",
            str(tmp / "config.toml"),
            *extra,
        ],
        check=True,
        capture_output=True,
    )
    return tmp / "units"


def verify(tmp: Path, *units: Path) -> list[str]:
    """Problems ``systemd-analyze verify --user`` reports about our units (unrelated host
    units ignored)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze missing (make test installs the Debian systemd package)")
    run_dir = tmp / "xdg-run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run_dir)}
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--user", *map(str, units)],
        capture_output=True,
        text=True,
        env=env,
    )
    problems = [ln for ln in proc.stderr.splitlines() if "llmproxy" in ln]
    return problems + ([f"exit status {proc.returncode}"] if proc.returncode else [])


def test_repo_units_are_current() -> None:
    units = repo_copies()
    assert (ROOT / "systemd" / "llmproxy.service").read_text() == units.service
    assert (ROOT / "systemd" / "llmproxy.socket").read_text() == units.socket


def test_installed_units_verify(tmp_path: Path) -> None:
    units = install(tmp_path, "--socket", config="port = 8099\nshutdown_timeout_s = 5\n")
    service, sock = units / "llmproxy.service", units / "llmproxy.socket"
    assert verify(tmp_path, service, sock) == []
    text = service.read_text()
    assert f"ExecStart={LLMPROXY} serve --config {tmp_path / 'config.toml'} --log-json" in text
    assert "ExecReload=/bin/kill -HUP $MAINPID" in text
    for line in (
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "MemoryDenyWriteExecute=yes",
        "StateDirectory=llmproxy",
        "Restart=on-failure",
        "KillMode=mixed",
        "TimeoutStopSec=20s",
    ):
        assert line in text.splitlines(), line
    assert "ListenStream=127.0.0.1:8099" in sock.read_text().splitlines()


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    service = install(tmp_path) / "llmproxy.service"
    service.write_text(
        service.read_text().replace("ProtectHome=read-only", "ProtectHome=sometimes")
    )
    assert verify(tmp_path, service)


def test_torch_variant_allows_jit_and_devices(tmp_path: Path) -> None:
    service = install(tmp_path, "--torch") / "llmproxy.service"
    lines = service.read_text().splitlines()
    assert "MemoryDenyWriteExecute=yes" not in lines and "PrivateDevices=yes" not in lines
    assert verify(tmp_path, service) == []


async def test_socket_activation_serves_and_drains(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.02)  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake:
        # port 1: must not be bound
        units = install(tmp_path, config=f'upstream = "{fake.url}"\nport = 1\n')
        exec_line = next(
            ln
            for ln in (units / "llmproxy.service").read_text().splitlines()
            if ln.startswith("ExecStart=")
        )
        argv = shlex.split(exec_line.removeprefix("ExecStart="))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMPROXY_", "LISTEN_"))}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            ACTIVATE,
            str(listener.fileno()),
            *argv,
            pass_fds=[listener.fileno()],
            env=env,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=child_preexec(cloexec=False),  # it would close the passed fd
        )
        listener.close()  # the child holds it now
        try:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                async with http.get(
                    url + "/llmproxy/health"
                ) as r:  # waits in the backlog until ready
                    assert r.status == 200
                inflight = asyncio.ensure_future(
                    http.post(url + "/completion", json={"prompt": "x"})
                )
                await fake.wait_for(lambda f: len(f.generations) == 1)
                proc.send_signal(signal.SIGTERM)
                resp = await inflight
                assert resp.status == 200 and (await resp.json())["tokens_predicted"] == 20
                resp.release()
            assert await asyncio.wait_for(proc.wait(), 15) == 0
            logs = [
                json.loads(ln)
                for ln in (await proc.stderr.read()).decode().splitlines()
                if ln.startswith("{")
            ]
            listening = [ln for ln in logs if ln.get("event") == "listening"]
            assert listening and listening[0]["socket_activated"] is True
            assert listening[0]["url"].endswith(f":{port}")
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def test_socket_activation_keeps_the_socket_from_the_embedded_backend(tmp_path: Path) -> None:
    """systemd's listening socket and LISTEN_* stay with the proxy: the embedded backend
    (started before the proxy listens) neither holds the socket nor sees the variables,
    on the default loop (uvloop spawns children without close_fds)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino
    # no upstream: embedded
    units = install(tmp_path, config="port = 1\nbackend_start_timeout_s = 120\n")
    exec_line = next(
        ln
        for ln in (units / "llmproxy.service").read_text().splitlines()
        if ln.startswith("ExecStart=")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMPROXY_", "LISTEN_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        ACTIVATE,
        str(listener.fileno()),
        *shlex.split(exec_line.removeprefix("ExecStart=")),
        pass_fds=[listener.fileno()],
        env=env,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=child_preexec(cloexec=False),  # it would close the passed fd
    )
    listener.close()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as http:
            # answered once the backend is up
            async with http.get(f"http://127.0.0.1:{port}/llmproxy/health") as r:
                assert r.status == 200
        holders = socket_holders([proc.pid, *live_descendants(proc.pid)], inode)
        assert holders == {proc.pid}
        backends = live_descendants(proc.pid)
        assert backends
        for pid in backends:
            assert b"LISTEN_FDS=" not in environ(pid)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
