"""When is a new request a continuation of an earlier one: the user typed ``d``.

``typed(route, old, new)`` compares two parsed request bodies of the same session and route
and returns what the user may have typed at the cursor between them: the candidates for
``d``, none when the new request is not a continuation. Whether ``d`` is what the old
generation wrote is the caller's question (registry.py); this module only compares bodies.
Pure functions.

Per route:
- ``/infill``: ``input_prefix + prompt`` grew by ``d`` (llama.vim moves whole lines from
  ``prompt`` into ``input_prefix``, so only the concatenation counts), ``input_suffix`` is
  equal; ``input_extra`` may differ (it is context around the cursor, not the cursor's text).
- ``/completion``, ``/completions``, ``/v1/completions``: the old prompt is ``A + B`` and
  the new one ``A + d + B``: one insertion at the cursor. ``B`` is what follows the cursor
  in a prompt the client built itself (fill-in-the-middle, as llm-ls and Continue send),
  empty for a plain continuation; ``/v1/completions``' ``suffix`` is equal. The cursor is
  not marked, so where ``d`` ends as ``B`` begins (``<a`` typed before ``<fim_suffix>``) the
  insertion could be at more than one place, each giving ``d`` rotated (``<a``, ``a<``):
  all are candidates, and the generation's text tells which one the user typed.

Every other field must be equal (sampling parameters, ``n_predict``, ``stream``, ...).
Never a continuation: other routes (chat), a prompt that is not a string, warm-ups
(``n_predict``/``max_tokens`` 0), per-token probabilities (``n_probs``, ``logprobs``),
several completions (``n_cmpl``, ``n`` > 1), an empty ``d`` (nothing typed), and a ``d``
longer than ``MAX_TYPED``: the work per request stays linear in its size.
"""

from __future__ import annotations

from typing import Any

from llmproxy.proxy.routes import ROUTES as ROUTES_TABLE
from llmproxy.proxy.routes import eligible, paths

ROUTES = paths(assembled=True)

# The fields that carry the text at the cursor, by where the route's prompt is; every other
# field must be equal.
_CURSOR_FIELDS = {
    "infill": frozenset({"input_prefix", "prompt", "input_extra"}),
    "text": frozenset({"prompt"}),
}
_TEXT_FIELDS = {path: _CURSOR_FIELDS[str(ROUTES_TABLE[path].prompt)] for path in ROUTES}


#: The most text one continuation may have typed (characters). Beyond it a request is no
#: continuation: matching stays O(prompt) per request whatever a client sends (a prompt of
#: megabytes of one repeated letter would otherwise make every rotation a candidate), and no
#: generation writes that much between two keystrokes.
MAX_TYPED = 1024
_BLOCK = 4096  # prefix/suffix compared this many characters at a time, at C speed


def _common_prefix(a: str, b: str, limit: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``limit``:
    equal blocks skipped by slice comparison, the first unequal one bisected. O(limit)."""
    at = 0
    while at < limit:
        end = min(at + _BLOCK, limit)
        if a[at:end] == b[at:end]:
            at = end
            continue
        lo, hi = at, end  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    return limit


def _common_suffix(a: str, b: str, limit: int) -> int:
    """The length of the longest common suffix of ``a`` and ``b``, at most ``limit``."""
    la, lb = len(a), len(b)
    at = 0
    while at < limit:
        end = min(at + _BLOCK, limit)
        if a[la - end : la - at] == b[lb - end : lb - at]:
            at = end
            continue
        lo, hi = at, end
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[la - mid : la - lo] == b[lb - mid : lb - lo]:
                lo = mid
            else:
                hi = mid
        return lo
    return limit


def _inserted(old: str, new: str) -> tuple[str, ...]:
    """Every ``d`` such that ``old = A + B`` and ``new = A + d + B`` (``d`` not empty, at
    most ``MAX_TYPED`` long).

    The places ``len(A)`` that work form one range; ``new`` repeats with period ``len(d)``
    across it, so its first ``len(d)`` places give every distinct ``d``. O(len(old)) to find
    the range, O(MAX_TYPED ** 2) at most to list the candidates."""
    grown = len(new) - len(old)
    if grown <= 0 or grown > MAX_TYPED:
        return ()
    limit = len(old)
    lcp = _common_prefix(old, new, limit)  # the longest A
    lcs = _common_suffix(old, new, limit)  # the longest B
    first = limit - lcs  # the shortest A
    if first > lcp:
        return ()
    last = min(lcp, first + grown - 1)
    return tuple(dict.fromkeys(new[k : k + grown] for k in range(first, last + 1)))


def typed(route: str, old: Any, new: Any) -> tuple[str, ...]:
    """What may have been typed at the cursor between ``old`` and ``new`` (bodies of
    ``route``): one candidate, or several rotations of it (see above); none when ``new`` is
    not a continuation of ``old``."""
    if not (eligible(route, old) and eligible(route, new)):
        return ()
    text_fields = _TEXT_FIELDS[route]
    keys = (old.keys() | new.keys()) - text_fields
    if any(old.get(k) != new.get(k) for k in keys):
        return ()
    if ROUTES_TABLE[route].prompt == "infill":
        before_old = old.get("input_prefix", "") + old.get("prompt", "")
        before_new = new.get("input_prefix", "") + new.get("prompt", "")
        grown = len(before_new) - len(before_old)
        if not 0 < grown <= MAX_TYPED or not before_new.startswith(before_old):
            return ()
        return (before_new[len(before_old) :],)
    return _inserted(old.get("prompt", ""), new.get("prompt", ""))
