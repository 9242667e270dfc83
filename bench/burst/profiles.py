"""Wire profiles of real editor clients for ``llmproxy bench burst``, read from their source.

A profile says which route a client calls, the JSON body it sends (byte shape included:
llama.vim sends compact JSON), its User-Agent, whether it streams, and how it abandons
a request when the user types again:

- ``abort`` (llm-ls, Continue, twinny): the previous request's connection is closed as
  soon as the next request goes out;
- ``serial`` (llama.vim): never aborts; the next request (for the text as it is *then*)
  goes out only when the previous one has finished;
- ``trigger`` (minuet-ai.nvim): a keystroke (re)starts a debounce timer, ignored while the
  throttle runs; when the timer fires, the client kills every request still running
  (their connections close) and sends ``twins`` identical requests at once (its
  ``n_completions``), then throttles.

And how the client reads an answer (``reads``): the suggestion it shows from the bytes it
got, and whether it shows the user an error, written from each client's parsing code.

Also here: counting the tokens a response delivered, whatever its format (one JSON
object, SSE ``data:`` lines or NDJSON lines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# What the simulated user has above and below the cursor, and what they type.
PREFIX = (
    'def fibonacci(n: int) -> int:\n    """The n-th Fibonacci number."""\n'
    "    if n < 2:\n        return n\n    "
)
SUFFIX = "\n\n\nprint(fibonacci(10))\n"
TYPED = "return fibonacci(n - 1) + fibonacci(n - 2)  # recursion, slow but clear; "

Body = Callable[[str, int, str], dict[str, Any]]


@dataclass(frozen=True)
class Seen:
    """What a client makes of one answer: the suggestion it shows (None: none), whether
    that suggestion came from a stream that ended in an error event (a cut one), and
    whether it shows the user an error."""

    text: str | None
    cut: bool = False
    error_shown: bool = False


#: (status, the body's bytes as read, whether the transfer completed) -> what the client sees
Reader = Callable[[int | None, bytes, bool], Seen]


def data_objects(body: bytes) -> list[Any]:
    """The JSON values of a body's lines, ``data:`` stripped (what SSE readers parse)."""
    out = []
    for line in body.split(b"\n"):
        line = line.strip()
        line = line[5:] if line.startswith(b"data:") else line
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _error_event(body: bytes) -> bool:
    return any(isinstance(o, dict) and "error" in o for o in data_objects(body))


def read_any(status: int | None, body: bytes, complete: bool) -> Seen:
    """A client that takes the text of a complete 200 answer and shows any other status."""
    if status != 200 or not complete:
        return Seen(None, error_shown=status not in (200, 499))
    return Seen(delivered_text(body) or None, cut=_error_event(body))


def read_continue(status: int | None, body: bytes, complete: bool) -> Seen:
    """Continue (core/llm/stream.ts): a ``data:`` line whose JSON has ``error`` throws, as a
    transfer that fails does; 499 is a silent cancel. Autocomplete errors are logged."""
    if status != 200 or not complete or _error_event(body):
        return Seen(None)
    return Seen(delivered_text(body) or None)


def read_minuet(status: int | None, body: bytes, complete: bool) -> Seen:
    """minuet-ai.nvim (utils.lua ``stream_decode``): curl without ``--fail``, so any status
    exits 0. Exit 0 or 28 (its ``--max-time``): every line, ``data:`` stripped, is decoded
    and ``choices[1].text`` of each joined, whatever else the lines say (an error event
    included); no text and a line containing "error": an error notification. Any other
    exit (18: the body ended before its terminator) is an error notification."""
    if not complete:
        return Seen(None, error_shown=True)
    pieces = []
    for obj in data_objects(body):
        try:
            piece = obj["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(piece, str) and piece:
            pieces.append(piece)
    if pieces:
        return Seen("".join(pieces), cut=_error_event(body))
    return Seen(None, error_shown=b"error" in body)


@dataclass(frozen=True)
class Profile:
    name: str
    route: str
    user_agent: str
    stream: bool
    abandon: Literal["abort", "serial", "trigger"]
    body: Body  # (typed text, n_predict, model) -> request JSON
    compact: bool = False  # serialise without spaces (llama.vim)
    reads: Reader = read_any
    headers: tuple[tuple[str, str], ...] = ()  # sent besides Content-Type and User-Agent
    # ``trigger`` clients' own timers and request count (the settings may override them)
    debounce_ms: float = 0.0
    throttle_ms: float = 0.0
    twins: int = 1

    def encode(
        self, typed: str, n_predict: int, model: str, extra: dict[str, Any] | None = None
    ) -> bytes:
        """The request body; ``extra`` fields are set over the profile's own."""
        obj = self.body(typed, n_predict, model)
        if extra:
            obj.update(extra)
        if self.compact:
            return json.dumps(obj, separators=(",", ":")).encode()
        return json.dumps(obj).encode()


def _llm_ls(typed: str, n: int, model: str) -> dict[str, Any]:
    # llm-ls, "openai" backend: a FIM prompt, non-streaming, temperature from the user config
    prompt = f"<fim_prefix>{PREFIX}{typed}<fim_suffix>{SUFFIX}<fim_middle>"
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.2,
        "top_p": 0.95,
        "stream": False,
    }


def _continue(typed: str, n: int, model: str) -> dict[str, Any]:
    # Continue, provider "llama.cpp": POST /completion, streaming, its own FIM template
    prompt = f"<fim_prefix>{PREFIX}{typed}<fim_suffix>{SUFFIX}<fim_middle>"
    return {
        "prompt": prompt,
        "n_predict": n,
        "stream": True,
        "temperature": 0.01,
        "stop": ["<fim_prefix>", "\n\n"],
        "cache_prompt": True,
    }


def _llama_vim(typed: str, n: int, _model: str) -> dict[str, Any]:
    # llama.vim: /infill with the current line split into prompt, compact JSON
    return {
        "id_slot": 0,
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [],
        "prompt": typed,
        "n_predict": n,
        "stop": [],
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 250,
        "response_fields": [
            "content",
            "timings/prompt_n",
            "timings/predicted_n",
            "truncated",
            "tokens_cached",
        ],
    }


def _twinny(typed: str, n: int, model: str) -> dict[str, Any]:
    # twinny, Ollama provider: /api/generate, NDJSON stream, raw FIM prompt
    prompt = f"<fim_prefix>{PREFIX}{typed}<fim_suffix>{SUFFIX}<fim_middle>"
    return {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "keep_alive": "5m",
        "options": {"temperature": 0.2, "num_predict": n},
    }


def _minuet(typed: str, n: int, _model: str) -> dict[str, Any]:
    # minuet-ai.nvim, openai_fim_compatible as its README sets it up for llama.cpp: the
    # template writes the FIM prompt itself (Qwen2.5-coder's tokens), no suffix, the model
    # a placeholder, optional max_tokens and top_p; stream on (its default)
    prompt = f"<|fim_prefix|>{PREFIX}{typed}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    return {"model": "PLACEHOLDER", "stream": True, "max_tokens": n, "top_p": 0.9, "prompt": prompt}


PROFILES: dict[str, Profile] = {
    "llm-ls": Profile(
        "llm-ls",
        "/v1/completions",
        "llm-ls/0.5.3; rust/unknown; ide/Neovim",
        False,
        "abort",
        _llm_ls,
    ),
    "continue": Profile(
        "continue", "/completion", "Continue/1.0", True, "abort", _continue, reads=read_continue
    ),
    "llama-vim": Profile(
        "llama-vim", "/infill", "curl/8.5.0", False, "serial", _llama_vim, compact=True
    ),
    "twinny": Profile("twinny", "/api/generate", "twinny/3.0", True, "abort", _twinny),
    "minuet": Profile(
        "minuet",
        "/v1/completions",
        "curl/8.5.0",
        True,
        "trigger",
        _minuet,
        reads=read_minuet,
        # its api_key option names an environment variable; its README uses TERM's value
        headers=(("Accept", "application/json"), ("Authorization", "Bearer xterm-256color")),
        debounce_ms=400.0,
        throttle_ms=1000.0,
        twins=3,
    ),
}


def typed_text(keystroke: int) -> str:
    """What the user has typed after ``keystroke + 1`` keystrokes (wraps around TYPED)."""
    n = keystroke + 1
    return TYPED * (n // len(TYPED)) + TYPED[: n % len(TYPED)]


def _count(obj: Any) -> tuple[int | None, int]:
    """(explicit token count if the object carries one, 1 if it is a non-empty stream piece)."""
    if not isinstance(obj, dict):
        return None, 0
    for key in ("tokens_predicted", "eval_count"):
        if isinstance(obj.get(key), int):
            return obj[key], 0
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"], 0
    choices = obj.get("choices") or [{}]
    piece = (
        obj.get("content")
        or obj.get("response")
        or (choices[0].get("text") if isinstance(choices[0], dict) else "")
    )
    return None, 1 if piece else 0


def response_objects(body: bytes) -> list[Any]:
    """The JSON objects of a response: the body, or its SSE / NDJSON lines."""
    try:
        return [json.loads(body)]
    except ValueError:
        pass
    objs = []
    for line in body.splitlines():
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if not line or line == b"[DONE]":
            continue
        try:
            objs.append(json.loads(line))
        except ValueError:
            continue
    return objs


def delivered_text(body: bytes) -> str:
    """The completion text a finished response delivered, whatever its format."""
    text = []
    for obj in response_objects(body):
        if not isinstance(obj, dict):
            continue
        choices = obj.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        piece = obj.get("content", obj.get("response", choice.get("text", "")))
        text.append(piece if isinstance(piece, str) else "")
    return "".join(text)


def delivered_tokens(body: bytes) -> int:
    """Tokens a finished response delivered: its own count if it reports one, else its pieces."""
    explicit, pieces = None, 0
    for obj in response_objects(body):
        n, p = _count(obj)
        explicit = n if n is not None else explicit
        pieces += p
    return explicit if explicit is not None else pieces
