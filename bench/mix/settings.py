"""Options of ``llmproxy bench mix`` (env ``LLMPROXY_MIX_*``).

Every default is given as ``default=``, so the tests can build them directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings

Target = Literal["direct", "fifo", "classes"]
TARGETS: tuple[Target, ...] = ("direct", "fifo", "classes")


class MixSettings(LayeredSettings):
    """Options of ``llmproxy bench mix`` (env ``LLMPROXY_MIX_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_MIX_", frozen=True, extra="forbid")

    editors: int = Field(default=2, ge=1, description="Editors typing bursts at once")
    agents: int = Field(default=3, ge=0, description="Agents sending chat streams back to back")
    keystrokes: int = Field(default=20, ge=1, description="Keystrokes per burst")
    interval_ms: float = Field(default=50.0, ge=0, description="Time between keystrokes")
    bursts: int = Field(default=3, ge=1, description="Bursts per editor and target")
    pause_ms: float = Field(default=300.0, ge=0, description="Pause between an editor's bursts")
    n_predict: int = Field(default=16, ge=1, description="Tokens per completion")
    agent_tokens: int = Field(default=400, ge=1, description="Tokens per chat answer")
    profile: Literal["continue", "llama-vim", "llm-ls", "twinny"] = Field(
        default="continue", description="The editors' client (bench burst's profiles)"
    )
    targets: list[Target] = Field(
        default=list(TARGETS),
        description="direct (the fake), fifo (the proxy, --classes off), classes (the proxy's "
        "defaults: classes and a reserve)",
    )
    slots: int = Field(default=4, ge=1, description="The fake llama-server's slots (-np)")
    token_delay_ms: float = Field(default=5.0, ge=0, description="The fake's delay per token")
    start_timeout_s: float = Field(default=60.0, gt=0, description="Longest wait for a proxy")
    request_timeout_s: float = Field(default=120.0, gt=0, description="Read timeout per request")
    json_out: Path | None = Field(default=None, description="Write the results as JSON here")
    log_level: str = Field(default="warning", description="Log level")
