"""Pick and initialise the upstream adapter: configured kind, or detected.

Detection: ``GET /props`` answering JSON -> llamacpp (slot count from ``total_slots``);
``GET /api/version`` answering -> ollama; otherwise openai. While the upstream is
unreachable, detection retries until ``detect_timeout_s`` and then assumes openai (or the
configured kind) with the configured capacity.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from llmproxy.proxy.adapters.base import Adapter, log
from llmproxy.proxy.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.adapters.ollama import OllamaAdapter
from llmproxy.proxy.adapters.openai import OpenAIAdapter
from llmproxy.proxy.settings import ProxySettings

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
KINDS: dict[str, type[Adapter]] = {"llamacpp": LlamaCppAdapter, "openai": OpenAIAdapter, "ollama": OllamaAdapter}


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=PROBE_TIMEOUT, allow_redirects=False) as resp:
        if resp.status != 200:
            return None
        try:
            return await resp.json(content_type=None)
        except ValueError:
            return None


async def _probe(session: aiohttp.ClientSession, base: str) -> tuple[str, int | None]:
    props = await _get_json(session, base + "/props")
    if isinstance(props, dict) and ("total_slots" in props or "default_generation_settings" in props):
        slots = props.get("total_slots")
        return "llamacpp", slots if isinstance(slots, int) and slots > 0 else None
    version = await _get_json(session, base + "/api/version")
    if isinstance(version, dict) and "version" in version:
        return "ollama", None
    return "openai", None


async def create_adapter(session: aiohttp.ClientSession, settings: ProxySettings, base_url: str) -> Adapter:
    base = base_url.rstrip("/")
    kind: str | None = None if settings.upstream_kind == "auto" else settings.upstream_kind
    slots: int | None = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.detect_timeout_s
    while True:
        try:
            detected, slots = await _probe(session, base)
            kind = kind or detected
            break
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if loop.time() >= deadline:
                log.warning("upstream unreachable during detection", upstream=base, error=str(exc))
                kind = kind or "openai"
                break
            await asyncio.sleep(0.2)
    adapter = KINDS[kind](base, session, settings, slots=slots)
    if isinstance(adapter, LlamaCppAdapter):
        await adapter.probe_slots()
    log.info("upstream adapter ready", **adapter.describe())
    return adapter
