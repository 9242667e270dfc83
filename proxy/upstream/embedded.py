"""The embedded backend: ``llmproxy serve`` with no upstream starts ``llmproxy backend``.

Lifecycle (an aiohttp cleanup_ctx): start ``python -m llmproxy.backend`` as a child on a
free loopback port (it writes the port to a file), wait for ``/health`` to answer 200
while logging load progress, publish its URL in ``UPSTREAM_URL``, and on exit terminate
it (SIGTERM, then SIGKILL after ``BACKEND_STOP_S``). A terminal's Ctrl-C reaches the
whole foreground process group, backend included; the backend runs with ``--no-sigint``,
so only the proxy acts on it: it drains its requests first and then stops the backend (by
then with no client left: it gets ``BACKEND_DRAIN_S`` for its own drain). A SIG_IGN set
before exec would not do: uvloop's spawn (libuv) resets every signal disposition in the
child. The child gets PR_SET_PDEATHSIG so it never outlives a proxy that was SIGKILLed,
and no file descriptor beyond 0-2 (``children.child_preexec``). A backend that exits on its
own while the proxy serves stops the proxy with exit status 1 (``_watch_exit``); one that
exits during start-up with status 2 (a start-up mistake, e.g. ``--model`` names no file,
explained on the shared stderr) raises ``BackendMistake``, for ``llmproxy serve`` to exit
with status 2 too.

The backend wants a key on every route but ``/health``: a random one per start, passed in
its environment (``KEY_ENV``; a command line is readable by every user through ``ps``) and
published in ``BACKEND_KEY`` for the proxy to send. So ``--api-key`` cannot be walked
around by calling the backend's loopback port directly, nor can its gate.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import structlog
from aiohttp import web

from llmproxy.backend.settings import stop_budget_s
from llmproxy.common.children import child_preexec
from llmproxy.common.config import EXIT_USAGE
from llmproxy.common.server import StopRequest
from llmproxy.proxy.app_keys import SETTINGS, STOP, UPSTREAM_URL
from llmproxy.proxy.settings import ProxySettings

log = structlog.get_logger("llmproxy.embedded")
# The backend's own --shutdown-timeout-s: the proxy's connections are closed by then.
BACKEND_DRAIN_S = 0.5
BACKEND_STOP_S = stop_budget_s(BACKEND_DRAIN_S) + 1.0  # SIGTERM -> SIGKILL (9 s)
#: the backend's ``api_key`` setting, from its environment (private to its user, unlike argv)
KEY_ENV = "LLMPROXY_API_KEY"
#: the key this start gave the backend: the proxy's upstream key for it
BACKEND_KEY = web.AppKey("backend_key", str)


class BackendMistake(RuntimeError):
    """The embedded backend exited during start-up with status 2: it rejected its settings
    and said why on stderr."""


def backend_command(s: ProxySettings, port_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "llmproxy.backend", "--host", "127.0.0.1", "--port", "0"]
    cmd += [
        "--port-file",
        str(port_file),
        "--engine",
        s.engine,
        "--shutdown-timeout-s",
        str(BACKEND_DRAIN_S),
    ]
    cmd += ["--no-sigint"]  # Ctrl-C is the proxy's to handle (see the module docstring)
    if s.parallel is not None:  # slots: llama-cpp runs one worker per slot, torch one batch of them
        cmd += ["--max-batch-size" if s.engine == "torch" else "--parallel", str(s.parallel)]
    cmd += ["--log-level", s.log_level, "--loop", s.loop]
    if s.model is not None:
        cmd += ["--model", str(s.model)]
    if s.n_threads is not None:
        cmd += ["--n-threads", str(s.n_threads)]
    if s.n_ctx is not None:
        cmd += ["--n-ctx", str(s.n_ctx)]
    if s.log_json is not None:
        cmd += ["--log-json" if s.log_json else "--no-log-json"]
    return cmd


def _read_port(port_file: Path) -> int | None:
    """The port the backend wrote to ``port_file``, once it has."""
    text = port_file.read_text().strip() if port_file.exists() else ""
    return int(text) if text else None


async def _wait_ready(proc: asyncio.subprocess.Process, port_file: Path, limit_s: float) -> str:
    """The backend's URL once ``/health`` answers 200; ``BackendMistake`` or RuntimeError if
    it exits first or is not ready within ``limit_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    url: str | None = None
    last_note = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while loop.time() < deadline:
            if proc.returncode == EXIT_USAGE:
                raise BackendMistake(
                    f"embedded backend rejected its settings (code {proc.returncode})"
                )
            if proc.returncode is not None:
                raise RuntimeError(
                    f"embedded backend exited during start-up (code {proc.returncode})"
                )
            port = None if url is not None else await asyncio.to_thread(_read_port, port_file)
            if port is not None:
                url = f"http://127.0.0.1:{port}"
            if url is not None:
                try:
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            return url
                        info = await resp.json(content_type=None)
                except (aiohttp.ClientError, ValueError, TimeoutError):
                    info = None
                if time.monotonic() - last_note > 1.0:
                    last_note = time.monotonic()
                    log.info(
                        "embedded backend loading the model",
                        url=url,
                        state=info,
                        for_s=round(limit_s - (deadline - loop.time()), 1),
                        limit_s=limit_s,
                    )
            await asyncio.sleep(0.1)
    raise RuntimeError(f"embedded backend not ready within {limit_s:g}s")


async def _stop(proc: asyncio.subprocess.Process, grace: float) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            log.warning("embedded backend did not stop in time; killing it", pid=proc.pid)
            proc.kill()
            await proc.wait()


async def _watch_exit(proc: asyncio.subprocess.Process, stop: StopRequest | None) -> None:
    """The backend exited while the proxy serves (it was not stopped by us: this task is
    cancelled first): every request would get 502 from now on, and ``/llmproxy/health``
    would still say ok. Stop the proxy with a failure status instead, so that whoever runs
    it (systemd's ``Restart=on-failure``, a shell) sees it and starts it again."""
    code = await proc.wait()
    log.error(
        "embedded backend exited unexpectedly: stopping the proxy", pid=proc.pid, exit_code=code
    )
    if stop is not None:
        stop.request(1)


async def embedded_backend(app: web.Application) -> AsyncIterator[None]:
    """Concurrency contract: a task of this context (``_watch_exit``) waits on the child for
    as long as the app serves; the context's exit cancels and awaits it before stopping the
    child, so only a death we did not cause is reported."""
    s = app[SETTINGS]
    with tempfile.TemporaryDirectory(prefix="llmproxy-") as tmp:
        port_file = Path(tmp) / "backend.port"
        cmd = backend_command(s, port_file)
        log.info(
            "starting embedded backend",
            engine=s.engine,
            model=str(s.model or "default"),
            parallel=s.parallel,
        )
        key = secrets.token_urlsafe(32)
        app[BACKEND_KEY] = key
        env = {**os.environ, KEY_ENV: key}  # not argv: ``ps`` shows every user a command line
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, preexec_fn=child_preexec())
        try:
            started = time.monotonic()
            app[UPSTREAM_URL] = await _wait_ready(proc, port_file, s.backend_start_timeout_s)
            took = round(time.monotonic() - started, 1)
            log.info("embedded backend ready", url=app[UPSTREAM_URL], pid=proc.pid, took_s=took)
            watch = asyncio.create_task(
                _watch_exit(proc, app.get(STOP)), name="llmproxy-backend-watch"
            )
            try:
                yield
            finally:
                watch.cancel()
                await asyncio.wait([watch])
        finally:
            await _stop(proc, BACKEND_STOP_S)
