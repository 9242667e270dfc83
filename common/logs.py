"""structlog configuration shared by the proxy and the backend.

``merge_contextvars`` runs first so request ids and sessions bound with
``structlog.contextvars.bind_contextvars`` appear on every line. JSON lines when stderr
is not a TTY (systemd journal, CI), the console renderer on a TTY. Records of stdlib
loggers (aiohttp's, asyncio's: warnings and above) go through the same processors and
renderer, so the stream stays one format. Secrets are never passed to the logger;
``redact`` is a last line of defence for header-like keys.
"""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

from llmproxy.common.redact import redact_urls

_SECRET_KEYS = frozenset({"authorization", "api_key", "api-key", "x-api-key", "token", "hf_token"})
_TIMESTAMPER = structlog.processors.TimeStamper(fmt="iso", utc=True)


def stamp(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """Add the ISO UTC ``timestamp`` (structlog processor), keeping one the event already has.

    A line written later than it happened (proxy/telemetry/request_log.py) is stamped when
    it happened.
    """
    if "timestamp" in event:
        return event
    return _TIMESTAMPER(logger, method, event)


def iso_utc(epoch: float | None) -> str:
    """``epoch`` (``time.time()``; None: now) as ``stamp`` writes it: ISO 8601, UTC, ``Z``."""
    when = (
        datetime.datetime.now(datetime.UTC)
        if epoch is None
        else (datetime.datetime.fromtimestamp(epoch, datetime.UTC))
    )
    return when.isoformat().replace("+00:00", "Z")


def redact(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """Replace the values of secret-looking keys, and mask the credentials of URLs in string
    values (structlog processor)."""
    for key, value in event.items():
        if key.lower() in _SECRET_KEYS:
            event[key] = "[redacted]"
        elif isinstance(value, str) and "@" in value:
            event[key] = redact_urls(value)
    return event


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog (and stdlib logging, for aiohttp's own loggers) once per process."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        lvl = logging.INFO
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        stamp,
        redact,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json  # plain tracebacks on a TTY: rich's would print every frame's locals
        else structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
    )
    tail: list[Any] = [structlog.processors.format_exc_info, renderer] if use_json else [renderer]
    structlog.configure(
        processors=[*shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (print() makes two): lines of processes sharing stderr never interleave
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # aiohttp and asyncio log through stdlib: warnings and above, rendered like our own lines.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
        )
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), handlers=[handler])
