"""llama.cpp ``llama-server`` (and llmproxy's own backend): its slot view.

Permit i <-> slot i (the dialect writes ``id_slot`` into each body: dialects/llamacpp.py),
so a stop is confirmed from ``GET /slots`` (slots.py: confirmation, quarantine, and the look
that settles a request on several slots: settle.py). Without ``/slots`` (``--no-slots``),
the adapter cannot confirm and the policies fall back to ``finish``; so do routes that carry
no ``id_slot`` (embeddings, reranking), whose slot the proxy cannot know.

What ``/props`` tells (the slot count; llmproxy's own backend or a llama-server) is read at
detection or, for a server still loading then, by the watcher (``refresh``); the dialect is
built again from it (``learn_props``).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from llmproxy.proxy.gating.routes import SLOT_ROUTES
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import get_json, log
from llmproxy.proxy.upstream.adapters.listing import RouterModel
from llmproxy.proxy.upstream.adapters.slots import SlotPollingAdapter
from llmproxy.proxy.upstream.dialects.llamacpp import LlamaCppDialect


def total_slots(props: Any) -> int | None:
    """``total_slots`` of a /props answer, if it is a usable count."""
    slots = props.get("total_slots") if isinstance(props, dict) else None
    return slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None


OWN_BACKEND = "llmproxy-backend"  # /props build_info of llmproxy's own backend


class LlamaCppAdapter(SlotPollingAdapter):
    kind = "llamacpp"

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
        self.client.reuse_after_stream = False
        #: a llama-server in router mode: its models (router.py), run as members of their own
        self.router: list[RouterModel] | None = None
        self.router_max: int | None = None  # ... and how many it runs at once (--models-max)

    def initial_dialect(self) -> LlamaCppDialect:
        """Until /props says which server it is: streamed where ``upstream_stream`` allows."""
        return LlamaCppDialect(streams=self.settings.upstream_stream != "off")

    def learn_props(self, props: Any) -> None:
        """What /props tells: the slot count, and whether this is llmproxy's own backend,
        into a new dialect. ``upstream_stream`` auto streams on llama-server (for its
        stops) and, with type-through on, on llmproxy's own backend too, whose stops need
        no stream but whose text type-through reads as it is generated."""
        self.slots = total_slots(props)
        own = isinstance(props, dict) and props.get("build_info") == OWN_BACKEND
        self.client.reuse_after_stream = own  # llama-server closes a connection after a stream
        self.dialect = self.dialect_for(own)

    def dialect_for(self, own: bool) -> LlamaCppDialect:
        """The dialect for a llama-server (``own`` False) or llmproxy's own backend."""
        s = self.settings
        auto = s.upstream_stream == "auto"
        return LlamaCppDialect(
            streams=s.upstream_stream == "on" or (auto and (not own or s.type_through == "on")),
            own=own,
            # own backend, auto: streamed only where type-through may continue the request
            streams_for_reuse=auto and own,
        )

    def short_of_slots(self, capacity: int) -> str:
        if self.slots is not None and capacity < self.slots:
            return f"--capacity is below the upstream's {self.slots} slots"
        if self.slots is None and self.props_pending:
            return (
                "the upstream's slot count is not known yet (it was still loading): "
                "try again shortly"
            )
        return "the upstream has no more (llama-server: raise -np)"

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
