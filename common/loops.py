"""Which asyncio event loop a server process runs on: uvloop when installed, else asyncio's.

uvloop (libuv underneath) runs the same asyncio code with cheaper callbacks, transports
and socket I/O; aiohttp and its tests support it as a drop-in loop. It is an optional
dependency (the ``speedups`` extra, installed by the Makefile): ``auto`` uses it when it
can be imported, ``uvloop`` insists on it (a clear error when missing), ``asyncio`` never
uses it. The choice is made once, before the loop starts, like uvicorn's ``--loop``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from llmproxy.common.config import usage_exit

LoopChoice = Literal["auto", "asyncio", "uvloop"]
LoopFactory = Callable[[], asyncio.AbstractEventLoop]
T = TypeVar("T")


class LoopUnavailable(RuntimeError):
    """``loop = "uvloop"`` was asked for but uvloop cannot be imported here."""


def resolve(choice: LoopChoice) -> tuple[str, LoopFactory | None]:
    """The loop's name and factory for ``choice`` (factory None: asyncio's default)."""
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise LoopUnavailable(
                f"loop = uvloop, but uvloop cannot be imported ({exc}): install the speedups extra "
                "(pip install 'llmproxy[speedups]') or choose loop = asyncio"
            ) from exc
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def choose(choice: LoopChoice, prog: str) -> tuple[str, LoopFactory | None]:
    """``resolve`` for a command line: a missing uvloop exits with ``prog: <why>`` (status 2,
    a start-up mistake: ``config.usage_exit``)."""
    try:
        return resolve(choice)
    except LoopUnavailable as exc:
        usage_exit(f"{prog}: {exc}")


def running() -> str:
    """The name of the loop this code runs on ("uvloop" or "asyncio"), for log lines."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )


def run(main: Coroutine[Any, Any, T], factory: LoopFactory | None) -> T:
    """Run ``main`` to completion on a fresh loop from ``factory`` (like ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
