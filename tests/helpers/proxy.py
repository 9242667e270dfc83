"""An in-process proxy (the real app) on a real loopback socket, for tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmproxy.proxy.app import build_app
from llmproxy.proxy.http import parse_errors
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import REQUEST_LOG, STATE, ProxyState


@dataclass
class RunningProxy:
    url: str
    app: web.Application

    @property
    def state(self) -> ProxyState:
        return self.app[STATE]

    @property
    def member(self) -> Member:
        """The first upstream (the only one, when the proxy fronts one)."""
        return self.state.pool.members[0]

    def policy(self, configured: str, path: str | None = None) -> str:
        """``configured`` as resolved for the first upstream's adapter now."""
        return self.state.policy(configured, self.member.adapter, path)

    def flush_log(self) -> None:
        """Write the canonical lines of the requests that ended (request_log.py batches them)."""
        self.app[REQUEST_LOG].flush()


@asynccontextmanager
async def run_proxy(upstream: str | None, **overrides: Any) -> AsyncIterator[RunningProxy]:
    settings = ProxySettings(
        **{"upstream": upstream, "port": 0, "detect_timeout_s": 0, **overrides}
    )
    app = build_app(settings)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=2,
        keepalive_timeout=settings.idle_timeout_s,
    )
    await runner.setup()
    parse_errors.install(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", app)
    finally:
        await runner.cleanup()


def request_events(logs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The canonical request lines of captured logs, by request id."""
    return {e["request_id"]: e for e in logs if e.get("event") == "request"}
