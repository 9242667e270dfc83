"""The scheduler (pool/pool.py) without HTTP: a pool of real gates and members, and requests
submitted to it as the handlers do (pooled.py), for unit tests of admission and grants."""

from __future__ import annotations

from typing import Any

import aiohttp

from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Pool, Sizing
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstreams import UpstreamSpec

_PROMPT = object()  # ``submit``'s default body: ``{"prompt": prompt}``


def make_pool(
    session: aiohttp.ClientSession, slots: list[int], **overrides: Any
) -> tuple[Pool, list[Member]]:
    """A pool of ``len(slots)`` upstreams (u0, u1, ...) with those slot counts, each with its
    own real gate; ``session`` is never used to connect. ``overrides``: ProxySettings."""
    settings = ProxySettings(**{"route": "cache", "affinity_wait_s": 0.05, **overrides})
    members = []
    for i, n in enumerate(slots):
        spec = UpstreamSpec(url=f"http://127.0.0.1:{9000 + i}", name=f"u{i}")
        adapter = Adapter(spec.url, session, settings)
        gate = Gate(n, affinity_wait_s=settings.affinity_wait_s)
        members.append(Member(spec, settings, session, adapter, gate))
    return Pool(members, settings), members


def sized(permits: int) -> Sizing:
    """A request on ``permits`` slots at once; BadRequest on an upstream with fewer."""

    def sizing(_m: Member, capacity: int) -> int:
        if permits > capacity:
            raise BadRequest(f"{permits} > {capacity}")
        return permits

    return sizing


def submit(
    pool: Pool,
    session: str,
    prompt: str = "",
    *,
    supersedable: bool = True,
    permits: int = 1,
    route: str = "/completion",
    first: bool = False,
    parsed: Any = _PROMPT,
    sizing: Sizing | None = None,
    exclude: Member | None = None,
    klass: str = "complete",
    caller: str = "",
) -> Entry:
    """Submit a request of ``session`` whose body is ``{"prompt": prompt}`` (or ``parsed``):
    two supersedable requests of a session with equal bodies are twins (proxy/twins.py), so
    a newer keystroke needs another prompt. ``sizing`` (default: ``permits``) is asked for
    its permits on each upstream."""
    return pool.submit(
        session,
        supersedable=supersedable,
        route=route,
        parsed={"prompt": prompt} if parsed is _PROMPT else parsed,
        sizing=sized(permits) if sizing is None else sizing,
        exclude=exclude,
        first=first,
        klass=klass,
        caller=caller,
    )


async def granted_slot(pool: Pool, entry: Entry, timeout_s: float = 1.0) -> int:
    """Wait for ``entry``'s grant as its handler does (``Pool.acquire``); its (first) slot."""
    slot = (await pool.acquire(entry, timeout_s)).ticket.slot
    assert slot is not None
    return slot
