"""llama.cpp's ``llama-server`` (and llmproxy's own backend, and a router's models).

Permit i <-> slot i: ``id_slot`` is written into each gated body on the routes that take it,
so the proxy knows exactly which slot runs which request (the adapter confirms a stop from
``GET /slots``). Every route that runs on a slot is gated (``gated_routes``), llama-server's
own embeddings, rerank and ``/v1/messages`` included.

``n_cmpl`` (alias ``n``, as llama.vscode sends it) asks llama-server for that many
completions of one prompt, run at once on that many slots, so such a request holds that
many permits (``permits``). An embeddings batch (a rerank) runs one task per input
(document) on idle slots, so it holds min(inputs, capacity) permits.

A non-streaming completion or chat is sent as a stream and answered whole (assemble.py):
llama-server notices a dropped streaming client at its next token, a non-streaming one only
when another completion request arrives. What the dialect knows of the server (``streams``,
``own``) comes from its ``/props``: the adapter builds a new dialect when it reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmproxy.proxy.gating.routes import (
    EMBEDDING_ROUTES,
    GATED_ROUTES,
    LLAMACPP_GATED_ROUTES,
    RERANK_ROUTES,
    SLOT_ROUTES,
)
from llmproxy.proxy.relay.assemble import CHAT_ROUTES
from llmproxy.proxy.request import Body
from llmproxy.proxy.routes import eligible
from llmproxy.proxy.upstream.assemble import assembles
from llmproxy.proxy.upstream.dialects.base import Dialect, TooManySlots
from llmproxy.proxy.upstream.dialects.body import set_top_level


def _json_int(body: dict[str, Any], key: str, default: int) -> int:
    """nlohmann's ``json_value(body, key, default)`` for an int field (llama-server's reader)."""
    value = body.get(key)
    if isinstance(value, (bool, int, float)):
        try:
            return int(value)
        except (OverflowError, ValueError):  # inf, nan (Python's json reads 1e400, NaN)
            return default
    return default  # absent, null, or a type it cannot convert


def _inputs(value: Any) -> int:
    """Prompts in an OpenAI embeddings ``input``: a string or one token list is one; a list
    of strings or of token lists is one each."""
    if not isinstance(value, list) or not value or all(isinstance(v, int) for v in value):
        return 1
    return len(value)


@dataclass(frozen=True, slots=True)
class LlamaCppDialect(Dialect):
    kind: str = "llamacpp"
    gated_routes: frozenset[str] = GATED_ROUTES | LLAMACPP_GATED_ROUTES
    #: completions and chats may be sent as streams (``upstream_stream``, and what /props said)
    streams: bool = True
    #: llmproxy's own backend (True), a llama-server (False), or not known yet (None)
    own: bool | None = None
    #: streamed only where type-through may continue the request (own backend, auto)
    streams_for_reuse: bool = False
    #: a router's model: named in every body that names none (adapters/router.py)
    model: str | None = None

    def assembles(self, path: str, body: Body) -> bool:
        if self.streams_for_reuse and not eligible(path, body):
            return False
        return self.streams and assembles(path, body)

    def answers_at_start(self, path: str, body: Body) -> bool:
        """llama-server sends a stream's head when the task starts on its slot (after reading
        the body, tokenizing the prompt and queueing the task, all before the slot shows it
        busy). A stop before the head arrives waits for it, so that the confirmation never
        counts as stopped a task that is still on its way to the slot; a confirmation by two
        idle polls would, for a long prompt. (Only where the stop is confirmed: the job asks
        the adapter that too.)"""
        if self.own is not False or path not in SLOT_ROUTES:
            return False
        return body.get("stream") is True or self.assembles(path, body)

    def prepare_body(self, path: str, raw: bytes, body: Body, slot: int) -> bytes:
        if path in SLOT_ROUTES:
            raw = set_top_level(raw, "id_slot", slot, present="id_slot" in body)
            if self.assembles(path, body):
                raw = set_top_level(raw, "stream", True, present="stream" in body)
                if path in CHAT_ROUTES:  # the usage the whole answer has comes last
                    usage = {"include_usage": True}
                    raw = set_top_level(raw, "stream_options", usage, present=None)
        if self.model is not None and not body.get("model"):
            raw = set_top_level(raw, "model", self.model, present="model" in body)
        return raw

    def permits(self, path: str, body: Body, capacity: int) -> int:
        """Slots a gated request runs on at once.

        - Slot routes: the completions it asks for, read as llama-server reads it,
          ``json_value(data, "n_cmpl", json_value(data, "n", 1))``. A missing or null field
          gives the default; a number is cut to an int (2.7 -> 2, true -> 1); another type
          gives the default. Below 1 counts as 1 (the server refuses or ignores it). More
          than ``capacity`` is ``TooManySlots``, naming the field sent.
        - Embeddings (``/v1/embeddings``, ``/embedding``, ``/embeddings``): llama-server runs
          each input (``input``, else ``content``) as its own task on any free slot, so a
          batch of n inputs takes min(n, capacity) slots (the rest run as those free).
        - Reranking: one task per document (``documents``, else ``texts``), likewise.
        """
        if path in EMBEDDING_ROUTES:
            return min(_inputs(body["input"] if "input" in body else body.get("content")), capacity)
        if path in RERANK_ROUTES:
            docs = body.get("documents")
            docs = docs if isinstance(docs, list) else body.get("texts")
            return min(max(1, len(docs)) if isinstance(docs, list) else 1, capacity)
        if path not in SLOT_ROUTES:
            return 1
        wanted = max(1, _json_int(body, "n_cmpl", _json_int(body, "n", 1)))
        if wanted <= capacity:
            return wanted
        raise TooManySlots("n_cmpl" if body.get("n_cmpl") is not None else "n", wanted, capacity)
