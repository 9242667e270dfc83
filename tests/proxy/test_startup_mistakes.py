"""Start-up mistakes end ``llmproxy serve`` with one clear line and exit status 2, before
anything loads: a port in use, a host that does not resolve, a non-loopback bind without
a client key."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.common.children import child_preexec
from tests.helpers.serve import LLMPROXY


async def _serve(*args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        "serve",
        *args,
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        env=env,
        preexec_fn=child_preexec(),
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and '"event"' not in ln]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.slow
async def test_a_port_in_use_is_one_line_and_exit_2(fake: FakeUpstream) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = await _serve("--upstream", fake.url, "--port", str(port))
    assert code == 2
    line = _one_line(err)
    assert f"127.0.0.1:{port}" in line and "already in use" in line
    assert not fake.received  # refused before the upstream was even probed


@pytest.mark.slow
async def test_an_unresolvable_host_is_one_line_and_exit_2(fake: FakeUpstream) -> None:
    code, err = await _serve(
        "--upstream", fake.url, "--host", "no-such-host.invalid", "--api-key", "k", "--port", "0"
    )
    assert code == 2
    assert "does not resolve" in _one_line(err)


@pytest.mark.slow
async def test_binding_beyond_loopback_without_a_key_is_refused(fake: FakeUpstream) -> None:
    code, err = await _serve("--upstream", fake.url, "--host", "0.0.0.0", "--port", "0")
    assert code == 2
    assert "needs a client key" in err and "Traceback" not in err
