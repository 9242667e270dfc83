"""The fake router's models: each one's status, its child servers, its loads and unloads.

``RouterModels`` keeps what llama-server's router mode (``--models-dir``) keeps per model:
its status (``unloaded`` -> ``loading`` -> ``loaded``, back to ``unloaded`` on an unload or
an eviction), when it was last used, and its child server: here a
``FakeUpstream(kind="llamacpp")`` on its own ephemeral port, started when its load ends and
stopped when it is unloaded (requests in flight to it then fail, their connections closed,
as when llama-server's child process exits). A load first waits its model's
``load_delay_s``, then its ``load_hold`` event if it has one (tests hold a model in
``loading`` with it), then starts the child. Requests that find their model loading wait
for that same load (``ensure_loaded``). A load that would leave more than ``models_max``
models loaded or loading first unloads the least recently used of them, as llama-server's
``unload_lru``, and waits for that child to stop before its own delay.

Concurrency contract: state is mutated synchronously, every change followed by
``changed()``, which wakes every ``wait(predicate)``. The table owns its tasks (loads and
child stops): ``stop()`` refuses new loads, cancels the loads in progress, stops every
child and awaits them all.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from llmproxy.bench.fake.upstream import FakeUpstream

Status = Literal["unloaded", "loading", "loaded"]


class ModelNotFound(LookupError):
    """The router has no model of that name."""


class ModelNotLoaded(RuntimeError):
    """A request's model is not loaded and will not be (no autoload, or its load ended
    without a child: unloaded meanwhile, the router stopping, or the child failed)."""


@dataclass(eq=False)
class RouterModel:
    """One model of the router and the ``FakeUpstream`` keyword arguments of its children."""

    name: str
    child_kwargs: dict[str, Any]
    load_delay_s: float = 0.0
    load_hold: asyncio.Event | None = None
    aliases: tuple[str, ...] = ()  # other names it answers to (a preset's ``alias``)
    status: Status = "unloaded"
    child: FakeUpstream | None = None  # while loaded
    children: list[FakeUpstream] = field(default_factory=list)  # every child it had, in order
    load: asyncio.Task[None] | None = None  # while loading
    last_used: int = 0  # a tick of the table's clock: loads and requests touch it
    error: BaseException | None = None  # why its last load failed (a child that did not start)


class RouterModels:
    """The models of one fake router; see the module docstring."""

    def __init__(self, models: list[RouterModel], models_max: int) -> None:
        self.models = {m.name: m for m in models}
        self.models_max = models_max  # <= 0: no limit
        self.loads = dict.fromkeys(self.models, 0)  # loads started, per model
        self.unloads = dict.fromkeys(self.models, 0)  # unloads and evictions, per model
        self.stopping = False
        self._clock = itertools.count(1)
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def get(self, name: str) -> RouterModel:
        """The model ``name`` names: its own name or one of its aliases."""
        found = self.models.get(name) or next(
            (m for m in self.models.values() if name in m.aliases), None
        )
        if found is None:
            raise ModelNotFound(name)
        return found

    # ----------------------------------------------------------------- changes
    def changed(self) -> None:
        """Wake every ``wait`` (state was mutated just before)."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds; re-checked at every ``changed()``."""
        while not predicate():
            await self._changed.wait()

    def touch(self, m: RouterModel) -> None:
        """``m`` was used now (the least recently used is evicted first)."""
        m.last_used = next(self._clock)

    # ----------------------------------------------------------------- load / unload
    def load(self, name: str) -> RouterModel:
        """Start loading ``name`` unless it is loaded or loading (synchronously: its status
        is ``loading`` on return); evicts the least recently used models over
        ``models_max``."""
        m = self.get(name)
        self.touch(m)
        if m.status != "unloaded" or self.stopping:
            return m
        running = [o for o in self.models.values() if o is not m and o.status != "unloaded"]
        stops: list[asyncio.Task[None]] = []
        while 0 < self.models_max <= len(running):
            lru = min(running, key=lambda o: o.last_used)
            running.remove(lru)
            stop = self._unload(lru)
            if stop is not None:
                stops.append(stop)
        m.status, m.error = "loading", None
        self.loads[m.name] += 1
        m.load = self._spawn(self._load(m, stops))
        self.changed()
        return m

    async def ensure_loaded(self, name: str, autoload: bool = True) -> FakeUpstream:
        """The child of ``name``, loading it first (``autoload``) or waiting for the load in
        progress. Raises ModelNotFound, or ModelNotLoaded."""
        m = self.get(name)
        if m.status == "unloaded" and not autoload:
            raise ModelNotLoaded("model is not loaded")
        self.load(name)
        if m.load is not None:
            await asyncio.wait({m.load})  # never cancels the load (nor fails with it)
        if m.status != "loaded" or m.child is None:
            raise ModelNotLoaded(f"model '{name}' failed to load")
        return m.child

    async def unload(self, name: str) -> None:
        """Unload ``name`` (if loaded or loading) and wait until its child has stopped."""
        stop = self._unload(self.get(name))
        if stop is not None:
            await asyncio.wait({stop})

    def _unload(self, m: RouterModel, count: bool = True) -> asyncio.Task[None] | None:
        """Unload ``m`` now (synchronously): its load cancelled, its child's stop begun in a
        task of the table, returned (None: no child to stop)."""
        if m.status == "unloaded":
            return None
        if m.load is not None:
            m.load.cancel()
            m.load = None
        child, m.child, m.status = m.child, None, "unloaded"
        if count:
            self.unloads[m.name] += 1
        self.changed()
        return self._spawn(child.stop()) if child is not None else None

    async def _load(self, m: RouterModel, stops: list[asyncio.Task[None]]) -> None:
        if stops:
            await asyncio.wait(stops)  # the evicted children are gone (not cancelled with us)
        await asyncio.sleep(m.load_delay_s)
        if m.load_hold is not None:
            await m.load_hold.wait()
        child = FakeUpstream(kind="llamacpp", models=(m.name,), **m.child_kwargs)
        try:
            await child.start()
        except asyncio.CancelledError:
            await child.stop()
            raise
        except Exception as e:  # kept on the model, which goes back to unloaded
            await child.stop()
            m.status, m.load, m.error = "unloaded", None, e
            self.changed()
            return
        m.status, m.child, m.load = "loaded", child, None
        m.children.append(child)
        self.changed()

    # ----------------------------------------------------------------- lifecycle
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """No more loads; cancel those in progress, stop every child, await it all."""
        self.stopping = True
        for m in self.models.values():
            self._unload(m, count=False)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
