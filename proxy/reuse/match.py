"""When is a new request a continuation of an earlier one: the user typed ``d``.

``typed(route, old, new)`` compares two parsed request bodies of the same session and route
and returns the text ``d`` the user typed at the cursor between them, or None when the new
request is not a continuation. Whether ``d`` is what the old generation wrote is the
caller's question (generation.py); this module only compares bodies. Pure functions.

Per route:
- ``/infill``: ``input_prefix + prompt`` grew by ``d`` (llama.vim moves whole lines from
  ``prompt`` into ``input_prefix``, so only the concatenation counts), ``input_suffix`` is
  equal; ``input_extra`` may differ (it is context around the cursor, not the cursor's text).
- ``/completion``, ``/completions``, ``/v1/completions``: the old prompt is ``A + B`` and
  the new one ``A + d + B``: one insertion at the cursor. ``B`` is what follows the cursor
  in a prompt the client built itself (fill-in-the-middle, as llm-ls and Continue send),
  empty for a plain continuation; ``/v1/completions``' ``suffix`` is equal.

Every other field must be equal (sampling parameters, ``n_predict``, ``stream``, ...).
Never a continuation: other routes (chat), a prompt that is not a string, warm-ups
(``n_predict``/``max_tokens`` 0), per-token probabilities (``n_probs``, ``logprobs``),
several completions (``n_cmpl``, ``n`` > 1), and an empty ``d`` (nothing typed).
"""

from __future__ import annotations

from typing import Any

ROUTES = frozenset({"/infill", "/completion", "/completions", "/v1/completions"})

# The fields that carry the text at the cursor, per route; every other field must be equal.
_TEXT_FIELDS = {
    "/infill": frozenset({"input_prefix", "prompt", "input_extra"}),
    "/completion": frozenset({"prompt"}),
    "/completions": frozenset({"prompt"}),
    "/v1/completions": frozenset({"prompt"}),
}


def _positive(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def eligible(route: str, body: Any) -> bool:
    """Can a request with ``body`` on ``route`` be continued, or continue another?"""
    if route not in ROUTES or not isinstance(body, dict):
        return False
    for key in ("n_predict", "max_tokens"):
        n = body.get(key)
        if n == 0 and not isinstance(n, bool):
            return False  # a warm-up: it wants no text
    if _positive(body, "n_probs") or _positive(body, "n_cmpl") and body["n_cmpl"] > 1:
        return False
    if _positive(body, "n") and body["n"] > 1:
        return False
    if body.get("logprobs") not in (None, False, 0):
        return False
    return all(isinstance(body.get(k, ""), str) for k in ("prompt", "input_prefix"))


def _inserted(old: str, new: str) -> str | None:
    """``d`` when ``new`` is ``old`` with one non-empty insertion ``d``: ``old = A + B`` and
    ``new = A + d + B``, with ``A`` as long as possible."""
    grown = len(new) - len(old)
    if grown <= 0:
        return None
    lcp = 0
    limit = len(old)
    while lcp < limit and old[lcp] == new[lcp]:
        lcp += 1
    if new[lcp + grown :] != old[lcp:]:
        return None
    return new[lcp : lcp + grown]


def typed(route: str, old: Any, new: Any) -> str | None:
    """The text typed at the cursor between ``old`` and ``new`` (bodies of ``route``), or
    None when ``new`` is not a continuation of ``old``."""
    if not (eligible(route, old) and eligible(route, new)):
        return None
    text_fields = _TEXT_FIELDS[route]
    keys = (old.keys() | new.keys()) - text_fields
    if any(old.get(k) != new.get(k) for k in keys):
        return None
    if route == "/infill":
        before_old = old.get("input_prefix", "") + old.get("prompt", "")
        before_new = new.get("input_prefix", "") + new.get("prompt", "")
        if not before_new.startswith(before_old):
            return None
        return before_new[len(before_old) :] or None
    return _inserted(old.get("prompt", ""), new.get("prompt", ""))
