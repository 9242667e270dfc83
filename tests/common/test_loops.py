"""The event loop choice (``--loop``): uvloop when installed, asyncio's own, or a clear error.

In-process for the resolution itself; ``llmproxy serve`` subprocesses for what a user
sees: the loop named in the startup line, requests served on it, and the error for
``--loop uvloop`` where uvloop cannot be imported (hidden by a module on PYTHONPATH that
raises ImportError, as a missing package does).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
import uvloop

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.common import loops
from llmproxy.common.children import child_preexec
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.embedded import backend_command
from tests.helpers.serve import LLMPROXY, serve


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_resolution() -> None:
    assert loops.resolve("asyncio") == ("asyncio", None)
    for choice in ("auto", "uvloop"):
        name, factory = loops.resolve(choice)
        assert name == "uvloop" and factory is uvloop.new_event_loop


def test_run_uses_the_chosen_loop() -> None:
    assert loops.run(_loop_module(), loops.resolve("auto")[1]).startswith("uvloop")
    assert loops.run(_loop_module(), loops.resolve("asyncio")[1]).startswith("asyncio")


def test_embedded_backend_gets_the_proxys_loop(tmp_path: Path) -> None:
    for choice in ("auto", "asyncio", "uvloop"):
        cmd = backend_command(ProxySettings(loop=choice), tmp_path / "port")
        assert cmd[cmd.index("--loop") + 1] == choice


def _hide_uvloop(tmp_path: Path) -> dict[str, str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "uvloop.py").write_text("raise ImportError('uvloop hidden by the test')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}


async def _loops_logged(proc: asyncio.subprocess.Process) -> tuple[str, str]:
    """The loop the startup line names (resolved) and the one the listening line names (running)."""
    named: dict[str, str] = {}
    async with asyncio.timeout(10):
        while "listening" not in named and (line := await proc.stderr.readline()):
            if line.startswith(b"{") and (event := json.loads(line))["event"] in (
                "starting llmproxy",
                "listening",
            ):
                named[event["event"]] = event["loop"]
    return named["starting llmproxy"], named["listening"]


@pytest.mark.parametrize(
    ("args", "hidden", "expected"),
    [
        ((), False, "uvloop"),
        (("--loop", "asyncio"), False, "asyncio"),
        ((), True, "asyncio"),  # auto falls back when uvloop is missing
    ],
)
async def test_serve_runs_on_the_chosen_loop(
    tmp_path: Path, args: tuple[str, ...], hidden: bool, expected: str
) -> None:
    env = _hide_uvloop(tmp_path) if hidden else None
    async with (
        FakeUpstream(slots=1) as fake,
        serve(tmp_path, "--upstream", fake.url, *args, env_extra=env) as (proc, url),
        aiohttp.ClientSession() as http,
    ):
        assert await _loops_logged(proc) == (expected, expected)
        async with http.post(url + "/completion", json={"prompt": "a", "n_predict": 2}) as r:
            assert r.status == 200 and (await r.json())["content"]


async def test_loop_uvloop_without_uvloop_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")} | _hide_uvloop(
        tmp_path
    )
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        "serve",
        "--port",
        "0",
        "--upstream",
        "http://127.0.0.1:9",
        "--loop",
        "uvloop",
        stderr=asyncio.subprocess.PIPE,
        env=env,
        preexec_fn=child_preexec(),
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert err.decode().strip().splitlines()[-1] == (
        "llmproxy: loop = uvloop, but uvloop cannot be imported (uvloop hidden by the test): "
        "install the speedups extra (pip install 'llmproxy[speedups]') or choose loop = asyncio"
    )


async def test_modules_outside_both_loops_run_once_on_asyncio(
    request: pytest.FixtureRequest,
) -> None:
    """This module is not in conftest.BOTH_LOOPS: one run, on asyncio's loop."""
    assert type(asyncio.get_running_loop()).__module__.startswith("asyncio")
    assert "[" not in request.node.name


def test_children_keep_no_fd_beyond_stdio_on_either_loop() -> None:
    """asyncio spawns with close_fds; uvloop does not, so child_preexec marks fds >= 3
    close-on-exec: the embedded backend gets neither an inheritable fd of ours (here a pipe)
    nor the loop's own."""
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    listing = "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"

    async def child_fds(preexec: bool) -> set[str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            listing,
            stdout=asyncio.subprocess.PIPE,
            preexec_fn=child_preexec() if preexec else None,
        )
        out, _ = await proc.communicate()
        return set(out.decode().split())

    try:
        for choice in ("asyncio", "uvloop"):
            # 0-2, and 3: the directory listdir itself opened
            assert loops.run(child_fds(True), loops.resolve(choice)[1]) == {"0", "1", "2", "3"}, (
                choice
            )
        # what it guards against
        assert str(write_end) in loops.run(child_fds(False), loops.resolve("uvloop")[1])
    finally:
        os.close(read_end)
        os.close(write_end)
