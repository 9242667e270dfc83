"""Building a pool of upstreams at start and taking it down at exit (the app's upstream
cleanup context runs it when more than one upstream is configured).

Each upstream is detected concurrently, exactly as the one upstream is (detect.py, with its
own settings and ClientSession), gets its gate sized the same way (watch.gate_capacity), and
is watched for what detection could not learn yet (watch.py). Teardown, after the pool was
closed and its requests drained by the app: health probes and watchers cancelled, each
upstream's adapter and session closed.
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
    )
    return Member(spec, own, session, adapter, gate)


@contextlib.asynccontextmanager
async def running_pool(settings: ProxySettings, specs: list[UpstreamSpec]) -> AsyncIterator[Pool]:
    results = await asyncio.gather(*(_member(settings, s) for s in specs), return_exceptions=True)
    members = [r for r in results if isinstance(r, Member)]
    try:
        for r in results:
            if isinstance(r, BaseException):
                raise r
        pool = Pool(members, settings)
        for m in members:
            log.info("pool upstream", upstream=m.name, healthy=m.healthy, **m.adapter.describe())
        async with contextlib.AsyncExitStack() as stack:
            for m in members:
                await stack.enter_async_context(watching(m))
            await stack.enter_async_context(probing(pool, settings.health_interval_s))
            yield pool
    finally:
        for m in members:
            await m.close()
