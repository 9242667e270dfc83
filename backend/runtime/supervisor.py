"""Worker processes: start (spawn), watch, restart with exponential backoff, stop.

The supervisor owns one ``WorkerHandle`` per worker process. Each incarnation of a worker
gets fresh queues (a SIGKILLed process may leave a queue's lock held) and a new
``generation`` number, so late events from a dead incarnation are ignored.

Death handling (``on_exit``, called on the event loop by the dispatcher's reader thread
within ~0.1 s of the death): the dispatcher fails the worker's in-flight requests (502),
the worker is marked ``error`` and restarted after the current backoff delay. The delay
starts at ``restart_backoff_min_s`` and doubles (capped at ``restart_backoff_max_s``)
each time a worker dies without having served for a minute; a longer life resets it.

A worker stuck in one unit of work (its ``busy`` stamp older than ``step_timeout_s``:
a prompt the tokenizer takes minutes over, a hung decode) cannot be interrupted, so the
dispatcher's watchdog reports it (``kill_stuck``: state ``error`` with the reason) and
kills it; it then dies and restarts as above.

Shutdown: ``Shutdown`` poison pills, ``join`` with a deadline, then ``kill`` for
stragglers. Workers also exit on their own when the server process dies (they watch
``os.getppid()``), so no path leaves orphans.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from llmproxy.backend.protocol import EngineInfo, Inbound, Shutdown
from llmproxy.backend.runtime.worker import worker_main
from llmproxy.backend.settings import WORKER_JOIN_S, WORKER_KILL_JOIN_S

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess
    from multiprocessing.queues import Queue

    from llmproxy.backend.settings import BackendSettings

log = structlog.get_logger("llmproxy.backend.runtime.supervisor")

STABLE_AFTER_S = 60.0
STUCK = "worker stuck in one step"  # how a stuck worker's message starts
_ctx = mp.get_context("spawn")


@dataclass
class WorkerHandle:
    index: int
    n_slots: int
    slot_base: int  # global id of its local slot 0
    generation: int = 0
    process: SpawnProcess | None = None
    inq: Queue[Inbound] | None = None
    outq: Connection | None = None  # the read end of the worker's result pipe
    state: str = "starting"  # starting | loading | ready | sleeping | waking | error | stopped
    progress: float = 0.0
    info: EngineInfo | None = None
    message: str = ""
    restarts: int = 0
    started_at: float = 0.0
    backoff_s: float = 0.0
    busy: Any = None  # the incarnation's ``worker.Busy`` (a shared double)
    restart_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def ready(self) -> bool:
        return self.state in ("ready", "sleeping", "waking")  # a sleeping worker takes requests

    def send(self, msg: Inbound) -> None:
        """Put ``msg`` on the worker's inbound queue (never blocks); raises once it is closed."""
        if self.inq is None:
            raise RuntimeError(f"worker {self.index} was never started")
        self.inq.put(msg)

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": self.pid,
            "state": self.state,
            "progress": round(self.progress, 3),
            "slots": list(range(self.slot_base, self.slot_base + self.n_slots)),
            "restarts": self.restarts,
            "message": self.message[-500:],
        }


class Supervisor:
    def __init__(
        self, settings: BackendSettings, on_started: Callable[[WorkerHandle], None]
    ) -> None:
        """``on_started(handle)`` is called on the loop after each (re)start (starts the reader)."""
        self.settings = settings
        self._on_started = on_started
        self.workers: list[WorkerHandle] = []
        base = 0
        for i, n in enumerate(settings.slot_layout()):
            self.workers.append(WorkerHandle(index=i, n_slots=n, slot_base=base))
            base += n
        self.closing = False
        self._settings_data = settings.to_worker()

    async def start_all(self) -> None:
        await asyncio.gather(*(self._start(w) for w in self.workers))

    async def _start(self, w: WorkerHandle) -> None:
        if self.closing:
            return
        w.generation += 1
        if w.inq is not None:  # the dead incarnation's queue: stop its feeder thread, free its pipe
            _close_queue(w.inq)
        w.inq = _ctx.Queue()
        w.outq, child_out = _ctx.Pipe(duplex=False)
        w.busy = _ctx.RawValue("d", 0.0)
        w.state, w.progress, w.message = "starting", 0.0, ""
        w.process = _ctx.Process(
            target=worker_main,
            args=(w.index, self._settings_data, w.inq, child_out, os.getpid(), w.busy),
            name=f"llmproxy-backend-worker-{w.index}",
            daemon=False,
        )
        await asyncio.to_thread(w.process.start)
        child_out.close()  # the worker holds the only write end: its death means EOF here
        w.started_at = time.monotonic()
        log.info("worker_started", worker=w.index, pid=w.pid, generation=w.generation)
        self._on_started(w)

    def stuck_for(self, w: WorkerHandle, now: float) -> float:
        """How long ``w`` has been in its current unit of work past ``step_timeout_s``
        (0.0 when it is not, or is not running)."""
        if w.busy is None or w.process is None or w.state not in ("ready", "sleeping"):
            return 0.0
        since = float(w.busy.value)
        age = now - since if since else 0.0
        return age if age > self.settings.step_timeout_s else 0.0

    def kill_stuck(self, w: WorkerHandle, age: float) -> None:
        """Report ``w`` stuck (its state and message, for /health and /slots) and SIGKILL
        it; its death then takes the usual path (``on_exit``: requests fail, restart)."""
        w.state = "error"
        w.message = (
            f"{STUCK} for {age:.1f} s (step_timeout_s "
            f"{self.settings.step_timeout_s:g}); restarting it"
        )
        log.error("worker_stuck", worker=w.index, pid=w.pid, stuck_s=round(age, 1))
        if w.process is not None and w.process.is_alive():
            w.process.kill()

    def on_exit(self, w: WorkerHandle, exitcode: int | None) -> None:
        """The worker process died (called on the loop). Schedule its restart."""
        if w.process is not None:
            w.process.join(0)
        if self.closing:
            w.state = "stopped"
            return
        w.state = "error"
        w.message = w.message or f"worker exited with code {exitcode}"
        lived = time.monotonic() - w.started_at
        if lived >= STABLE_AFTER_S or w.backoff_s == 0:
            w.backoff_s = self.settings.restart_backoff_min_s
        else:
            w.backoff_s = min(max(w.backoff_s * 2, 0.05), self.settings.restart_backoff_max_s)
        log.error(
            "worker_died", worker=w.index, pid=w.pid, exitcode=exitcode, restart_in_s=w.backoff_s
        )
        w.restart_task = asyncio.get_running_loop().create_task(self._restart_later(w, w.backoff_s))

    async def _restart_later(self, w: WorkerHandle, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.closing:
            return
        w.restarts += 1
        await self._start(w)

    async def stop_all(self, timeout_s: float = WORKER_JOIN_S) -> None:
        """Pending restarts end first (one still in its back-off is cancelled, one already
        starting its process finishes), then poison pills, join with a deadline, kill stragglers."""
        self.closing = True
        restarts = [
            w.restart_task
            for w in self.workers
            if w.restart_task is not None and not w.restart_task.done()
        ]
        for w in self.workers:
            if w.restart_task in restarts and w.state != "starting":
                w.restart_task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        for w in self.workers:
            if w.process is not None and w.process.is_alive():
                try:
                    w.send(Shutdown())
                except Exception:
                    pass
        await asyncio.to_thread(self._join_all, timeout_s)

    def _join_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            p = w.process
            if p is None:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("worker_kill", worker=w.index, pid=p.pid)
                p.kill()
                p.join(WORKER_KILL_JOIN_S)
            w.state = "stopped"
            if w.inq is not None:
                _close_queue(w.inq)


def _close_queue(q: Queue[Inbound]) -> None:
    """Close a worker's inbound queue without waiting on its feeder thread (the reader may
    be dead)."""
    try:
        q.cancel_join_thread()
        q.close()
    except Exception:
        pass
