"""The app's typed keys and the per-app state object (built in app.py's cleanup_ctx)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from llmproxy.proxy.adapters.base import Adapter
from llmproxy.proxy.breaker import CircuitBreaker
from llmproxy.proxy.gate import Gate
from llmproxy.proxy.registry import JobRegistry
from llmproxy.proxy.metrics import Metrics
from llmproxy.proxy.record import RequestRecord
from llmproxy.proxy.request_log import RequestLog
from llmproxy.proxy.settings import ProxySettings


@dataclass(eq=False)
class ProxyState:
    settings: ProxySettings
    session: aiohttp.ClientSession
    adapter: Adapter
    gate: Gate
    jobs: JobRegistry
    metrics: Metrics
    breaker: CircuitBreaker

    def policy(self, configured: str, path: str | None = None) -> str:
        """Resolve 'auto': cancel where the adapter can confirm the stop (on ``path``), else finish."""
        if configured == "auto":
            return "cancel" if (self.adapter.confirms(path) if path else self.adapter.can_confirm) else "finish"
        return configured


SETTINGS = web.AppKey("settings", ProxySettings)
METRICS = web.AppKey("metrics", Metrics)
UPSTREAM_URL = web.AppKey("upstream_url", str)
STATE = web.AppKey("state", ProxyState)
REQUEST_LOG = web.AppKey("request_log", RequestLog)
RECORD = web.RequestKey("record", RequestRecord)  # request-scoped

__all__ = ["ProxyState", "SETTINGS", "METRICS", "UPSTREAM_URL", "STATE", "REQUEST_LOG", "RECORD", "RequestRecord"]
