"""Pick and initialise the upstream adapter: configured kind, or detected.

Detection: ``GET /props`` answering JSON -> llamacpp (slot count from ``total_slots``; a
llama-server in router mode, ``"role": "router"``, has none of its own: its models and their
state are read into ``router``, and the pool runs one member per model: router.py);
``GET /api/version`` answering -> ollama; otherwise openai. Detection retries until
``detect_timeout_s`` while the upstream is unreachable, and while ``/props`` answers 503
(llama-server answers every API route so while it loads its model) or 502/504 (a gateway
whose server is not up). At the deadline, one still loading in llama-server's way is taken
as llamacpp; any other that is not there yet is served as openai (or the configured kind)
and, with ``upstream_kind`` auto, marked ``undetected``: ``watch.watch_upstream`` detects it
again (``redetect``) until it answers, and swaps in the adapter found (a llama-server
started after the proxy, or by a later systemd unit, still gets its slots, ``id_slot`` and
stop confirmation). The gate has one permit until then (``watch.gate_capacity``). A
llamacpp adapter whose slot count is not known then (or whose ``/slots`` failed for a
reason that may pass) is completed later by ``watch.watch_upstream``. Once the kind is
known, ``GET /v1/models`` gives the model ids the upstream reports (``Adapter.models``;
none when it does not answer; a llama-server still loading: once the watcher reads its
``/props``; the pool's rules for them are in pool/models.py). A 401/403 on
``/props`` is logged with a hint at ``upstream_api_key``: the proxy's own probes need the
key a keyed llama-server wants.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from llmproxy.common.redact import strip_userinfo
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter, get_json, log
from llmproxy.proxy.upstream.adapters.listing import is_router, router_models
from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.upstream.adapters.ollama import OllamaAdapter
from llmproxy.proxy.upstream.adapters.openai import OpenAIAdapter

KINDS: dict[str, type[Adapter]] = {
    "llamacpp": LlamaCppAdapter,
    "openai": OpenAIAdapter,
    "ollama": OllamaAdapter,
}


class _Loading(Exception):
    """``/props`` answered 503 (llama-server loading its model), or 502/504 (a gateway in
    front of a server that is not up yet): the upstream is not ready."""

    def __init__(self, llama_shaped: bool, status: int = 503) -> None:
        super().__init__(f"upstream answers {status} on /props")
        # llama-server's own {"error": {"type": "unavailable_error"}}
        self.llama_shaped = llama_shaped


def _llama_unavailable(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("type") == "unavailable_error"


async def _probe(
    session: aiohttp.ClientSession, base: str, settings: ProxySettings
) -> tuple[str, Any]:
    """The kind, and for llamacpp its /props answer."""
    status, props = await get_json(session, base + "/props")
    if status in (502, 503, 504):
        raise _Loading(status == 503 and _llama_unavailable(props), status)
    if status in (401, 403):
        hint = (
            "set upstream_api_key"
            if settings.upstream_api_key is None
            else "check upstream_api_key"
        )
        log.warning(
            "upstream refused /props: cannot detect a llama-server that wants an API key",
            status=status,
            hint=hint,
        )
    if (
        status == 200
        and isinstance(props, dict)
        and ("total_slots" in props or "default_generation_settings" in props)
    ):
        return "llamacpp", props
    status, version = await get_json(session, base + "/api/version")
    if status == 200 and isinstance(version, dict) and "version" in version:
        return "ollama", None
    return "openai", None


async def create_adapter(
    session: aiohttp.ClientSession, settings: ProxySettings, base_url: str
) -> Adapter:
    base = strip_userinfo(base_url).rstrip("/")  # credentials: the session's header
    kind: str | None = None if settings.upstream_kind == "auto" else settings.upstream_kind
    props: Any = None
    gave_up = False  # the deadline passed (unreachable, or still loading): no slot count yet
    undetected = False  # kind auto, and the upstream never answered: detected again later
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.detect_timeout_s
    while True:
        try:
            detected, props = await _probe(session, base, settings)
            kind = kind or detected
            break
        except _Loading as exc:
            if loop.time() >= deadline:
                log.warning(
                    f"upstream still not ready ({exc}) at the end of detection: slot count and "
                    "/slots learnt once it is",
                    upstream=base,
                    detect_timeout_s=settings.detect_timeout_s,
                )
                undetected = kind is None and not exc.llama_shaped
                kind = kind or ("llamacpp" if exc.llama_shaped else "openai")
                gave_up = True
                break
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if loop.time() >= deadline:
                undetected = kind is None
                log.warning(
                    "upstream unreachable during detection"
                    + ("; detected again once it answers" if undetected else ""),
                    upstream=base,
                    error=str(exc),
                )
                kind = kind or "openai"
                gave_up = True
                break
        await asyncio.sleep(0.2)
    adapter = await _build(session, settings, base, kind, props, props_pending=gave_up)
    adapter.undetected = undetected
    if not adapter.pending():
        adapter.known.set()
    log.info("upstream adapter ready", **adapter.describe())
    return adapter


async def redetect(
    session: aiohttp.ClientSession, settings: ProxySettings, base_url: str
) -> Adapter | None:
    """One more detection attempt for an upstream that never answered at start: the adapter
    it turns out to need, or None while it still does not answer (or answers 503 in a
    shape that is not llama-server's)."""
    base = strip_userinfo(base_url).rstrip("/")  # credentials: the session's header
    try:
        kind, props = await _probe(session, base, settings)
        loading = False
    except _Loading as exc:
        if not exc.llama_shaped:
            return None
        kind, props, loading = "llamacpp", None, True
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return await _build(session, settings, base, kind, props, props_pending=loading)


async def _build(
    session: aiohttp.ClientSession,
    settings: ProxySettings,
    base: str,
    kind: str,
    props: Any,
    *,
    props_pending: bool,
) -> Adapter:
    adapter = KINDS[kind](base, session, settings)
    if isinstance(adapter, LlamaCppAdapter) and not props_pending and is_router(props):
        adapter.router = await router_models(session, adapter.base_url) or []
        most = props.get("max_instances")
        adapter.router_max = most if type(most) is int and most > 0 else None
        adapter.models = tuple(m.name for m in adapter.router)
        return adapter  # a pool of its models (pool/lifecycle.py), each probed on its own
    if isinstance(adapter, LlamaCppAdapter):
        if not props_pending:
            adapter.learn_props(props)
        adapter.props_pending = props_pending  # learnt later by watch.watch_upstream
        await adapter.probe_slots()
    if not props_pending:
        await adapter.learn_models()
    return adapter
