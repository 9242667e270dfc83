"""A benchmark's child server process (fake upstream, proxy): start, learn its port, stop.

``child(name, argv, workdir, start_timeout_s)`` runs ``argv --port-file F`` with its output
in ``workdir/NAME.log``, waits for the port file (failing with the log's tail if the child
exits or the timeout passes) and yields ``(pid, base URL)``. On exit of the block it
terminates the child, then kills it after ``stop_timeout_s``; the child also gets SIGTERM
if this process dies without cleaning up (PR_SET_PDEATHSIG): never an orphan.
``cpu_seconds(pid)`` reads a process's user + system CPU time (Linux /proc; NaN elsewhere).

The child's side of the same protocol: ``announce(port_file, port)`` once listening (the
file appears atomically, so the parent never reads half a number), then
wait on ``stop_event()`` (set by SIGINT/SIGTERM) and close its server.
``ReferenceSettings`` and ``run_child_main`` are the options and command-line entry of the
reference relays (overhead/forwarder.py, overhead/splice.py), which run on ``--loop``.

``child_server(argv, log, url, ready_path)`` runs a server that is told its port on its
command line (llama-server, llama-cpp-python's server, the proxy in ``bench backends``;
the interop tests' servers too) until the block ends: the block starts once
``url + ready_path`` answers 200, and ``ChildFailed`` is raised if the child exits or does
not answer in time during start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from pydantic import Field

from llmproxy.common import loops
from llmproxy.common.children import child_preexec
from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.common.portfile import write_port_file


class ReferenceSettings(LayeredSettings):
    """Options shared by the bench's reference relays (forwarder.py, splice.py); each
    subclass sets its own ``env_prefix``."""

    upstream: str = Field(description="Base URL to relay to")
    host: str = Field("127.0.0.1", description="Address to bind")
    port: int = Field(0, ge=0, le=65535, description="Port to bind; 0 picks a free port")
    port_file: Path | None = Field(
        None, description="Write the bound port to this file once listening"
    )
    loop: loops.LoopChoice = Field("auto", description="Event loop, as the proxy's --loop")


S = TypeVar("S", bound=ReferenceSettings)


@contextlib.asynccontextmanager
async def child(
    name: str, argv: list[str], workdir: Path, start_timeout_s: float, stop_timeout_s: float = 10.0
) -> AsyncIterator[tuple[int, str]]:
    port_file = workdir / f"{name}.port"
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            "--port-file",
            str(port_file),
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=child_preexec(),
        )
        try:
            deadline = time.monotonic() + start_timeout_s
            while not port_file.exists():
                if proc.returncode is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"{name} did not start (rc={proc.returncode}); its output:\n{tail}"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.02)
            yield proc.pid, f"http://127.0.0.1:{int(port_file.read_text())}"
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), stop_timeout_s)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (NaN where /proc is missing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def announce(port_file: Path | None, port: int) -> None:
    """Child side: write the bound port to ``port_file`` atomically (if given), then freeze
    the startup objects out of garbage collection, as the proxy does (server.py)."""
    if port_file is not None:
        write_port_file(port_file, port)
    gc.freeze()


def stop_event() -> asyncio.Event:
    """Child side: an event set by SIGINT or SIGTERM (the parent stops children with
    SIGTERM). Call it first thing, before the server starts, and wait on it once announced;
    the handlers stay for the loop's lifetime, so a signal during cleanup cannot kill the
    child half-way."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_child_main(
    module: str,
    description: str,
    settings_cls: type[S],
    serve: Callable[[S], Coroutine[Any, Any, None]],
    argv: list[str] | None,
) -> int:
    """Parse ``argv`` into ``settings_cls`` and run ``serve`` on its ``--loop`` (the entry of
    ``python -m MODULE``)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    add_settings_arguments(parser, settings_cls)
    settings = settings_from_args(settings_cls, parser.parse_args(argv))
    factory = loops.choose(settings.loop, module.rsplit(".", 1)[-1])[1]
    loops.run(serve(settings), factory)
    return 0


class ChildFailed(RuntimeError):
    """A server child exited, or did not answer, during start-up."""


@contextlib.asynccontextmanager
async def child_server(
    argv: Sequence[str], log: Path, url: str, ready_path: str, timeout_s: float = 300
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run the server ``argv`` (output to ``log``) as a child that dies with this process,
    until the block ends; the block starts once ``url + ready_path`` answers 200. The child
    is stopped with SIGTERM, then SIGKILL after 15 s. Also used by the interop tests."""
    with log.open("wb") as out:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=child_preexec(),
            )
        except OSError as exc:  # no such binary, not executable
            raise ChildFailed(f"cannot run {argv[0]}: {exc.strerror}") from None
    try:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if proc.returncode is not None:
                    raise ChildFailed(
                        f"{argv[0]} exited with {proc.returncode} during start-up; see {log}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + ready_path) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{url} not ready after {timeout_s:g} s; see {log}")
                await asyncio.sleep(0.1)
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
