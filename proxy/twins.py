"""Twins: requests of one session that ask for the same thing at the same time.

Some clients ask for N suggestions by sending N identical requests at once (minuet-ai.nvim's
``n_completions``), from one address and User-Agent: one session to the proxy. Such
requests are *twins*: their bodies are equal, apart from the fields the proxy sets itself
(``id_slot``), and they overlap in time. None is a newer keystroke than another, so none
supersedes another (queued or in flight, at the gate, in a pool's queue, or as a stale
type-through follower), each runs on its own permit, and type-through never answers one
from its sibling's generation (they asked for different samples). A newer request of the
session with a different body supersedes all of them together.

``twin_key`` is what is compared: a digest of the route and the body; ``twins`` says
whether two keys make twins. "Overlap in time" is the callers' part: they compare a
newcomer only with requests still queued or running. Ground module: pure functions, no
imports from the proxy's parts (admission and type-through both use it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

#: fields the proxy writes into a gated body itself: equal requests differ only there
PROXY_SET_FIELDS = frozenset({"id_slot"})


def twin_key(route: str, body: Any) -> str | None:
    """A digest of ``route`` and ``body`` less ``PROXY_SET_FIELDS``; None for a body that is
    not a JSON object (such requests have no twins). Linear in the body's size."""
    if not isinstance(body, dict):
        return None
    fields = {k: v for k, v in body.items() if k not in PROXY_SET_FIELDS}
    digest = hashlib.blake2b(digest_size=16)
    digest.update(route.encode("utf-8", "surrogatepass") + b"\0")
    try:
        # orjson, keys sorted at every level; the same body always takes the same path
        digest.update(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS))
    except (TypeError, orjson.JSONEncodeError):  # past its range (a 65-bit integer, NaN...)
        try:
            text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):  # not JSON data
            return None
        digest.update(b"\1" + text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def twins(a: str | None, b: str | None) -> bool:
    """Are requests with keys ``a`` and ``b`` (of one session, overlapping) twins?"""
    return a is not None and a == b
