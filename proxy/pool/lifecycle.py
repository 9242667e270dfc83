"""A pool's upstreams from start to exit, and changes to the set while serving (reload).

Each upstream is detected exactly as the one upstream is (detect.py, with its own settings
and ClientSession), gets its gate sized the same way (watch.gate_capacity) and is watched
for what detection could not learn yet (watch.py). ``PoolRuntime.reload`` applies a new
list of upstreams: an added one is detected and joins the rotation; a removed or changed
one leaves the rotation at once (``draining``), keeps its requests in flight until they
finish (or are cancelled and confirmed stopped), then goes. Reloads run one at a time, in
one task the runtime owns; teardown cancels it.

Concurrency contract: event loop thread only. The runtime owns each member's watcher (an
exit stack per member), the health probe task and the reload task; ``running_pool``'s exit
(after the app closed the pool and drained its requests) cancels them and closes every
member's adapter and session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.health import probing
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Pool
from llmproxy.proxy.pool.specs import UpstreamSpec, settings_for
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.detect import create_adapter
from llmproxy.proxy.upstream.session import open_session
from llmproxy.proxy.upstream.watch import gate_capacity, watching

log = structlog.get_logger("llmproxy.pool")


async def _member(settings: ProxySettings, spec: UpstreamSpec) -> Member:
    own = settings_for(settings, spec)
    session = open_session(own)
    try:
        adapter = await create_adapter(session, own, spec.url)
    except BaseException:
        await session.close()
        raise
    gate = Gate(
        gate_capacity(own, adapter),
        own.max_queue,
        retry_after_s=own.retry_after_s,
        affinity_wait_s=own.affinity_wait_s,
    )  # no hold_s: a request's place is kept in the pool's queue, where requests wait
    return Member(spec, own, session, adapter, gate)


class PoolRuntime:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.pool: Pool | None = None
        self._owned: set[Member] = set()  # every member not closed yet, in the pool or not
        self._stacks: dict[Member, contextlib.AsyncExitStack] = {}
        self._reload: asyncio.Task[None] | None = None
        self._next: list[UpstreamSpec] | None = None  # a reload asked for while one runs

    async def start(self, specs: list[UpstreamSpec]) -> Pool:
        members = await self._detect(specs)
        self.pool = Pool(members, self.settings)
        for m in members:
            await self._watch(m)
        return self.pool

    async def _detect(self, specs: list[UpstreamSpec]) -> list[Member]:
        """The members for ``specs``, detected concurrently; each is the runtime's (closed by
        ``close``) from the moment it exists, even if this call is cancelled meanwhile."""

        async def one(spec: UpstreamSpec) -> Member:
            m = await _member(self.settings, spec)
            self._owned.add(m)
            return m

        found = await asyncio.gather(*(one(s) for s in specs), return_exceptions=True)
        members = [r for r in found if isinstance(r, Member)]
        for r in found:
            if isinstance(r, BaseException):
                for m in members:
                    await self._forget(m)
                raise r
        return members

    async def _watch(self, m: Member) -> None:
        stack = self._stacks[m] = contextlib.AsyncExitStack()
        await stack.enter_async_context(watching(m))
        log.info("pool upstream", upstream=m.name, healthy=m.healthy, **m.adapter.describe())

    # -- reload -----------------------------------------------------------------------
    def reload(self, specs: list[UpstreamSpec]) -> None:
        """Apply ``specs`` as the set of upstreams (in the runtime's task; never blocks)."""
        self._next = specs
        if self._reload is None or self._reload.done():
            self._reload = asyncio.create_task(self._reloading(), name="llmproxy-reload")

    async def wait_reloaded(self) -> None:
        """Return once no reload is running or asked for (tests, and the reload's log)."""
        while self._reload is not None and not self._reload.done():
            await asyncio.wait([self._reload])

    async def _reloading(self) -> None:
        while self._next is not None:
            specs, self._next = self._next, None
            try:
                await self._apply(specs)
            except Exception:  # our own bug, or an upstream that failed detection: say so
                log.exception("reload failed; the upstreams stay as they were")

    async def _apply(self, specs: list[UpstreamSpec]) -> None:
        pool = self.pool
        assert pool is not None
        current = {m.spec: m for m in pool.members if not m.draining}
        leaving = [m for spec, m in current.items() if spec not in specs]
        joining = [s for s in specs if s not in current]
        if not leaving and not joining:
            log.info("reload: the upstreams are unchanged")
            return
        added = await self._detect(joining)
        for m in added:
            await self._watch(m)
            pool.add(m)
        for m in leaving:
            m.draining = True  # no more grants; its requests in flight go on
        pool.advance()
        log.info(
            "reload: upstreams changed",
            joined=[m.name for m in added],
            leaving=[m.name for m in leaving],
        )
        await asyncio.gather(*(self._drain(m) for m in leaving))

    async def _drain(self, m: Member) -> None:
        await m.gate.wait_quiescent()
        assert self.pool is not None
        self.pool.remove(m)
        await self._forget(m)
        log.info("upstream left the pool", upstream=m.name)

    async def _forget(self, m: Member) -> None:
        self._owned.discard(m)
        stack = self._stacks.pop(m, None)
        if stack is not None:
            await stack.aclose()
        await m.close()

    async def close(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
            await asyncio.wait([self._reload])
        for m in list(self._owned):  # in the pool, or joining or leaving when cut short
            await self._forget(m)


@contextlib.asynccontextmanager
async def running_pool(
    settings: ProxySettings, specs: list[UpstreamSpec]
) -> AsyncIterator[PoolRuntime]:
    runtime = PoolRuntime(settings)
    try:
        pool = await runtime.start(specs)
        async with probing(pool, settings.health_interval_s):
            yield runtime
    finally:
        await runtime.close()
