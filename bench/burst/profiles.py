"""Wire profiles of real editor clients for ``llmproxy bench burst``, read from their source.

A profile says which route a client calls, the JSON body it sends (byte shape included:
llama.vim sends compact JSON), its User-Agent, whether it streams, and how it abandons
a request when the user types again:

- ``abort`` (llm-ls, Continue, twinny): the previous request's connection is closed as
  soon as the next request goes out;
- ``serial`` (llama.vim): never aborts; the next request (for the text as it is *then*)
  goes out only when the previous one has finished.

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
class Profile:
    name: str
    route: str
    user_agent: str
    stream: bool
    abandon: Literal["abort", "serial"]
    body: Body  # (typed text, n_predict, model) -> request JSON
    compact: bool = False  # serialise without spaces (llama.vim)

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


PROFILES: dict[str, Profile] = {
    "llm-ls": Profile(
        "llm-ls",
        "/v1/completions",
        "llm-ls/0.5.3; rust/unknown; ide/Neovim",
        False,
        "abort",
        _llm_ls,
    ),
    "continue": Profile("continue", "/completion", "Continue/1.0", True, "abort", _continue),
    "llama-vim": Profile(
        "llama-vim", "/infill", "curl/8.5.0", False, "serial", _llama_vim, compact=True
    ),
    "twinny": Profile("twinny", "/api/generate", "twinny/3.0", True, "abort", _twinny),
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
