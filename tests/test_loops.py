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
from pathlib import Path

import aiohttp
import pytest
import uvloop

from llmproxy.proxy import loops
from llmproxy.proxy.bench.fake_upstream import FakeUpstream
from llmproxy.proxy.embedded import backend_command
from llmproxy.proxy.settings import ProxySettings
from tests.test_serve_e2e import LLMPROXY, serve


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


async def _startup_loop(proc: asyncio.subprocess.Process) -> str:
    async with asyncio.timeout(10):
        while line := await proc.stderr.readline():
            if line.startswith(b"{") and (event := json.loads(line))["event"] == "starting llmproxy":
                return event["loop"]
    raise AssertionError("no startup line")


@pytest.mark.parametrize(("args", "hidden", "expected"), [
    ((), False, "uvloop"),
    (("--loop", "asyncio"), False, "asyncio"),
    ((), True, "asyncio"),  # auto falls back when uvloop is missing
])
async def test_serve_runs_on_the_chosen_loop(tmp_path: Path, args: tuple[str, ...], hidden: bool,
                                             expected: str) -> None:
    env = _hide_uvloop(tmp_path) if hidden else None
    async with FakeUpstream(slots=1) as fake, serve(
        tmp_path, "--upstream", fake.url, *args, env_extra=env
    ) as (proc, url), aiohttp.ClientSession() as http:
        assert await _startup_loop(proc) == expected
        async with http.post(url + "/completion", json={"prompt": "a", "n_predict": 2}) as r:
            assert r.status == 200 and (await r.json())["content"]


async def test_loop_uvloop_without_uvloop_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")} | _hide_uvloop(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY, "serve", "--port", "0", "--upstream", "http://127.0.0.1:9", "--loop", "uvloop",
        stderr=asyncio.subprocess.PIPE, env=env,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert err.decode().strip().splitlines()[-1] == (
        "llmproxy: --loop uvloop: uvloop is not installed (pip install 'llmproxy[speedups]'), or use --loop asyncio"
    )
