"""llama.cpp ``llama-server`` (and llmproxy's own backend).

Permit i <-> slot i: ``id_slot`` is written into each gated body, so the proxy knows
exactly which slot runs which request. After a cancel (connection closed), the stop is
confirmed by polling ``GET /slots`` until slot i is idle, with an interval that backs off
from ``confirm_poll_min_s`` to ``confirm_poll_max_s``. If that takes longer than
``confirm_timeout_s`` the timeout is logged as an error and counted in metrics (never
silently), and the job ends with its slots quarantined (gate.py): ``watch_idle`` keeps
polling, backing off to ``QUARANTINE_POLL_MAX_S``, and gives each back once it shows idle,
so a request pinned to it never waits inside the server. Without ``/slots`` (``--no-slots``), the adapter
cannot confirm and the policies fall back to ``finish``; so do routes that carry no
``id_slot`` (embeddings, reranking), whose slot the proxy cannot know. An embeddings batch
(a rerank) runs one task per input (document) on any idle slots, so it holds
min(inputs, capacity) permits. Every route that runs on a slot is gated here
(``gated_routes``), llama-server's own embeddings, rerank and ``/v1/messages`` included.

``n_cmpl`` (alias ``n``; llama.vscode sends it) asks llama-server for that many completions
of one prompt, run at once on that many slots: the one ``id_slot`` names and, for the
others, the lowest idle ids (they cannot be pinned). Such a request holds that many
permits (``permits``), which the gate grants as ``id_slot``'s slot plus the lowest free
ones: the slots the server picks, since a free permit is an idle slot. Before it is sent,
``settle`` waits until the lower slots other requests hold are busy at the server (one
granted just before it may still be on its way) and swaps in lower slots freed meanwhile.
A stop is confirmed once all of its slots are idle. What is left is a narrower race (a
lower slot freed and granted again between ``settle`` and the arrival): the count of
generations still never exceeds the permits; only that other request waits in the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.routes import (
    EMBEDDING_ROUTES,
    GATED_ROUTES,
    LLAMACPP_GATED_ROUTES,
    RERANK_ROUTES,
    SLOT_ROUTES,
)
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.upstream.adapters.base import Adapter, get_json, log
from llmproxy.proxy.upstream.adapters.body import set_top_level
from llmproxy.proxy.upstream.assemble import assembles

QUARANTINE_POLL_MAX_S = 1.0


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


def slot_busy(entry: dict[str, Any]) -> bool:
    """Busy flag of one /slots entry (new builds: is_processing; old builds: state != 0)."""
    if "is_processing" in entry:
        return bool(entry["is_processing"])
    return bool(entry.get("state", 0))


class LlamaCppAdapter(Adapter):
    kind = "llamacpp"
    gated_routes = GATED_ROUTES | LLAMACPP_GATED_ROUTES  # every route that runs on a slot

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.props_pending = False  # slot count still to be read from /props (detection gave up)
        self.slots_pending = False  # /slots failed in a way that may pass (timeout, refused, 5xx)
        self.streams = (
            self.settings.upstream_stream != "off"
        )  # until /props says which server it is
        self.own: bool | None = None  # llmproxy's own backend? (None: /props not read yet)
        self.client.reuse_after_stream = False

    def learn_props(self, props: Any) -> None:
        """What /props tells: the slot count, and whether this is llmproxy's own backend,
        which notices a dropped non-streaming client itself (``upstream_stream`` auto)."""
        self.slots = total_slots(props)
        self.own = own = isinstance(props, dict) and props.get("build_info") == OWN_BACKEND
        self.client.reuse_after_stream = own  # llama-server closes a connection after a stream
        self.streams = self.settings.upstream_stream == "on" or (
            self.settings.upstream_stream == "auto" and not own
        )

    def assembles(self, path: str, parsed: Any) -> bool:
        """A non-streaming completion is sent as a stream (assemble.py): llama-server notices
        a dropped streaming client at its next token, a non-streaming one only when another
        completion request arrives."""
        return self.streams and assembles(path, parsed)

    def answers_at_start(self, path: str, parsed: Any) -> bool:
        """llama-server sends a stream's head when the task starts on its slot (after reading
        the body, tokenizing the prompt and queueing the task, all before the slot shows it
        busy). A stop before the head arrives waits for it, so that the confirmation never
        counts as stopped a task that is still on its way to the slot; a confirmation by two
        idle polls would, for a long prompt."""
        if not (self.own is False and self.confirms(path)) or not isinstance(parsed, dict):
            return False
        return parsed.get("stream") is True or self.assembles(path, parsed)

    def prepare_body(self, path: str, raw: bytes, parsed: Any, slot: int) -> bytes:
        if path in SLOT_ROUTES and isinstance(parsed, dict):
            raw = set_top_level(raw, "id_slot", slot, present="id_slot" in parsed)
            if self.assembles(path, parsed):
                raw = set_top_level(raw, "stream", True, present="stream" in parsed)
        return raw

    def permits(self, path: str, parsed: Any, capacity: int) -> int:
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
            hint = "the upstream's slot count is not known yet (it was still loading): try again shortly"
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
            status, data = await get_json(self.session, self.base_url / "slots")
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
                "upstream /slots unavailable: cannot confirm stops, in-flight policy falls back to finish",
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
                status, props = await get_json(self.session, self.base_url / "props")
            except (aiohttp.ClientError, TimeoutError):
                status, props = None, None
            if status == 200 and isinstance(props, dict):
                self.props_pending = False
                self.learn_props(props)
            elif (
                status is not None and status < 500
            ):  # an answer that will not change (404: no /props)
                self.props_pending = False
        if self.slots_pending and not self.can_confirm:
            await self.probe_slots()

    async def _busy_map(self) -> dict[int, bool] | str:
        """Slot id -> busy, from one GET /slots; else 'down' (connection refused: nothing
        can run) or 'unknown' (any other failure: a name that does not resolve, no file
        descriptors, a timeout say nothing about what runs there)."""
        try:
            status, data = await get_json(self.session, self.base_url / "slots")
        except aiohttp.ClientConnectorError as exc:  # refused: nothing listens, nothing runs
            return (
                "down" if isinstance(exc.os_error, ConnectionRefusedError) else "unknown"
            )  # DNS, EMFILE: unknown
        except (aiohttp.ClientError, TimeoutError):
            return "unknown"
        if status != 200:
            return "unknown"
        return {
            entry["id"]: slot_busy(entry)
            for entry in (data if isinstance(data, list) else ())
            if isinstance(entry, dict) and isinstance(entry.get("id"), int)
        }

    async def _slots_state(self, slots: Sequence[int]) -> str:
        """'busy' (any of ``slots``) | 'idle' (all) | 'down' | 'unknown'."""
        busy = await self._busy_map()
        if isinstance(busy, str):
            return busy
        if any(busy.get(slot) for slot in slots):
            return "busy"
        return "idle" if all(slot in busy for slot in slots) else "unknown"

    async def settle(self, gate: Gate, ticket: Ticket) -> None:
        """Before a request on several slots is sent, make the server's choice of slots for
        its extra completions (the lowest idle ones) the gate's: take lower free permits in
        exchange (``Gate.settle_extras``) and wait, polling /slots for at most
        ``settle_timeout_s``, until every lower slot another pinned request holds is busy
        at the server. A request granted just before this one but not there yet (a large
        body still on its way) would otherwise lose its slot to an extra completion and
        wait in the server's queue. A poll that finds them busy is trusted only if nothing
        changed in the gate meanwhile. Cancelled with the job (it runs in the job's
        transfer scope); a refused connection (server down) ends the wait at once."""
        s = self.settings

        def pinned(t: Ticket) -> bool:
            return t.route in SLOT_ROUTES

        if not pinned(ticket):
            return  # an embeddings batch: the server runs it on whichever slots are idle
        try:
            watch = gate.settle_extras(ticket, pinned)
            if not watch or not self.can_confirm or s.settle_timeout_s <= 0:
                return
            interval = s.confirm_poll_min_s
            async with asyncio.timeout(s.settle_timeout_s):
                while True:
                    before = (ticket.slots, watch)
                    busy = await self._busy_map()
                    if busy == "down":
                        return
                    watch = gate.settle_extras(ticket, pinned)
                    if not watch:
                        return
                    if (
                        isinstance(busy, dict)
                        and all(busy.get(slot) for slot in watch)
                        and (ticket.slots, watch) == before
                    ):
                        return
                    await asyncio.sleep(interval)
                    interval = min(interval * 2, s.confirm_poll_max_s)
        except TimeoutError:
            log.warning(
                "sending a request on several slots before the lower slots held by others "
                "were busy: an extra completion may take one of them",
                slots=list(ticket.slots),
            )
        finally:
            gate.settled(ticket)

    async def confirm_stopped(self, slots: Sequence[int], *, answered: bool = True) -> bool:
        """Poll /slots until every slot in ``slots`` is idle (backing off), bounded by confirm_timeout_s.

        Before the upstream answered, its task may not have reached the slot yet, so an idle
        slot must then be seen twice, one poll interval apart. A refused connection means
        the server is down and runs nothing: confirmed.
        """
        s = self.settings
        interval = s.confirm_poll_min_s
        idle_needed = 1 if answered else 2
        idle_seen = 0
        try:
            async with asyncio.timeout(s.confirm_timeout_s):
                while True:
                    state = await self._slots_state(slots)
                    if state == "down":
                        return True
                    idle_seen = idle_seen + 1 if state == "idle" else 0
                    if idle_seen >= idle_needed:
                        return True
                    await asyncio.sleep(interval)
                    interval = min(interval * 2, s.confirm_poll_max_s)
        except TimeoutError:
            log.error(
                "stop confirmation timed out: the slot stays out of the gate until /slots shows it idle",
                slots=list(slots),
                timeout_s=s.confirm_timeout_s,
            )
            return False

    async def watch_idle(
        self,
        slots: Sequence[int],
        idle: Callable[[int], None],
        closing: asyncio.Event,
        *,
        answered: bool = True,
    ) -> None:
        """Poll /slots (from ``confirm_poll_max_s``, backing off to ``QUARANTINE_POLL_MAX_S``)
        and call ``idle(slot)`` for each of ``slots`` once it shows idle (twice in a row when
        the upstream had not answered: see ``confirm_stopped``); all of them at once if the
        server refuses connections (down: nothing runs). Returns when none is left, or once
        ``closing`` is set. Cancelled with the job that runs it."""
        left = {slot: 0 for slot in slots}  # slot -> idle polls seen in a row
        needed = 1 if answered else 2
        interval = self.settings.confirm_poll_max_s
        while left and not closing.is_set():
            busy = await self._busy_map()
            for slot in list(left):
                if busy == "down" or (isinstance(busy, dict) and slot in busy and not busy[slot]):
                    left[slot] += 1
                else:
                    left[slot] = 0
                if busy == "down" or left[slot] >= needed:
                    del left[slot]
                    log.info("quarantined slot idle again: back in the gate", slot=slot)
                    idle(slot)
            if left:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await closing.wait()
                interval = min(
                    interval * 2, max(QUARANTINE_POLL_MAX_S, self.settings.confirm_poll_max_s)
                )
