"""Reading llama-server's ``GET /slots``: confirming stops, watching quarantined slots, and
the look at its slots that settles a request on several of them (settle.py).

``SlotPollingAdapter`` is the part of the llama.cpp adapter (llamacpp.py) that polls
``/slots`` (with the app's session, never the relay client): after a cancel (connection
closed) the stop is confirmed by polling until the request's slots are idle, with an interval
that backs off from ``confirm_poll_min_s`` to ``confirm_poll_max_s``. If that takes longer
than ``confirm_timeout_s`` the timeout is logged as an error and counted in metrics (never
silently), and the job ends with its slots quarantined (gate.py): ``watch_idle`` keeps
polling, backing off to ``QUARANTINE_POLL_MAX_S``, and gives each back once it shows idle,
so a request pinned to it never waits inside the server. A refused connection (the server
is down: nothing runs) counts as idle everywhere.

Concurrency contract: every method here runs in the job's task that needs it (in its
transfer scope for ``busy_map`` from settle.py, after it for the others) and is cancelled
with that job.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import aiohttp

from llmproxy.proxy.upstream.adapters.base import Adapter, BusyMap, get_json, log

QUARANTINE_POLL_MAX_S = 1.0


def slot_busy(entry: dict[str, Any]) -> bool:
    """Busy flag of one /slots entry (new builds: is_processing; old builds: state != 0)."""
    if "is_processing" in entry:
        return bool(entry["is_processing"])
    return bool(entry.get("state", 0))


class SlotPollingAdapter(Adapter):
    """An adapter whose backend lists its slots' state at ``GET /slots`` (llama-server's
    shape): slot i of the gate is slot i there."""

    lists_slots = True

    def gone(self, status: int, body: Any) -> bool:
        """Does a /slots answer other than 200 say that nothing runs (router.py: a model the
        router does not run now)?"""
        return False

    async def busy_map(self) -> BusyMap:
        """Slot id -> busy, from one GET /slots; else 'down' (connection refused: nothing
        can run) or 'unknown' (any other failure: a name that does not resolve, no file
        descriptors, a timeout say nothing about what runs there)."""
        try:
            status, data = await get_json(self.session, self.probe_url("slots"))
        except aiohttp.ClientConnectorError as exc:  # refused: nothing listens, nothing runs
            # anything else (a name that does not resolve, EMFILE) says nothing
            return "down" if isinstance(exc.os_error, ConnectionRefusedError) else "unknown"
        except (aiohttp.ClientError, TimeoutError):
            return "unknown"
        if status != 200:
            return "down" if self.gone(status, data) else "unknown"
        return {
            entry["id"]: slot_busy(entry)
            for entry in (data if isinstance(data, list) else ())
            if isinstance(entry, dict) and isinstance(entry.get("id"), int)
        }

    async def _slots_state(
        self, slots: Sequence[int]
    ) -> Literal["busy", "idle", "down", "unknown"]:
        """'busy' (any of ``slots``) | 'idle' (all) | 'down' | 'unknown'."""
        busy = await self.busy_map()
        if isinstance(busy, str):
            return busy
        if any(busy.get(slot) for slot in slots):
            return "busy"
        return "idle" if all(slot in busy for slot in slots) else "unknown"

    async def confirm_stopped(self, slots: Sequence[int], *, answered: bool = True) -> bool:
        """Poll /slots until every slot in ``slots`` is idle (backing off), bounded by
        ``confirm_timeout_s``.

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
                "stop confirmation timed out: "
                "the slot stays out of the gate until /slots shows it idle",
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
            busy = await self.busy_map()
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
