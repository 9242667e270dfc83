"""A llama-server router's own answers: its ``/props`` (``"role": "router"``) and its models
with their state, from ``/v1/models`` (router.py runs each model as a member)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from llmproxy.proxy.upstream.adapters.base import get_json

#: what the router's ``/v1/models`` says of a model's child server
STATUSES = ("unloaded", "loading", "loaded")


def is_router(props: Any) -> bool:
    """Does a ``/props`` answer come from llama-server in router mode?"""
    return isinstance(props, dict) and props.get("role") == "router"


@dataclass(frozen=True, slots=True)
class RouterModel:
    name: str
    status: str  # one of STATUSES ("unloaded" for one the router did not say)
    aliases: tuple[str, ...] = ()  # other names the router takes for it (its preset's)


async def router_models(session: aiohttp.ClientSession, base: URL) -> list[RouterModel] | None:
    """The router's models and their state, from ``GET /v1/models``; None when it does not
    answer that way."""
    try:
        status, body = await get_json(session, base / "v1" / "models")
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    data = body.get("data") if status == 200 and isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    found: dict[str, RouterModel] = {}
    for d in data:
        name = d.get("id") if isinstance(d, dict) else None
        if not isinstance(name, str) or not name or name in found:
            continue
        state = d.get("status")
        value = state.get("value") if isinstance(state, dict) else None
        listed = d.get("aliases")
        aliases = (
            tuple(a for a in listed if isinstance(a, str) and a and a != name)
            if isinstance(listed, list)
            else ()
        )
        found[name] = RouterModel(name, value if value in STATUSES else "unloaded", aliases)
    return list(found.values())
