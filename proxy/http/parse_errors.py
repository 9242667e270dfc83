"""The proxy's envelope for requests aiohttp's HTTP parser rejects before any middleware:
``common/parse_errors.py`` (shared with the backend) with the proxy's error body and its
``llmproxy.http`` logger."""

from __future__ import annotations

import structlog
from aiohttp import web

from llmproxy.common import parse_errors
from llmproxy.proxy.errors import HTTPStatusError

log = structlog.get_logger("llmproxy.http")


def _envelope(status: int, message: str) -> bytes:
    return HTTPStatusError(status, message).body()


def install(runner: web.BaseRunner) -> None:
    """Call after ``runner.setup()``, before starting any site."""
    parse_errors.install(runner, _envelope, log)
