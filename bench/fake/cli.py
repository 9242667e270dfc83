"""Command-line entry of the fake LLM upstream: ``python -m llmproxy.bench.fake.upstream``.

``FakeUpstreamSettings`` (env ``LLMPROXY_FAKE_*``) configures one ``FakeUpstream``
(upstream.py) that serves every generation with the same ``Script``. ``main`` runs it
until SIGINT/SIGTERM; the event loop owns the server, which ``FakeUpstream``'s context
manager stops (cancelling its linger tasks) on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import structlog
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.bench.child import announce, stop_event
from llmproxy.bench.fake.upstream import FakeUpstream, Kind, Script
from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


class FakeUpstreamSettings(LayeredSettings):
    """Options of ``python -m llmproxy.bench.fake.upstream`` (env ``LLMPROXY_FAKE_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_FAKE_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address to bind")
    port: int = Field(0, ge=0, le=65535, description="Port to bind; 0 picks a free port")
    port_file: Path | None = Field(
        None, description="Write the bound port to this file once listening"
    )
    kind: Kind = Field("llamacpp", description="Which backend to imitate")
    slots: int = Field(1, ge=1, description="Parallel generation slots")
    tokens: int = Field(
        8, ge=0, description="Tokens generated per request (capped by the request's n_predict)"
    )
    token_delay_ms: float = Field(5.0, ge=0, description="Delay per generated token")
    abort_linger_s: float = Field(
        0.2, ge=0, description="How long a slot stays busy after its client left"
    )
    prefill_s_per_char: float = Field(
        0.0, ge=0, description="Prompt-cache model: prefill seconds per uncached prompt char"
    )
    continues: bool = Field(
        False,
        description="A prompt (or chat prefill) ending with the fake's own tokens t0 .. t{k-1} "
        "goes on at tk, as a deterministic model continues its answer",
    )
    slots_endpoint: bool = Field(
        True, description="Serve GET /slots (off: 501, like llama-server --no-slots)"
    )
    metrics_endpoint: bool = Field(
        False, description="Serve GET /metrics (llama-server --metrics; off: 501)"
    )
    log_level: str = Field("warning", description="Log level")


async def _serve(settings: FakeUpstreamSettings) -> None:
    """Run until SIGINT/SIGTERM; the port file is written atomically once listening."""
    stop = stop_event()
    script = Script(tokens=settings.tokens, token_delay_s=settings.token_delay_ms / 1000)
    async with FakeUpstream(
        kind=settings.kind,
        slots=settings.slots,
        abort_linger_s=settings.abort_linger_s,
        slots_endpoint=settings.slots_endpoint,
        metrics_endpoint=settings.metrics_endpoint,
        prefill_s_per_char=settings.prefill_s_per_char,
        continues=settings.continues,
        script=lambda _p, _b: script,
        host=settings.host,
        port=settings.port,
    ) as upstream:
        announce(settings.port_file, int(upstream.url.rsplit(":", 1)[1]))
        structlog.get_logger().info("fake_upstream_listening", url=upstream.url, kind=settings.kind)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmproxy.bench.fake.upstream",
        description="Fake LLM backend for benchmarks.",
    )
    add_settings_arguments(parser, FakeUpstreamSettings)
    settings = settings_from_args(FakeUpstreamSettings, parser.parse_args(argv))
    configure_logging(settings.log_level)
    asyncio.run(_serve(settings))
    return 0
