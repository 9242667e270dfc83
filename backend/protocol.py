"""Messages between the backend's layers (web <-> dispatch thread <-> worker process).

All messages are small frozen dataclasses keyed by ``request_id`` and picklable (they
cross a ``multiprocessing`` queue). Errors travel on the result channel as ``Failed``
events, so no request ever waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation parameters (llama-server field names)."""

    n_predict: int = -1  # -1: until EOS / context end (capped by the server's max)
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # llama.vim: past this long, stop on the next token with a newline
    t_max_predict_ms: int | None = None
    n_indent: int = 0  # llama.vim: stop at (and cut) the first new line indented less than this
    ignore_eos: bool = False  # llama-server's ignore_eos: generate through end-of-generation tokens


@dataclass(frozen=True, slots=True)
class Prompt:
    """What to generate from; the worker turns it into tokens (only it has the tokenizer).

    kind="completion": ``text`` is the raw prompt (or ``tokens`` if given).
    kind="infill": ``prefix``/``suffix``/``extra`` (+ ``text`` = the llama.vim ``prompt``
    field, the part of the current line before the cursor) are assembled with the model's
    FIM tokens, or the documented prefix-only fallback when it has none.
    kind="chat": ``messages`` as ((role, content), ...), rendered with the chat template.
    """

    kind: Literal["completion", "infill", "chat"]
    text: str = ""
    tokens: tuple[int, ...] | None = None
    prefix: str = ""
    suffix: str = ""
    extra: tuple[tuple[str, str], ...] = ()  # (filename, text) chunks from input_extra
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Submit:
    """Start a generation on ``slot``."""

    request_id: str
    slot: int
    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a generation between tokens; answered by ``Done(stop_reason="cancelled")``."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Poison pill: finish nothing new, exit the worker loop."""


@dataclass(frozen=True, slots=True)
class Token:
    """One generated piece of text."""

    request_id: str
    text: str
    n_decoded: int


StopReason = Literal["eos", "limit", "word", "cancelled", "time"]


@dataclass(frozen=True, slots=True)
class Done:
    """The worker is finished with the request (its slot is idle from now on)."""

    request_id: str
    stop_reason: StopReason
    n_prompt_tokens: int
    n_predicted: int
    prompt_ms: float
    predicted_ms: float
    stopping_word: str = ""
    n_cached: int = 0  # prompt tokens reused from the slot's KV cache (not re-evaluated)
    n_evaluated: int = 0  # prompt tokens evaluated for it (fewer than asked when cut early)


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed; ``status`` is the HTTP status the web layer should answer."""

    request_id: str
    status: int
    message: str
    type: str = "server_error"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the loaded model offers (reported by /props)."""

    model_path: str
    model_alias: str
    n_ctx: int
    has_fim: bool
    n_slots: int
    extra: tuple[tuple[str, str], ...] = ()  # engine-specific facts for /props, e.g. device


@dataclass(frozen=True, slots=True)
class WorkerState:
    """Worker-level state change (not tied to a request): drives /health and /props."""

    # waking: reloading after sleep
    state: Literal["loading", "ready", "sleeping", "waking", "failed"]
    progress: float = 0.0  # model load progress 0..1 while loading
    info: EngineInfo | None = None  # set once loaded
    message: str = ""


Event = Token | Done | Failed | WorkerState
Inbound = Submit | Cancel | Shutdown
