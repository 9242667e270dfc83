"""What a test tells the fake upstream (``Script``) and what the fake records (``Received``).

``FakeUpstream`` asks its ``script(path, body)`` for a ``Script`` when a generation
arrives; the ``Script`` decides how many tokens it generates and how fast, which status it
answers and which failure it plays (``FailMode``). Every request that reaches the fake,
generation or not, is kept as one ``Received``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from multidict import CIMultiDict

Kind = Literal["llamacpp", "openai", "ollama"]
FailMode = Literal[
    None, "reset_mid_stream", "hang_before_headers", "hang_mid_body", "malformed", "error_event"
]


@dataclass
class Script:
    """How the fake answers one generation request.

    ``tokens`` is capped by the request's own limit (``n_predict``, ``max_tokens``,
    ``options.num_predict``) when that is >= 0. A ``status`` outside 2xx answers an error
    at once, without taking a slot. ``fail``:

    - ``reset_mid_stream``: the connection is aborted half-way through the body;
    - ``hang_before_headers`` / ``hang_mid_body``: nothing more is sent until the client
      leaves or ``FakeUpstream.stop()`` runs;
    - ``malformed``: the body (or one stream event) is cut JSON;
    - ``error_event``: an SSE stream ends half-way with llama-server's error event
      (``data: {"error": {...}}``); a whole answer is that error with status 500.
    """

    tokens: int = 8
    token_delay_s: float = 0.005
    status: int = 200
    fail: FailMode = None
    hold: asyncio.Event | None = None  # once on its slots, generate only after this is set
    # SSE streams: a comment line of this many bytes after each token's event (clients skip it)
    padding: int = 0


@dataclass
class Received:
    """One request as it reached the fake (``t`` is ``time.monotonic()`` at receipt).

    The fake sets the two ``prompt_chars_*`` fields of a generation when it gets its slot,
    with the prompt-cache model on (``FakeUpstream(prefill_s_per_char>0)``): the prompt
    characters it evaluated and those its slot had cached. The other fields never change."""

    path: str
    body: dict[str, Any] | None
    raw: bytes
    headers: CIMultiDict[str]  # as received; lookups ignore case
    t: float
    id: int
    prompt_chars_evaluated: int = 0
    prompt_chars_cached: int = 0
