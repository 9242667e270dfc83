"""The app's typed keys and the per-app state object (built in app.py's cleanup_ctx);
the keys of what the process gives the app are app_keys.py's, re-exported here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from llmproxy.common.server import StopRequest
from llmproxy.proxy.app_keys import SETTINGS, STOP, UPSTREAM_URL
from llmproxy.proxy.gating.registry import JobRegistry
from llmproxy.proxy.pool.pool import Pool
from llmproxy.proxy.request import Body
from llmproxy.proxy.reuse.registry import Generations
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.telemetry.metrics import Metrics
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.telemetry.request_log import RequestLog
from llmproxy.proxy.upstream.adapters.base import Adapter


@dataclass(eq=False)
class ProxyState:
    """What the app's requests share: settings, the scheduler over the upstreams (a pool of
    one with one upstream), the jobs, metrics and type-through's registry."""

    settings: ProxySettings
    pool: Pool
    jobs: JobRegistry
    metrics: Metrics
    generations: Generations | None = None  # type-through; None when off
    #: key name -> the request classes it may use (``[[keys]]`` ``classes``)
    key_classes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def passthrough_adapter(self) -> Adapter:
        """The adapter an ungated request goes to: the first upstream in rotation."""
        members = self.pool.rotation() or self.pool.members
        return members[0].adapter

    def gated_routes(self) -> frozenset[str]:
        """Routes gated on some upstream (several: on any of them)."""
        return frozenset().union(*(m.adapter.dialect.gated_routes for m in self.pool.members))

    @staticmethod
    def policy(
        configured: str, adapter: Adapter, path: str | None = None, parsed: Body | None = None
    ) -> str:
        """Resolve 'auto': cancel where ``adapter`` can confirm the stop (on ``path``), or
        where closing a stream stops its generation at the next token
        (``Dialect.stops_streams``, a request asking for a stream or sent as one,
        ``Dialect.assembles``); else finish."""
        if configured == "auto":
            dialect = adapter.dialect
            confirms = adapter.confirms(path) if path else adapter.can_confirm
            stream = parsed is not None and (
                parsed.get("stream") is True
                or (path is not None and dialect.assembles(path, parsed))
            )
            return "cancel" if confirms or (stream and dialect.stops_streams) else "finish"
        return configured


METRICS = web.AppKey("metrics", Metrics)
STATE = web.AppKey("state", ProxyState)
REQUEST_LOG = web.AppKey("request_log", RequestLog)
#: applies re-read settings (SIGHUP): the set of upstreams; set by the app's upstream context
Reload = Callable[[ProxySettings], None]
RELOAD: web.AppKey[Reload] = web.AppKey("reload")
RECORD = web.RequestKey("record", RequestRecord)  # request-scoped

__all__ = [
    "ProxyState",
    "StopRequest",
    "STOP",
    "SETTINGS",
    "METRICS",
    "UPSTREAM_URL",
    "STATE",
    "REQUEST_LOG",
    "RELOAD",
    "RECORD",
    "RequestRecord",
]
