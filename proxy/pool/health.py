"""Background health probes of the upstreams.

Every ``health_interval_s`` each upstream that runs none of the proxy's requests is
probed: llama-server is asked ``/health`` and Ollama ``/api/version`` (a 200: up), an
OpenAI-compatible server only to accept a connection, with no request (llama-cpp-python's
server interrupts the generation it runs, its other clients' too, when any request
arrives, and others may answer ``/v1/models`` only between generations). Up puts it in
rotation; anything else (an error status, a timeout, no connection) takes it out until a
probe succeeds again. One that runs requests is judged by them (their failures open its
breaker), never probed meanwhile: a busy server answers slowly, and a timeout would take a
working upstream out. A llama-server router's ``/v1/models`` is read at every round, busy
or not (the router answers it, not a model's child): its models' members follow what it
says of each (``router_round``). Each round ends with the pool's ``advance``, so queued
requests go to an upstream that came back, or fail fast when none is left, and a breaker's
cooldown that ended lets its probe request through.

Concurrency contract: one task (``probing``'s), owned by the pool's lifecycle, which
cancels it at teardown; a probe round runs the upstreams' probes concurrently, each bounded
by the adapter's probe timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import structlog
from yarl import URL

from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Pool
from llmproxy.proxy.upstream.adapters.base import PROBE_TIMEOUT, get_json
from llmproxy.proxy.upstream.adapters.listing import router_models
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter
from llmproxy.proxy.upstream.watch import fit_gate

log = structlog.get_logger("llmproxy.pool")

PATHS = {"llamacpp": "/health", "ollama": "/api/version"}


async def probe(member: Member) -> bool:
    if member.adapter.kind == "openai":
        return await _accepts(member.adapter.base_url)
    path = PATHS[member.adapter.kind]
    try:
        status, _ = await get_json(member.session, member.adapter.base_url.with_path(path))
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
    return status == 200


async def _accepts(url: URL) -> bool:
    """Does the server accept a connection? (No request: see the module's docstring.)"""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        async with asyncio.timeout(PROBE_TIMEOUT.total or 2.0):
            _reader, writer = await asyncio.open_connection(url.host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def router_round(members: list[Member]) -> None:
    """Read each router's ``/v1/models`` once and tell its models' members what it says
    (upstream/adapters/router.py): a model unloaded since loses its prompt caches; one
    loaded whose slot count is still unknown has its ``/props`` read now, and its gate grows."""
    routers: dict[str, list[tuple[Member, RouterModelAdapter]]] = {}
    for m in members:
        if isinstance(m.adapter, RouterModelAdapter):
            routers.setdefault(str(m.adapter.base_url), []).append((m, m.adapter))
    for ms in routers.values():
        listed = await router_models(ms[0][0].session, ms[0][1].base_url)
        if listed is None:
            continue
        states = {model.name: model.status for model in listed}
        for m, adapter in ms:
            if adapter.noted(states.get(adapter.model, "unloaded")):
                log.info("router unloaded a model: its prompt caches are gone", upstream=m.name)
                m.model_unloaded()
            if adapter.pending():  # loaded, its slot count or /slots still to learn
                await adapter.refresh()
                fit_gate(m.gate, m.settings, adapter)


async def probe_round(pool: Pool) -> None:
    """Probe every upstream that runs nothing of ours once, then let the queue move."""
    await router_round(pool.members)
    members = [m for m in pool.members if not m.gate.inflight]
    results = await asyncio.gather(*(probe(m) for m in members))
    for member, ok in zip(members, results, strict=True):
        if ok != member.healthy:
            member.healthy = ok
            if ok:
                log.info("upstream back in rotation", upstream=member.name)
            else:
                log.warning("upstream out of rotation: health probe failed", upstream=member.name)
    pool.advance()


async def _probe_forever(pool: Pool, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await probe_round(pool)
        except Exception:  # our own bug: say so, keep probing
            log.exception("health probe round failed")


@contextlib.asynccontextmanager
async def probing(pool: Pool, interval_s: float) -> AsyncIterator[None]:
    """Probe ``pool``'s upstreams every ``interval_s`` while the block runs."""
    task = asyncio.create_task(_probe_forever(pool, interval_s), name="llmproxy-health")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])
