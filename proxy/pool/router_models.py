"""A llama-server router's models as members of the pool (upstream/adapters/router.py):
one each, with its own client, adapter and gate. Built at detection, at a reload, and when
re-detection finds a router where nothing answered at start (pool/lifecycle.py)."""

from __future__ import annotations

import aiohttp
import structlog

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.adapters.listing import RouterModel
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter
from llmproxy.proxy.upstream.session import open_session
from llmproxy.proxy.upstream.watch import gate_capacity
from llmproxy.proxy.upstreams import UpstreamSpec

log = structlog.get_logger("llmproxy.pool")


async def router_members(
    own: ProxySettings, spec: UpstreamSpec, models: list[RouterModel], most: int | None
) -> list[Member]:
    """A router's models, each a member of its own (upstream/adapters/router.py); the
    entry's ``models``, when stated, say which of them the pool serves; ``most``: how many
    the router runs at once (its ``max_instances``)."""
    wanted = [m for m in models if spec.models is None or m.name in spec.models]
    if not wanted:
        log.warning("router lists none of the models asked for", upstream=spec.label)
    missing = [c for c in ("complete", "chat") if c not in own.default_model]
    if wanted and missing:
        log.warning(
            "a router serves only requests that name a model: those that name none go to "
            "its first model; set default_model",
            upstream=spec.label,
            first=wanted[0].name,
            classes=missing,
        )
    members: list[Member] = []
    try:
        for model in wanted:
            session, adapter = await model_client(
                own, spec.url, model.name, model.status, model.aliases, most
            )
            gate = Gate(gate_capacity(own, adapter), affinity_wait_s=own.affinity_wait_s)
            members.append(Member(spec, own, session, adapter, gate, model=model.name))
    except BaseException:
        for m in members:
            await m.close()
        raise
    return members


async def model_client(
    own: ProxySettings,
    url: str,
    model: str,
    status: str,
    aliases: tuple[str, ...] = (),
    most: int | None = None,
) -> tuple[aiohttp.ClientSession, Adapter]:
    session = open_session(own)
    try:
        adapter = RouterModelAdapter(
            url, session, own, model=model, status=status, aliases=aliases, max_instances=most
        )
        await adapter.learn()
        if not adapter.pending():
            adapter.known.set()
        return session, adapter
    except BaseException:
        await session.close()
        raise
