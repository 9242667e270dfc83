"""The upstreams from start to exit, and changes to the set while serving (reload).

One upstream is a pool of one: the embedded backend and a single ``--upstream`` run here
exactly as several do. Each upstream is detected (detect.py, with its own settings and
ClientSession), gets its gate sized by ``watch.gate_capacity`` and is watched for what
detection could not learn yet (watch.py), each on its own. A llama-server in router mode
is a pool of its models: one member per model (router_models.py; the entry's
``models``, when stated, pick which), each with its own permits and slot state
(upstream/adapters/router.py).

``PoolRuntime.reload`` applies a new list of upstreams. A member is the server (its URL;
on a router, its URL and model), not the config entry:

- a server still listed keeps its member and its live slot state; a changed entry (name,
  weight, capacity, kind, key) updates it in place (``Member.update``; a new kind or key
  brings a new client and adapter, the old client closing once what ran on it is done);
- an added server is detected and joins the rotation;
- a removed one leaves the rotation at once (``draining``) and is closed only once every
  permit and every quarantined slot of its gate is back (``Gate.wait_quiescent``); listed
  again before that, it is back in rotation with the same slot state.

Reloads run one at a time in one task the runtime owns; they never wait on a drain:
drains run in their own tasks, and a reload is logged when applied. Teardown cancels all.

Concurrency contract: event loop thread only. The runtime owns each member's watcher (an
exit stack per member), the health probe task, the reload task and the drain tasks;
``running_pool``'s exit (after the app closed the pool and drained its requests) cancels
them and closes every member's adapter and session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

import aiohttp
import structlog

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.health import probing
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Pool
from llmproxy.proxy.pool.router_models import model_client, router_members
from llmproxy.proxy.pool.specs import settings_for
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter
from llmproxy.proxy.upstream.detect import create_adapter
from llmproxy.proxy.upstream.session import open_session
from llmproxy.proxy.upstream.watch import fit_gate, gate_capacity, watching
from llmproxy.proxy.upstreams import UpstreamSpec

log = structlog.get_logger("llmproxy.pool")


async def _client(own: ProxySettings, url: str) -> tuple[aiohttp.ClientSession, Adapter]:
    session = open_session(own)
    try:
        return session, await create_adapter(session, own, url)
    except BaseException:
        await session.close()
        raise


async def _members(settings: ProxySettings, spec: UpstreamSpec) -> list[Member]:
    """The member(s) of one configured upstream: itself, or a router's models (one each)."""
    own = settings_for(settings, spec)
    session, adapter = await _client(own, spec.url)
    if isinstance(adapter, LlamaCppAdapter) and adapter.router is not None:
        adapter.close()
        await session.close()
        return await router_members(own, spec, adapter.router, adapter.router_max)
    gate = Gate(gate_capacity(own, adapter), affinity_wait_s=own.affinity_wait_s)
    return [Member(spec, own, session, adapter, gate)]


class PoolRuntime:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.pool: Pool | None = None
        self._owned: set[Member] = set()  # every member not closed yet, in the pool or not
        self._stacks: dict[Member, contextlib.AsyncExitStack] = {}
        self._reload: asyncio.Task[None] | None = None
        self._next: list[UpstreamSpec] | None = None  # a reload asked for while one runs
        self._tasks: set[asyncio.Task[None]] = set()  # drains, and retired clients' closes
        self._drains: dict[Member, asyncio.Task[None]] = {}

    async def start(self, specs: list[UpstreamSpec]) -> Pool:
        members = await self._detect(specs)
        self.pool = Pool(members, self.settings)
        for m in members:
            await self._watch(m)
        return self.pool

    async def _detect(self, specs: list[UpstreamSpec]) -> list[Member]:
        """The members for ``specs``, detected concurrently; each is the runtime's (closed by
        ``close``) from the moment it exists, even if this call is cancelled meanwhile."""

        async def one(spec: UpstreamSpec) -> list[Member]:
            ms = await _members(self.settings, spec)
            self._owned.update(ms)
            return ms

        found = await asyncio.gather(*(one(s) for s in specs), return_exceptions=True)
        members = [m for r in found if isinstance(r, list) for m in r]
        for r in found:
            if isinstance(r, BaseException):
                for m in members:
                    await self._forget(m)
                raise r
        return members

    async def _watch(self, m: Member) -> None:
        m.on_router = self._router_found
        stack = self._stacks[m] = contextlib.AsyncExitStack()
        await stack.enter_async_context(watching(m))
        log.info("upstream", upstream=m.name, healthy=m.healthy, **m.adapter.describe())

    def _router_found(self, m: Member) -> None:
        """Re-detection found a router where no server answered at start: its models join
        as members (router_models.py) and ``m`` leaves (never in rotation meanwhile)."""
        self._spawn(self._expand(m), f"llmproxy-router-{m.name}")

    async def _expand(self, m: Member) -> None:
        assert self.pool is not None
        assert isinstance(m.adapter, LlamaCppAdapter) and m.adapter.router is not None
        if m.draining:
            return  # a reload took it out meanwhile
        try:
            added = await router_members(m.settings, m.spec, m.adapter.router, m.adapter.router_max)
        except Exception:  # our own bug, or the router went away meanwhile: say so
            log.exception("a router's models could not join", upstream=m.name)
            return
        self._owned.update(added)
        for a in added:
            await self._watch(a)
            self.pool.add(a)
        m.draining = True
        self._drains[m] = self._spawn(self._drain(m), f"llmproxy-drain-{m.name}")
        log.info("upstream is a llama-server router", upstream=m.name, models=len(added))

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

    async def wait_drained(self) -> None:
        """Return once every leaving upstream is closed (tests)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

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
        # draining ones included: a server listed again while it drains is the same server
        # (a router's models: each its own member, all of the same server)
        current = pool.members
        urls = {m.spec.url for m in current}
        wanted = {s.url: s for s in specs}
        leaving = [m for m in current if m.spec.url not in wanted and not m.draining]
        joining = [s for url, s in wanted.items() if url not in urls]
        back = [m for m in current if m.spec.url in wanted and m.draining and not m.router]
        changed = [(m, wanted[m.spec.url]) for m in current if m.spec.url in wanted]
        changed = [(m, s) for m, s in changed if m.spec != s]
        if not leaving and not joining and not changed and not back:
            log.info("reload: the upstreams are unchanged")
            return
        added = await self._detect(joining)
        for m in back:
            drain = self._drains.pop(m, None)
            if drain is not None:
                drain.cancel()
            m.draining = False  # its live slot state never left it
        for m, spec in changed:
            await self._update(m, spec)
        for m in added:
            await self._watch(m)
            pool.add(m)
        for m in leaving:
            m.draining = True  # no more grants; its requests in flight go on
            self._drains[m] = self._spawn(self._drain(m), f"llmproxy-drain-{m.name}")
        pool.advance()
        log.info(
            "reload: upstreams changed",
            joined=[m.name for m in added],
            back=[m.name for m in back],
            changed=[m.name for m, _ in changed],
            leaving=[m.name for m in leaving],
        )

    async def _update(self, m: Member, spec: UpstreamSpec) -> None:
        """``m``'s server stays; its entry changed (see ``Member.update``)."""
        assert self.pool is not None
        own = settings_for(self.settings, spec)
        old = m.spec
        if (spec.kind, spec.api_key) != (old.kind, old.api_key):
            if isinstance(m.adapter, RouterModelAdapter):
                a = m.adapter
                session, adapter = await model_client(
                    own, spec.url, a.model, a.status, a.models[1:], a.max_instances
                )
            else:
                session, adapter = await _client(own, spec.url)
            retired, m.session = m.session, session
            m.adapter.close()  # jobs running on it keep it; its connections close as they end
            m.adapter = adapter
            self._spawn(self._retire(m, retired), f"llmproxy-retire-{m.name}")
        for listener in self.pool.listeners:
            listener(m, False)  # its metrics go under its new name
        m.update(spec, own)
        for listener in self.pool.listeners:
            listener(m, True)
        wanted = gate_capacity(own, m.adapter, warn=False)
        if wanted < m.gate.total:
            log.warning(
                "reload: fewer permits take effect at the next start",
                upstream=m.name,
                permits=m.gate.total,
                asked=wanted,
            )
        fit_gate(m.gate, own, m.adapter)

    async def _retire(self, m: Member, session: aiohttp.ClientSession) -> None:
        """Close a client a reload replaced, once nothing holds the member's permits."""
        try:
            await m.gate.wait_quiescent()
        finally:  # at teardown too
            await session.close()

    async def _drain(self, m: Member) -> None:
        """Close ``m`` once every permit and every quarantined slot is back (cancelled if
        a reload lists its server again meanwhile)."""
        await m.gate.wait_quiescent()
        assert self.pool is not None
        self._drains.pop(m, None)
        self.pool.remove(m)
        await self._forget(m)
        log.info("upstream left the pool", upstream=m.name)

    def _spawn(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _forget(self, m: Member) -> None:
        self._owned.discard(m)
        stack = self._stacks.pop(m, None)
        if stack is not None:
            await stack.aclose()
        await m.close()

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._reload] if self._reload is not None else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
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
