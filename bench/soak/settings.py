"""Options of ``llmproxy bench soak`` and the proxy child they start."""

from __future__ import annotations

import sys

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings


class SoakSettings(LayeredSettings):
    """Options of ``llmproxy bench soak`` (env ``LLMPROXY_SOAK_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_SOAK_", frozen=True, extra="forbid")

    minutes: float = Field(10.0, gt=0, description="How long to drive the editors")
    upstream: str | None = Field(
        None, description="Backend URL for the proxy; unset = embedded backend"
    )
    capacity: int = Field(1, ge=1, description="Permits N (and embedded backend slots)")
    editors: int = Field(4, ge=1, description="Simulated editors (one session each)")
    n_predict: int = Field(16, ge=1, description="Tokens asked per completion")
    poll_ms: float = Field(20.0, gt=0, description="GET /slots poll interval")
    seed: int = Field(1, description="Random seed for the editors' actions")
    start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the proxy (and its backend) to start"
    )
    log_level: str = Field("warning", description="Log level (also the proxy child's)")


def proxy_argv(settings: SoakSettings) -> list[str]:
    """``llmproxy serve`` for the soak (``--port-file`` is appended by ``child``)."""
    argv = [
        sys.executable,
        "-m",
        "llmproxy.proxy",
        "serve",
        "--port",
        "0",
        "--capacity",
        str(settings.capacity),
        "--log-level",
        settings.log_level,
        "--log-json",
    ]
    return argv + (
        ["--upstream", settings.upstream]
        if settings.upstream
        else ["--parallel", str(settings.capacity)]
    )
