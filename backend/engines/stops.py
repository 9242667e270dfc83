"""How a generation ends, shared by the llama-cpp and torch engines.

* Stop words are matched on the generated text; text that could be the start of a stop
  word is held back until it is known not to be one, so a stop word never leaks into a
  stream (``split_held``).
* ``done_event`` builds the final ``Done`` of a sequence from its ``perf_counter`` stamps.

Pure functions: no state, no I/O; called on the engine's single thread.
"""

from __future__ import annotations

import time
from typing import Protocol

from llmproxy.backend.protocol import Done


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest occurrence of any (non-empty) stop word in ``text``: (index, word)."""
    best: tuple[int, str] | None = None
    for word in stops:
        if not word:
            continue
        idx = text.find(word)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, word)
    return best


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop word."""
    keep = 0
    for word in stops:
        for k in range(min(len(word) - 1, len(text)), keep, -1):
            if text.endswith(word[:k]):
                keep = k
                break
    return keep


def split_held(text: str, stops: tuple[str, ...]) -> tuple[str, str, str | None]:
    """Split pending text (held text + newly decoded text) into ``(emit, held, word)``.

    ``word`` is the stop word found (then ``emit`` is the text before it and ``held`` is
    empty: the generation ends there), else None and ``held`` is the tail that could
    still become a stop word.
    """
    keep = 0
    if stops:
        hit = find_stop(text, stops)
        if hit is not None:
            idx, word = hit
            return text[:idx], "", word
        keep = partial_stop_len(text, stops)
    if keep:
        return text[: len(text) - keep], text[len(text) - keep :], None
    return text, "", None


class TimedSeq(Protocol):
    """What ``done_event`` reads from an engine's sequence."""

    @property
    def rid(self) -> str: ...

    tokens: list[int]
    n_decoded: int
    t_start: float
    t_first: float


def done_event(seq: TimedSeq, reason: str, stopping_word: str = "", n_cached: int = 0) -> Done:
    """The ``Done`` of ``seq``; stamps not set yet (0.0) count as now."""
    now = time.perf_counter()
    t_first = seq.t_first or now
    t_start = seq.t_start or now
    return Done(
        request_id=seq.rid,
        stop_reason=reason,  # type: ignore[arg-type]
        n_prompt_tokens=len(seq.tokens),
        n_predicted=seq.n_decoded,
        prompt_ms=(t_first - t_start) * 1000.0,
        predicted_ms=(now - t_first) * 1000.0,
        stopping_word=stopping_word,
        n_cached=n_cached,
    )
