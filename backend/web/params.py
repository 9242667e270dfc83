"""Generation parameters of a request body: types, ranges and limits, into ``SamplingParams``.

Every field is checked before anything reaches an engine: a field of the wrong type is a
400 (``null`` means the default, as in llama-server), integers must fit llama.cpp's
``int32`` (llama-server reads them into C ints and wraps: ``top_k`` 2^32+1 would act as
1), booleans must be JSON booleans (``"stream": "false"`` is a 400, not a stream). Fields
llama-server has but this backend does not implement (``n_probs``, ``logprobs``,
``top_logprobs``, ``logit_bias``) are a 400 naming the field when they ask for something,
never silently ignored. Stop words are limited in count and length (``MAX_STOP_WORDS``,
``MAX_STOP_CHARS``): their matching is linear (``engines/stops.StopMatcher``) but its
automaton and the ``generation_settings`` echo grow with them.

Pure functions raising ``BadRequest``; nothing here blocks.
"""

from __future__ import annotations

import math
from typing import Any

from llmproxy.backend.protocol import SamplingParams
from llmproxy.backend.web.errors import BadRequest

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_STOP_WORDS = 64
MAX_STOP_CHARS = 512
UNSUPPORTED = ("n_probs", "logprobs", "top_logprobs", "logit_bias")


def finite(v: Any) -> bool:
    """A JSON number the engines can take: not a bool, NaN, inf (Python's json reads NaN and
    1e400) or an integer too large for a float (it reads 400 digits as an int)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def number(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not finite(v):
        raise BadRequest(f"'{key}' must be a finite number")
    return float(v)


def integer(
    body: dict[str, Any], key: str, default: int, lo: int = INT32_MIN, hi: int = INT32_MAX
) -> int:
    """An integer field from ``lo`` to ``hi`` (a float with an integral value counts, as
    llama-server's JSON reader converts it)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and finite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be an integer from {lo} to {hi}")
    return v


def boolean(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be true or false")
    return v


def stop_words(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(s, str) for s in words):
        raise BadRequest("'stop' must be a string or a list of strings")
    if len(words) > MAX_STOP_WORDS or any(len(s) > MAX_STOP_CHARS for s in words):
        raise BadRequest(
            f"'stop' takes at most {MAX_STOP_WORDS} words of at most {MAX_STOP_CHARS} characters"
        )
    return tuple(s for s in words if s)


def reject_unsupported(body: dict[str, Any]) -> None:
    """A 400 for a field this backend does not implement when it asks for something
    (``null``, ``false``, ``0`` and ``{}`` ask for nothing)."""
    for key in UNSUPPORTED:
        v = body.get(key)
        if v is None or v is False or v == 0 or v == {} or v == []:
            continue
        raise BadRequest(f"'{key}' is not supported by this server")


def sampling_params(body: dict[str, Any], openai: bool = False) -> SamplingParams:
    d = SamplingParams()
    reject_unsupported(body)
    n_predict = integer(body, "n_predict", -1)
    if openai:
        for key in ("max_tokens", "max_completion_tokens"):  # the last present one wins
            n_predict = integer(body, key, n_predict)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer")
    tmax = body.get("t_max_predict_ms")
    if tmax is not None and not finite(tmax):
        raise BadRequest("'t_max_predict_ms' must be a finite number")
    return SamplingParams(
        n_predict=max(-1, n_predict),
        temperature=number(body, "temperature", d.temperature),
        top_k=integer(body, "top_k", d.top_k),
        top_p=number(body, "top_p", d.top_p),
        min_p=number(body, "min_p", d.min_p),
        seed=None if seed is None or seed < 0 else seed % 2**32,  # llama-server's seed is a uint32
        stop=stop_words(body),
        t_max_predict_ms=int(min(tmax, INT32_MAX)) if tmax else None,
        n_indent=max(0, integer(body, "n_indent", 0)),
        ignore_eos=boolean(body, "ignore_eos"),
    )
