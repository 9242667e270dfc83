"""The fake upstream's prompt-cache model: a request's prompt text and what a slot holds of it.

``prompt_text(path, body)`` is the text a generation route evaluates, compared
character by character (a stand-in for llama-server's tokens); ``common_prefix`` is how
much of it a slot's cached prompt already holds; ``add_timings`` reports both in
llama-server's ``timings`` object (``prompt_n``: evaluated, ``cache_n``: cached).
Pure functions only: the per-slot cache lives in slots.py, the counters in upstream.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

from llmproxy.proxy.routes import paths

TEXT_ROUTES = paths(prompt="text")
CHAT_ROUTES = paths(prompt="chat")
INFILL_ROUTES = paths(prompt="infill")


def _text(value: Any) -> str:
    """A string field as text; a list joins its string items (token ids are skipped)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(v for v in value if isinstance(v, str))
    return ""


def prompt_text(path: str, body: dict[str, Any]) -> str | None:
    """The prompt text of a request to generation route ``path`` (None: a route without one,
    such as embeddings and reranking, which the model leaves alone).

    ``/infill``: each ``input_extra`` chunk's ``filename`` and ``text`` in order, then
    ``input_prefix``, ``prompt`` and ``input_suffix``; the text routes: ``prompt``; the chat
    routes: ``messages`` as sorted-key JSON ("" when absent)."""
    if path in INFILL_ROUTES:
        extra = body.get("input_extra")
        chunks = [c for c in extra if isinstance(c, dict)] if isinstance(extra, list) else []
        head = "".join(_text(c.get("filename")) + _text(c.get("text")) for c in chunks)
        return (
            head
            + _text(body.get("input_prefix"))
            + _text(body.get("prompt"))
            + _text(body.get("input_suffix"))
        )
    if path in TEXT_ROUTES:
        return _text(body.get("prompt"))
    if path in CHAT_ROUTES:
        messages = body.get("messages")
        return "" if messages is None else json.dumps(messages, sort_keys=True)
    return None


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    return len(os.path.commonprefix([a, b]))


def add_timings(fmt: str, obj: Any, evaluated: int, cached: int) -> None:
    """Put ``prompt_n`` / ``cache_n`` into the ``timings`` of a llama-server answer, in place.

    ``obj`` is a whole body (a dict, or llama-server's array of completions) or the list of
    closing stream pieces (``Shape.final``). Native pieces (``fmt`` "llama") each get them;
    OpenAI-shaped ones (``oai_text``, ``oai_chat``) on the last piece only, as llama-server
    sends them; other formats are left as they are. An existing ``timings`` is extended."""
    pieces = [o for o in (obj if isinstance(obj, list) else [obj]) if isinstance(o, dict)]
    if fmt in ("oai_text", "oai_chat"):
        pieces = pieces[-1:]
    elif fmt != "llama":
        return
    for piece in pieces:
        timings = piece.setdefault("timings", {})
        timings.update(prompt_n=evaluated, cache_n=cached)


def continues_at(path: str, body: dict[str, Any], kind: str) -> int:
    """Where a generation starts: k when the request continues the fake's own answer, a
    text prompt (``/completion``, ``/v1/completions``) or, on llama-server's chat routes, a
    closing assistant message (a prefill) that ends with its tokens ``t0 `` .. ``t{k-1} ``,
    as a deterministic model goes on with the text it was given; else 0 (so is a text that
    holds ``t0 `` twice: no answer of the fake's)."""
    if path in TEXT_ROUTES:
        text = _text(body.get("prompt"))
    elif path in CHAT_ROUTES and kind == "llamacpp":
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return 0
        text = _text(last.get("content"))
    else:
        return 0
    start = text.find("t0 ")  # the answer once: a text continued twice over is no answer
    if start < 0 or (start > 0 and text[start - 1].isalnum()):
        return 0
    tokens = text[start:].split(" ")
    if tokens[-1] != "" or tokens[:-1] != [f"t{i}" for i in range(len(tokens) - 1)]:
        return 0
    return len(tokens) - 1


def trailing_assistants(path: str, body: dict[str, Any], kind: str) -> int:
    """How many assistant messages close a llama-server chat request's list (llama-server
    refuses two or more: 400)."""
    messages = body.get("messages") if path in CHAT_ROUTES and kind == "llamacpp" else None
    n = 0
    for m in reversed(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict) or m.get("role") != "assistant":
            break
        n += 1
    return n
