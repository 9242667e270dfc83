"""The worker process: owns one engine instance and drives it (``engines/base.py``).

Started with the multiprocessing *spawn* context by the supervisor. Inbound messages
(Submit/Cancel/Shutdown) arrive on ``inq`` (a multiprocessing Queue: the event loop's
``put`` never blocks); events go out on ``out`` (the write end of a one-way Pipe, sent
synchronously: no feeder thread between a token and the server) as *lists* of events
(one list per loop turn, fewer pickles). The loop:

* idle (``engine.active() == 0``): block on ``inq`` with a short timeout;
* busy: drain ``inq`` without blocking, then ``engine.step()`` (one bounded unit), so a
  Cancel lands between two tokens and a new Submit joins at the next step.

Before each unit of work (admitting, one ``step``) the loop stamps ``busy`` (shared
memory, see ``Busy``), so the server can see a worker stuck inside one C call (a
tokenizer, a decode) and restart it; it cannot interrupt the call itself.

The worker exits on Shutdown, or by itself when its parent dies (``os.getppid()``
changes), so a SIGKILLed server never leaves orphans. Any engine exception on a request
becomes a ``Failed`` event; an exception outside a request ends the process (the
supervisor restarts it). The loop closes the engine on every exit.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from llmproxy.backend.protocol import (
    Cancel,
    Event,
    Failed,
    Inbound,
    Shutdown,
    Submit,
    WorkerState,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.queues import Queue

    from llmproxy.backend.settings import BackendSettings

IDLE_POLL_S = 0.25
T = TypeVar("T")


def _parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def worker_main(
    index: int,
    settings_data: dict[str, Any],
    inq: Queue[Inbound],
    conn: Connection,
    parent_pid: int,
    busy: Busy,
) -> None:
    """Entry point of a worker process (must be importable: spawn pickles it by name)."""
    # The server handles SIGINT/SIGTERM and tells workers to stop; a terminal's Ctrl-C
    # (sent to the whole process group) must not kill a worker mid-generation.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    outq = Sender(conn)
    from llmproxy.backend.settings import BackendSettings

    settings = BackendSettings.from_worker(settings_data)
    code = 0
    try:
        code = run_worker(index, settings, inq, outq, parent_pid, busy)
    except ParentGone:
        code = 0
    except BaseException:
        msg = traceback.format_exc()
        try:
            outq.put([WorkerState("failed", message=msg[-2000:])])
            time.sleep(0.1)
        except Exception:
            pass
        print(msg, file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ParentGone(Exception):
    """The server closed its end of the result pipe: the worker exits quietly."""


class Sender:
    """``put`` over the write end of a Pipe; a closed pipe means the server is gone."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, events: list[Event]) -> None:
        try:
            self.conn.send(events)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise ParentGone() from exc


class Busy(Protocol):
    """Shared memory the server reads (``multiprocessing.RawValue("d")``): the
    ``time.monotonic()`` at which the worker began its current unit of work (admitting or
    cancelling requests, one ``step``), 0.0 while it waits for work or loads the model.
    The dispatcher's watchdog restarts a worker whose unit has run past ``step_timeout_s``."""

    value: float


def run_worker(
    index: int,
    settings: BackendSettings,
    inq: Queue[Inbound],
    outq: Sender,
    parent_pid: int,
    busy: Busy,
) -> int:
    from llmproxy.backend.engines import create_engine

    engine = create_engine(settings, index)
    last_progress = [0.0]

    def progress(p: float) -> None:
        if p - last_progress[0] >= 0.05 or p >= 1.0:
            last_progress[0] = p
            outq.put([WorkerState("loading", progress=float(p))])

    outq.put([WorkerState("loading", progress=0.0)])
    info = engine.load(progress)
    # the loaded engine's objects leave the full collections: no multi-ms pause mid-generation
    gc.freeze()
    outq.put([WorkerState("ready", progress=1.0, info=info)])

    idle_unload_s = settings.idle_unload_s
    idle_since = time.monotonic()
    sleeping = False
    try:
        while True:
            if not _parent_alive(parent_pid):
                return 0
            out: list[Event] = []
            msgs: list[Inbound] = []
            if engine.active() == 0:
                busy.value = 0.0
                try:
                    msgs.append(inq.get(timeout=IDLE_POLL_S))
                except queue.Empty:
                    if (
                        idle_unload_s > 0
                        and not sleeping
                        and time.monotonic() - idle_since >= idle_unload_s
                    ):
                        engine.sleep()
                        sleeping = True
                        outq.put([WorkerState("sleeping", progress=1.0, info=info)])
                    continue
            while True:
                try:
                    msgs.append(inq.get_nowait())
                except queue.Empty:
                    break
            busy.value = time.monotonic()
            for msg in msgs:
                if isinstance(msg, Shutdown):
                    # finish nothing new: cancel what is left (the server drained first)
                    for rid in engine.active_ids():
                        out.extend(engine.cancel(rid))
                    if out:
                        outq.put(out)
                    return 0
                if isinstance(msg, Submit):
                    if sleeping:  # reload now, reporting it, rather than inside admit()
                        sleeping = False
                        busy.value = 0.0  # a load is not a step: no step bound on it
                        outq.put([WorkerState("waking", progress=0.0, info=info)])
                        info = engine.load(lambda _p: None)
                        outq.put([WorkerState("ready", progress=1.0, info=info)])
                        busy.value = time.monotonic()
                    out.extend(_guard(msg.request_id, engine.admit, msg))
                elif isinstance(msg, Cancel):
                    out.extend(_guard(msg.request_id, engine.cancel, msg.request_id))
            if out:
                outq.put(out)
                out = []
            if engine.active() > 0:
                busy.value = time.monotonic()
                out.extend(engine.step())
                if out:
                    outq.put(out)
                if engine.active() == 0:
                    idle_since = time.monotonic()
    finally:
        try:
            engine.close()
        except Exception:
            pass


def _guard(request_id: str, fn: Callable[[T], list[Event]], arg: T) -> list[Event]:
    try:
        return list(fn(arg))
    except Exception as exc:  # a bad request must never kill the worker
        traceback.print_exc()
        return [Failed(request_id, 500, f"engine error: {exc}")]
