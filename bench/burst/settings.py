"""Options of ``llmproxy bench burst`` (env ``LLMPROXY_BURST_*``).

``bench backends`` builds them directly, so every default is given as ``default=``: a type
checker reads that as a default, not as a required argument.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings

ProfileName = Literal["llm-ls", "continue", "llama-vim", "twinny", "minuet"]


class BurstSettings(LayeredSettings):
    """Options of ``llmproxy bench burst`` (env ``LLMPROXY_BURST_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_BURST_", frozen=True, extra="forbid")

    profile: ProfileName = Field(default="llm-ls", description="Client to emulate")
    keystrokes: int = Field(default=20, ge=1, description="Keystrokes per burst")
    interval_ms: float = Field(default=50.0, ge=0, description="Time between keystrokes")
    debounce_ms: float | None = Field(
        default=None,
        ge=0,
        description="Client-side debounce (a request goes out only after this quiet time); "
        "unset: the client's own (minuet 400, others 0)",
    )
    throttle_ms: float | None = Field(
        default=None,
        ge=0,
        description="minuet: after a request goes out, keystrokes are ignored this long; "
        "unset: its own (1000)",
    )
    twins: int | None = Field(
        default=None,
        ge=1,
        description="minuet: identical requests per trigger (its n_completions); "
        "unset: its own (3)",
    )
    bursts: int = Field(default=5, ge=1, description="Bursts per editor")
    editors: int = Field(
        default=1,
        ge=1,
        description="Editors typing at once (each sends its own X-LLMProxy-Session when > 1)",
    )
    n_predict: int = Field(default=32, ge=1, description="Tokens asked for per completion")
    model: str = Field(
        default="",
        description="Model name for the request body (OpenAI/Ollama shapes); "
        "empty = ask /v1/models",
    )
    baseline_runs: int = Field(
        default=3, ge=1, description="Uncontended generations measured first (median = baseline)"
    )
    gap_ms: float = Field(
        default=200.0, ge=0, description="Pause between bursts once the backend is idle"
    )
    slots_poll_ms: float = Field(default=20.0, gt=0, description="GET /slots poll interval")
    poll_slots: bool = Field(
        default=True,
        description="Count the backend's generations from GET /slots; "
        "off where polling disturbs it (llama-server checks for a dropped non-streaming "
        "client only when no result came for a second, and every /slots answer is a result)",
    )
    idle_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest wait for the backend to become idle"
    )
    request_timeout_s: float = Field(default=300.0, gt=0, description="Read timeout per request")
    extra_body: str = Field(
        default="",
        description="JSON object whose fields are set in every request body, "
        'e.g. \'{"stream": false, "ignore_eos": true}\'',
    )
    compare: list[str] = Field(
        default=[],
        description="More target URLs (comma-separated): run the same script against each",
    )
    typist: Literal["burst", "follow"] = Field(
        default="burst",
        description="burst: type TYPED keystrokes; follow: ask for a suggestion, then type it "
        "(type-through: compare a proxy with it on, one with it off, and the backend)",
    )
    plot: Path | None = Field(
        default=None, description="Write a latency-over-time PNG here (needs matplotlib)"
    )
    json_out: Path | None = Field(default=None, description="Write the results as JSON here")
    log_level: str = Field(default="warning", description="Log level")

    @field_validator("extra_body")
    @classmethod
    def _json_object(cls, text: str) -> str:
        if text:
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object")
        return text
