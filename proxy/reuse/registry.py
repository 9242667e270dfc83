"""Each session's latest generation (type-through).

``Generations.begin`` records the generation a session's newest request starts (replacing
the session's previous one); ``Generations.follow`` decides whether a new request of the
session continues it and, when the user typed ahead of the model, waits until its text
confirms or contradicts what was typed.

Twins (proxy/twins.py: the session's requests with equal bodies at the same time) are one
keystroke: a twin's arrival makes none of its siblings stale. A generation answers no twin
of a request it answers (or that waits on it): they asked for different samples, so the
twin goes through the gate for its own. A twin of the generation's own request never
continues it anyway (it typed nothing).

Concurrency contract: event loop thread only. ``follow`` blocks only while the user typed
ahead of the model, until the next piece of text or the generation's end; its caller
cancels it when its client leaves. Nothing here starts a task or holds a permit.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmproxy.proxy.errors import SUPERSEDED, Superseded
from llmproxy.proxy.relay.assemble import OAI_ROUTES
from llmproxy.proxy.request import Body
from llmproxy.proxy.reuse.generation import Generation
from llmproxy.proxy.reuse.match import typed
from llmproxy.proxy.routes import eligible
from llmproxy.proxy.twins import twin_key, twins


@dataclass(frozen=True, slots=True)
class Follow:
    """A request answered from ``generation``: its text after the first ``skip`` characters,
    for as long as its ``turn`` is the generation's newest (``Generation.readers``).
    ``stale()``: a newer request of its session has arrived since it did."""

    generation: Generation
    skip: int
    turn: int
    stale: Callable[[], bool]


@dataclass(frozen=True, slots=True)
class Waited:
    """No continuation, after the request waited on the generation (the output contradicted
    what it typed, or ended short): it goes through the gate at the head of the queue, the
    place it would have had had it queued when it came."""


class Generations:
    """The latest generation per session, at most ``max_sessions`` (least recently started
    first out); a finished one is kept ``ttl_s`` (expired ones are dropped as new ones
    begin). Each holds its events, so memory is bounded by ``max_sessions`` generations."""

    def __init__(self, ttl_s: float, grace_s: float = 0.0, max_sessions: int = 256) -> None:
        self.ttl_s, self.grace_s, self.max_sessions = ttl_s, grace_s, max_sessions
        self._latest: OrderedDict[str, Generation] = OrderedDict()
        # each session's newest request, by arrival number (as many sessions, least recent out)
        self._arrivals = itertools.count(1)
        # each session's newest keystroke: (arrival of its first twin, twin key)
        self._newest: OrderedDict[str, tuple[int, str | None]] = OrderedDict()

    def start(
        self,
        session: str,
        route: str,
        body: Body,
        *,
        streamed: bool,
        on_orphaned: Callable[[], None],
        on_superseded: Callable[[], None],
        on_joined: Callable[[str | None], None] | None = None,
    ) -> Generation | None:
        """The generation a request of ``session`` starts, recorded as the session's latest;
        None when it cannot be continued (its route or body, or an answer that will not be
        an event stream: ``streamed`` says the proxy asks for one where the client did not).
        A request that cannot be continued still ends the session's previous generation's
        turn: it is forgotten."""
        stream = isinstance(body, dict) and body.get("stream") is True
        if not eligible(route, body) or not (stream or streamed):
            self._latest.pop(session, None)
            return None
        generation = Generation(
            route,
            body,
            oai=route in OAI_ROUTES,
            stream=stream,
            grace_s=self.grace_s,
            on_orphaned=on_orphaned,
            on_superseded=on_superseded,
            on_joined=on_joined,
        )
        self.begin(session, generation)
        return generation

    def __len__(self) -> int:
        return len(self._latest)

    def begin(self, session: str, generation: Generation) -> None:
        """``generation`` is the session's newest; the previous one is forgotten."""
        self._latest.pop(session, None)
        now = time.monotonic()
        while self._latest:  # the oldest first: drop those expired
            oldest = next(iter(self._latest.values()))
            if not (oldest.done and oldest.expired(self.ttl_s, now)):
                break
            self._latest.popitem(last=False)
        self._latest[session] = generation
        while len(self._latest) > self.max_sessions:
            self._latest.popitem(last=False)

    def latest(self, session: str) -> Generation | None:
        generation = self._latest.get(session)
        if generation is not None and generation.expired(self.ttl_s, time.monotonic()):
            del self._latest[session]
            return None
        return generation

    async def follow(
        self, session: str, route: str, body: Body, key: str | None = None
    ) -> Follow | Waited | None:
        """A ``Follow`` (the generation joined) when ``body`` continues the session's latest
        generation: the user typed ``d`` and the generation wrote ``d``. While it has written
        less than ``d`` (typing ahead), keeps it running and waits for more. Otherwise the
        caller goes through the gate, superseding it: None, or ``Waited`` (the queue's head)
        once it waited and the generation wrote something else or ended short. A generation
        that ended answers only while it has something left to say: its whole text typed,
        it continues it only if it stopped by itself (``Generation.said_all``). Raises
        ``Superseded`` instead when a newer request of the session arrived while this one
        waited: this one is stale, and going through the gate after the newer one would
        supersede it. ``key``: the request's twin key (twins.py), if it was computed."""
        key = key if key is not None else twin_key(route, body)
        arrival = self._arrive(session, key)
        generation = self.latest(session)
        if generation is None or generation.route != route or generation.error is not None:
            return None
        if key is not None and key in generation.followers:
            return None  # its twin reads this generation: it gets a sample of its own
        options = typed(route, generation.body, body)
        if options and key is not None:
            generation.followers.add(key)
        kept = False  # this request keeps the generation running while it waits
        try:
            while (d := _written(generation.text, options)) is None:
                # typing ahead of the model, also while it still reads its prompt: that
                # read is not cut short by a stop either (llama-server, llmproxy's backend),
                # and what the user types next is what the model is there to predict
                options = tuple(x for x in options if x.startswith(generation.text))
                if generation.done or not options:
                    self._raise_if_stale(session, arrival)
                    return Waited() if kept else None
                if not kept:
                    generation.keep()
                    kept = True
                await generation.changed()
            # cut before it wrote past what was typed, typed to the end of a generation that
            # stopped at its limit (a request of its own writes more), or replaced meanwhile
            if (
                (generation.error is not None and len(generation.text) <= len(d))
                or (generation.done and len(generation.text) == len(d) and not generation.said_all)
                or self._latest.get(session) is not generation
            ):
                self._raise_if_stale(session, arrival)
                return Waited() if kept else None
            stale = functools.partial(self.stale, session, arrival)
            return Follow(generation, len(d), generation.join(key), stale)
        finally:
            if kept:
                generation.leave()

    def _arrive(self, session: str, key: str | None) -> int:
        """Number a request of ``session`` whose twin key is ``key``; a twin of the
        session's newest keystroke joins it (the keystroke keeps its first arrival)."""
        arrival = next(self._arrivals)
        newest = self._newest.pop(session, None)
        if newest is None or not twins(newest[1], key):
            newest = (arrival, key)
        self._newest[session] = newest
        while len(self._newest) > self.max_sessions:
            self._newest.popitem(last=False)
        return arrival

    def stale(self, session: str, arrival: int) -> bool:
        """Has a newer keystroke of ``session`` (a request that is not a twin of the one
        numbered ``arrival``) arrived since that one?"""
        first, _ = self._newest.get(session, (arrival, None))
        return first > arrival

    def _raise_if_stale(self, session: str, arrival: int) -> None:
        """Not a continuation: the request goes through the gate, unless it is stale."""
        if self.stale(session, arrival):
            raise Superseded(SUPERSEDED)


def _written(text: str, options: tuple[str, ...]) -> str | None:
    """The ``d`` among ``options`` that ``text`` begins with (rotations of one another, so
    at most one fits once the text is as long as they are)."""
    return next((d for d in options if text.startswith(d)), None)
