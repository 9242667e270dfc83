"""llama.cpp ``llama-server`` (and llmproxy's own backend).

Permit i <-> slot i: ``id_slot`` is written into each gated body, so the proxy knows
exactly which slot runs which request, and a stop is confirmed from ``GET /slots``
(slots.py: confirmation, quarantine, settling). Without ``/slots`` (``--no-slots``), the
adapter cannot confirm and the policies fall back to ``finish``; so do routes that carry no
``id_slot`` (embeddings, reranking), whose slot the proxy cannot know. An embeddings batch
(a rerank) runs one task per input (document) on idle slots, the lowest, so it holds
min(inputs, capacity) permits, the lowest free ones, settled before it is sent as the
extras of an ``n_cmpl`` request are (below). Every route that runs on a slot is gated here
(``gated_routes``), llama-server's own embeddings, rerank and ``/v1/messages`` included.

``n_cmpl`` (alias ``n``, as llama.vscode sends it) asks llama-server for that many
completions of one prompt, run at once on that many slots: the one ``id_slot`` names and,
for the others, the lowest idle ids (they cannot be pinned). Such a request holds that many
permits (``permits``), which the gate grants as ``id_slot``'s slot plus the lowest free
ones: the slots the server picks, since a free permit is an idle slot. Before it is sent,
``settle`` waits until the lower slots other requests hold are busy at the server (one
granted just before it may still be on its way) and swaps in lower slots freed meanwhile.
A stop is confirmed once all of its slots are idle. What is left is a narrower race (a
lower slot freed and granted again between ``settle`` and the arrival): the count of
generations still never exceeds the permits; only that other request waits in the server.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from llmproxy.proxy.errors import BadRequest
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
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import get_json, log
from llmproxy.proxy.upstream.adapters.body import set_top_level
from llmproxy.proxy.upstream.adapters.listing import RouterModel
from llmproxy.proxy.upstream.adapters.slots import SlotPollingAdapter
from llmproxy.proxy.upstream.assemble import assembles


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


def total_slots(props: Any) -> int | None:
    """``total_slots`` of a /props answer, if it is a usable count."""
    slots = props.get("total_slots") if isinstance(props, dict) else None
    return slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None


OWN_BACKEND = "llmproxy-backend"  # /props build_info of llmproxy's own backend


class LlamaCppAdapter(SlotPollingAdapter):
    kind = "llamacpp"
    gated_routes = GATED_ROUTES | LLAMACPP_GATED_ROUTES  # every route that runs on a slot

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        settings: ProxySettings,
        *,
        slots: int | None = None,
    ) -> None:
        super().__init__(base_url, session, settings, slots=slots)
        self.props_pending = False  # slot count still to be read from /props (detection gave up)
        self.slots_pending = False  # /slots failed in a way that may pass (timeout, refused, 5xx)
        self.streams = settings.upstream_stream != "off"  # until /props says which server it is
        self.own: bool | None = None  # llmproxy's own backend? (None: /props not read yet)
        self.streams_for_reuse = False
        self.client.reuse_after_stream = False
        #: a llama-server in router mode: its models (router.py), run as members of their own
        self.router: list[RouterModel] | None = None
        self.router_max: int | None = None  # ... and how many it runs at once (--models-max)

    def learn_props(self, props: Any) -> None:
        """What /props tells: the slot count, and whether this is llmproxy's own backend.
        ``upstream_stream`` auto streams on llama-server (for its stops) and, with
        type-through on, on llmproxy's own backend too, whose stops need no stream but whose
        text type-through reads as it is generated."""
        self.slots = total_slots(props)
        self.own = own = isinstance(props, dict) and props.get("build_info") == OWN_BACKEND
        self.client.reuse_after_stream = own  # llama-server closes a connection after a stream
        auto = self.settings.upstream_stream == "auto"
        self.streams = self.settings.upstream_stream == "on" or (
            auto and (not own or self.settings.type_through == "on")
        )
        # own backend, auto: streamed only where type-through may continue the request
        self.streams_for_reuse = auto and own

    def assembles(self, path: str, parsed: Body) -> bool:
        """A non-streaming completion is sent as a stream (assemble.py): llama-server notices
        a dropped streaming client at its next token, a non-streaming one only when another
        completion request arrives."""
        if self.streams_for_reuse and not eligible(path, parsed):
            return False
        return self.streams and assembles(path, parsed)

    def answers_at_start(self, path: str, parsed: Body) -> bool:
        """llama-server sends a stream's head when the task starts on its slot (after reading
        the body, tokenizing the prompt and queueing the task, all before the slot shows it
        busy). A stop before the head arrives waits for it, so that the confirmation never
        counts as stopped a task that is still on its way to the slot; a confirmation by two
        idle polls would, for a long prompt."""
        if not (self.own is False and self.confirms(path)) or not isinstance(parsed, dict):
            return False
        return parsed.get("stream") is True or self.assembles(path, parsed)

    def prepare_body(self, path: str, raw: bytes, parsed: Body, slot: int) -> bytes:
        if path in SLOT_ROUTES and isinstance(parsed, dict):
            raw = set_top_level(raw, "id_slot", slot, present="id_slot" in parsed)
            if self.assembles(path, parsed):
                raw = set_top_level(raw, "stream", True, present="stream" in parsed)
                if path in CHAT_ROUTES:  # the usage the whole answer has comes last
                    usage = {"include_usage": True}
                    raw = set_top_level(raw, "stream_options", usage, present=None)
        return raw

    def permits(self, path: str, parsed: Body, capacity: int) -> int:
        """Slots a gated request runs on at once.

        - Slot routes: the completions it asks for, read as llama-server reads it,
          ``json_value(data, "n_cmpl", json_value(data, "n", 1))``. A missing or null field
          gives the default; a number is cut to an int (2.7 -> 2, true -> 1); another type
          gives the default. Below 1 counts as 1 (the server refuses or ignores it). More
          than ``capacity`` is a 400 naming the field sent, as llama-server's own.
        - Embeddings (``/v1/embeddings``, ``/embedding``, ``/embeddings``): llama-server runs
          each input (``input``, else ``content``) as its own task on any free slot, so a
          batch of n inputs takes min(n, capacity) slots (the rest run as those free).
        - Reranking: one task per document (``documents``, else ``texts``), likewise.
        """
        if not isinstance(parsed, dict):
            return 1
        if path in EMBEDDING_ROUTES:
            return min(
                _inputs(parsed["input"] if "input" in parsed else parsed.get("content")), capacity
            )
        if path in RERANK_ROUTES:
            docs = parsed.get("documents")
            docs = docs if isinstance(docs, list) else parsed.get("texts")
            return min(max(1, len(docs)) if isinstance(docs, list) else 1, capacity)
        if path not in SLOT_ROUTES:
            return 1
        wanted = max(1, _json_int(parsed, "n_cmpl", _json_int(parsed, "n", 1)))
        if wanted <= capacity:
            return wanted
        field = "n_cmpl" if parsed.get("n_cmpl") is not None else "n"
        if self.slots is not None and capacity < self.slots:
            hint = f"--capacity is below the upstream's {self.slots} slots"
        elif self.slots is None and self.props_pending:
            hint = (
                "the upstream's slot count is not known yet (it was still loading): "
                "try again shortly"
            )
        else:
            hint = "the upstream has no more (llama-server: raise -np)"
        raise BadRequest(
            f"'{field}' = {wanted} needs {wanted} slots at once, llmproxy has {capacity}: {hint}"
        )

    def confirms(self, path: str) -> bool:
        """Only where ``id_slot`` pins the request to the permit's slot: llama-server runs an
        embeddings or rerank request on any free slot(s), so slot i idle would prove nothing."""
        return self.can_confirm and path in SLOT_ROUTES

    async def probe_slots(self) -> bool:
        """Is /slots available? Sets ``can_confirm``, and ``slots_pending`` while the answer
        may still change: no answer in time (llama-server answers /slots from its main
        loop, between decode steps), no connection, a 5xx (503 while loading). 404 and 501
        (``--no-slots``) and 401/403 (a key the proxy lacks) are final."""
        try:
            status, data = await get_json(self.session, self.probe_url("slots"))
        except (aiohttp.ClientError, TimeoutError):
            status, data = None, None
        was_pending = self.slots_pending
        ok = status == 200 and isinstance(data, list)
        self.can_confirm = ok
        self.slots_pending = not ok and (status is None or (status >= 500 and status != 501))
        if ok and was_pending:
            log.info("upstream /slots available now: stops are confirmed from here on")
        elif not ok and not was_pending:
            hint = "set upstream_api_key" if status in (401, 403) else None
            log.warning(
                "upstream /slots unavailable: "
                "cannot confirm stops, in-flight policy falls back to finish",
                status=status,
                asking_again=self.slots_pending,
                **({"hint": hint} if hint else {}),
            )
        return ok

    def pending(self) -> bool:
        return self.props_pending or (self.slots_pending and not self.can_confirm)

    def capacity_pending(self) -> bool:
        return self.props_pending

    async def refresh(self) -> None:
        if self.props_pending:
            try:
                status, props = await get_json(self.session, self.probe_url("props"))
            except (aiohttp.ClientError, TimeoutError):
                status, props = None, None
            if status == 200 and isinstance(props, dict):
                self.props_pending = False
                self.learn_props(props)
                await self.learn_models()
            elif status is not None and status < 500:  # will not change (404: no /props)
                self.props_pending = False
        if self.slots_pending and not self.can_confirm:
            await self.probe_slots()
