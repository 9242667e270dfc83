"""The dispatch layer: bridges the event loop and the worker processes without blocking.

* One reader **thread** per worker incarnation blocks on that worker's result pipe and
  hands each batch of events to the loop with ``loop.call_soon_threadsafe``. The worker
  holds the only write end, so its death reads as EOF at once (and the thread also
  checks ``is_alive`` every 0.1 s of quiet).
* On the loop, ``_on_events`` feeds each request's ``asyncio.Queue`` and keeps the slot
  table. A slot is marked idle **only** when the worker's ``Done``/``Failed`` for its
  request arrives (or the worker is dead), never when a client goes away: /slots shows a
  cancelled generation as processing until the worker has really stopped.
* A watchdog task (``_watch_steps``) restarts a worker stuck inside one unit of work.
* ``start_request(s)`` tokenizes the prompt first (``tokenize.Tokenizer``, threads of this
  process) and only then waits for a slot: a slot never waits on a tokenizer.
* Slots are global ids ``0..total_slots-1`` mapped onto (worker, local slot); the
  ``Submit`` sent to a worker carries the *local* slot id.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from typing import TYPE_CHECKING

import structlog

from llmproxy.backend.protocol import (
    Cancel,
    Done,
    Event,
    Failed,
    Prompt,
    SamplingParams,
    Submit,
    Token,
    WorkerState,
)
from llmproxy.backend.runtime.counters import Counters
from llmproxy.backend.runtime.slots import QueueFull, Request, Slot, Unavailable
from llmproxy.backend.runtime.supervisor import Supervisor, WorkerHandle
from llmproxy.backend.runtime.tokenize import Tokenizer
from llmproxy.backend.settings import WORKER_JOIN_S

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess

    from llmproxy.backend.settings import BackendSettings

log = structlog.get_logger("llmproxy.backend.runtime.dispatch")

READER_POLL_S = 0.1


class Dispatcher:
    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        self.loop: asyncio.AbstractEventLoop | None = None
        self.supervisor = Supervisor(settings, self._worker_started)
        self.slots: list[Slot] = []
        for w in self.supervisor.workers:
            for local in range(w.n_slots):
                self.slots.append(Slot(id=w.slot_base + local, worker=w, local=local))
        self.requests: dict[str, Request] = {}
        self._task_ids = itertools.count()
        self._changed: asyncio.Event | None = None  # set (and replaced) at every slot/worker change
        self.counters = Counters()
        self.deferred = 0  # acquire calls waiting for free slots now
        self.started_at = time.time()
        self._watchdog: asyncio.Task[None] | None = None
        self.tokenizer = Tokenizer(settings)

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.supervisor.workers

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        await self.supervisor.start_all()
        self._watchdog = asyncio.create_task(self._watch_steps(), name="backend-step-watchdog")

    async def stop(self, timeout_s: float = WORKER_JOIN_S) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await self.supervisor.stop_all(timeout_s)
        for req in list(self.requests.values()):
            self._finish(req, Failed(req.id, 503, "server shutting down", "unavailable_error"))
        self.tokenizer.close()

    def _worker_started(self, w: WorkerHandle) -> None:
        t = threading.Thread(
            target=self._reader,
            args=(w, w.generation, w.outq, w.process),
            name=f"dispatch-{w.index}",
            daemon=True,
        )
        t.start()

    async def _watch_steps(self) -> None:
        """Every few tenths of ``step_timeout_s``: a worker stuck in one unit of work past
        it is reported and killed (``Supervisor.kill_stuck``); the reader thread then sees
        it die. Runs from ``start`` until ``stop`` cancels it."""
        period = min(1.0, self.settings.step_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for w in self.workers:
                age = self.supervisor.stuck_for(w, now)
                if age:
                    self.supervisor.kill_stuck(w, age)
                    self._notify()

    def _reader(
        self, w: WorkerHandle, generation: int, conn: Connection, proc: SpawnProcess
    ) -> None:
        """Blocks on one worker's result pipe; EOF (or a dead process) ends it."""
        loop = self.loop
        assert loop is not None
        try:
            while True:
                try:
                    if not conn.poll(READER_POLL_S):
                        if proc.is_alive():
                            continue
                        break
                    batch = conn.recv()
                except Exception:  # EOFError: the worker is gone; OSError, unpickling: torn
                    break
                loop.call_soon_threadsafe(self._on_events, w, generation, batch)
            proc.join(1.0)
            loop.call_soon_threadsafe(self._on_exit, w, generation, proc.exitcode)
        except RuntimeError:  # the loop is closed: the server is gone
            pass
        finally:
            try:
                conn.close()
            except Exception:
                pass

    # --- loop-side event handling --------------------------------------------------------

    def _on_events(self, w: WorkerHandle, generation: int, batch: list[Event]) -> None:
        if generation != w.generation:
            return
        for ev in batch:
            if isinstance(ev, WorkerState):
                self._on_state(w, ev)
                continue
            req = self.requests.get(ev.request_id)
            if req is None:
                continue
            if isinstance(ev, Token):
                req.slot.n_decoded = ev.n_decoded
                req.slot.has_new_line = req.slot.has_new_line or "\n" in ev.text
                req.queue.put_nowait(ev)
            else:
                self._finish(req, ev)

    def _on_state(self, w: WorkerHandle, ev: WorkerState) -> None:
        w.state = ev.state if ev.state != "failed" else "error"
        w.progress = ev.progress
        if ev.info is not None:
            w.info = ev.info
        if ev.message:
            w.message = ev.message
        if ev.state == "ready":
            w.message = ""
            if ev.info is not None:
                self.tokenizer.on_ready(ev.info)
            log.info("worker_ready", worker=w.index, pid=w.pid)
        self._notify()

    def _on_exit(self, w: WorkerHandle, generation: int, exitcode: int | None) -> None:
        if generation != w.generation:
            return
        w.generation += 1  # ignore anything else from this incarnation
        for req in [r for r in self.requests.values() if r.slot.worker is w]:
            self._finish(
                req,
                Failed(
                    req.id,
                    502,
                    f"backend worker {w.index} died (exit code {exitcode}); request aborted",
                ),
            )
        self.supervisor.on_exit(w, exitcode)
        self._notify()

    def _finish(self, req: Request, ev: Event) -> None:
        if req.finished:
            return
        req.finished = True
        req.result = ev
        if isinstance(ev, Done):
            self.counters.add(ev)
        self.requests.pop(req.id, None)
        slot = req.slot
        if slot.request is req:
            slot.request = None
            slot.last_used = time.monotonic()
        if req.pinned is not None:
            req.pinned.standins.discard(req.id)
        req.queue.put_nowait(ev)
        req.done_event.set()
        self._notify()

    def _notify(self) -> None:
        """Wake every ``acquire`` waiting for a change (on the loop thread; no task needed)."""
        changed = self._changed
        if changed is None:
            return
        self._changed = asyncio.Event()
        changed.set()

    # --- requests ---------------------------------------------------------------------

    def any_ready(self) -> bool:
        return any(w.ready for w in self.workers)

    def _pick(self, id_slot: int, count: int) -> list[Slot] | None:
        """``count`` free slots, ``id_slot``'s (or the lowest free) first, then the lowest
        other free ones (llama-server's choice for a request's extra completions); None
        unless all are free."""
        free = [s for s in self.slots if not s.busy and s.worker.ready]  # in id order
        if id_slot >= 0:
            first = self.slots[id_slot]
            if first.busy or not first.worker.ready:
                return None
            free = [first, *(s for s in free if s is not first)]
        return free[:count] if len(free) >= count else None

    async def acquire(self, id_slot: int = -1, count: int = 1) -> list[Slot]:
        """``count`` free slots at once (``id_slot``'s first, see ``_pick``); waits while they
        are not all free. Returns without suspending when they are, so a caller that submits
        right after gets exactly these slots.

        ``id_slot`` whose worker is down (restarting after a crash, or still loading) is
        treated as no pin: the request takes the lowest free live slot, or waits for one. The
        pin only buys prompt-cache reuse, and that cache died with the worker; answering 503
        instead would fail every request of an editor whose session the proxy keeps on that
        slot, and trip the proxy's circuit breaker for all, while the other slots idle.
        ``Unavailable`` (503) only when no worker (or, for ``count`` > 1, too few) can run it;
        ``QueueFull`` (429) when it would wait behind ``max_queue`` others already waiting
        (each holds its body in memory meanwhile)."""
        if id_slot >= len(self.slots):
            raise ValueError(f"id_slot {id_slot} out of range (total_slots={len(self.slots)})")
        if not 1 <= count <= len(self.slots):
            raise ValueError(f"count {count} out of range (total_slots={len(self.slots)})")
        while True:
            pin = id_slot if id_slot >= 0 and self.slots[id_slot].worker.ready else -1
            if not self.any_ready():
                raise Unavailable(self._unavailable_message())
            if count > 1 and sum(s.worker.ready for s in self.slots) < count:
                raise Unavailable(self._unavailable_message())  # not enough live slots for them all
            slots = self._pick(pin, count)
            if slots is not None:
                return slots
            changed = self._changed
            assert changed is not None
            if self.deferred >= self.settings.max_queue:
                raise QueueFull(f"server busy: {self.deferred} requests already wait for a slot")
            self.deferred += 1
            try:
                await changed.wait()
            finally:
                self.deferred -= 1

    def _unavailable_message(self) -> str:
        if any(w.state == "error" for w in self.workers):
            return "Model worker restarting"
        return "Loading model"

    def submit(
        self, slot: Slot, prompt: Prompt, params: SamplingParams, id_slot: int = -1
    ) -> Request:
        """Start a request on ``slot`` (from ``acquire``). ``id_slot``: the slot it asked for;
        when that is another (its worker down), that slot shows busy in /slots until this
        request ends, so a caller that pinned it (the proxy's permit i is slot i) and polls
        it to learn when a cancelled request stopped does not see it idle too early."""
        rid = uuid.uuid4().hex
        w = slot.worker
        sub = Submit(request_id=rid, slot=slot.local, prompt=prompt, params=params)
        req = Request(id=rid, slot=slot, submit=sub, generation=w.generation)
        if 0 <= id_slot != slot.id:
            req.pinned = self.slots[id_slot]
            req.pinned.standins.add(rid)
        slot.request = req
        slot.id_task = next(self._task_ids)
        slot.n_decoded = 0
        slot.has_new_line = False
        slot.params = params
        self.requests[rid] = req
        try:
            w.send(sub)
        except Exception as exc:  # queue closed (worker being replaced)
            self._finish(req, Failed(rid, 503, f"worker unavailable: {exc}", "unavailable_error"))
        return req

    async def tokenize(self, prompt: Prompt, n_predict: int) -> Prompt:
        """``prompt`` as token ids, tokenized off the slots (``Tokenizer.tokenize``: raises
        ``PromptRefused``, ``QueueFull``; ``Unavailable`` while no worker is ready, as
        ``acquire`` would). Holds no slot; a cancelled caller stops waiting."""
        if not self.any_ready():
            raise Unavailable(self._unavailable_message())
        return await self.tokenizer.tokenize(uuid.uuid4().hex, prompt, n_predict)

    async def start_request(
        self, prompt: Prompt, params: SamplingParams, id_slot: int = -1
    ) -> Request:
        """Tokenize ``prompt`` (no slot held meanwhile), then take a slot and submit."""
        prompt = await self.tokenize(prompt, params.n_predict)
        [slot] = await self.acquire(id_slot)
        return self.submit(slot, prompt, params, id_slot)

    async def start_requests(
        self, prompt: Prompt, params: Sequence[SamplingParams], id_slot: int = -1
    ) -> list[Request]:
        """One request per ``params`` on as many slots, started together once all are free
        (llama-server's ``n_cmpl``): ``id_slot``'s slot runs the first. The prompt is
        tokenized once, before any slot is taken."""
        prompt = await self.tokenize(prompt, params[0].n_predict)
        slots = await self.acquire(id_slot, len(params))
        return [
            self.submit(slot, prompt, p, id_slot if i == 0 else -1)
            for i, (slot, p) in enumerate(zip(slots, params, strict=True))
        ]

    def cancel(self, req: Request) -> None:
        """Ask the worker to stop (between tokens). The slot stays busy until it answers."""
        if req.finished:
            return
        try:
            req.slot.worker.send(Cancel(req.id))
        except Exception:
            pass
