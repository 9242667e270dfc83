"""WaitList: the FIFO wait queue of a gate or a pool, which keeps a departed waiter's place.

Editors close a keystroke's request before they send the next one (Continue, llm-ls, twinny:
by up to their debounce, 150-350 ms). Were the closed request's place simply dropped, the
next keystroke would join the tail, and an editor typing a burst would wait behind every
editor that joined after it, at each keystroke. So a supersedable waiter that leaves the
queue without a grant (its client left, or its wait timed out) leaves a *hold* at its
position for its session, for ``hold_s``: the session's next supersedable request takes the
hold's position instead of the tail, as it would take the place of a request still queued.

Twins (proxy/twins.py: the session's requests with equal bodies) never take each other's
places: ``place_of`` and ``take_place`` pass over a waiter that is the newcomer's twin, and
``rivals`` lists the session's waiters that are not, all of which a newcomer supersedes.

A hold is not a waiter: it is never granted, never counted in ``len``, never blocks the
waiters behind it and never keeps its owner quiescent-busy. Holds expire after ``hold_s``
and there are at most ``max_holds`` (the oldest goes first), so the list stays bounded.

Pure data, event loop thread only; the owner (Gate or Pool) decides admission and grants.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from llmproxy.proxy.twins import twins


class Waiter(Protocol):
    session: str
    supersedable: bool
    twin: str | None


W = TypeVar("W", bound=Waiter)


@dataclass(slots=True)
class _Hold:
    session: str
    until: float


class WaitList(Generic[W]):
    def __init__(
        self, hold_s: float, max_holds: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hold_s, self.max_holds, self._clock = hold_s, max(0, max_holds), clock
        self._items: list[W | _Hold] = []
        self._waiters = 0

    def __len__(self) -> int:
        """Waiters (holds do not count)."""
        return self._waiters

    def __iter__(self) -> Iterator[W]:
        return (w for w in self._items if not isinstance(w, _Hold))

    def __contains__(self, waiter: object) -> bool:
        return any(w is waiter for w in self._items)

    @property
    def holds(self) -> int:
        return len(self._items) - self._waiters

    def places(self) -> list[tuple[str, W | None]]:
        """Read-only, in queue order: (session, waiter) per waiter, (session, None) per live
        hold (for the status page; changes nothing)."""
        now = self._clock()
        return [
            (w.session, None) if isinstance(w, _Hold) else (w.session, w)
            for w in self._items
            if not isinstance(w, _Hold) or w.until > now
        ]

    def head(self) -> W | None:
        """The first waiter (expired holds before it are dropped)."""
        self._expire()
        for w in self._items:
            if not isinstance(w, _Hold):
                return w
        return None

    def pop_head(self) -> W:
        head = self.head()
        assert head is not None
        self._drop(head)
        return head

    def append(self, waiter: W) -> None:
        self._items.append(waiter)
        self._waiters += 1

    def push_front(self, waiter: W) -> None:
        self._items.insert(0, waiter)
        self._waiters += 1

    def place_of(self, session: str, twin: str | None = None) -> tuple[bool, W | None]:
        """Whether ``session`` has a place here for a newcomer with twin key ``twin`` (a
        supersedable waiter that is not its twin, also one whose waiter is leaving, or a
        live hold), and that waiter if it is one."""
        self._expire()
        for w in self._items:
            if _place_for(w, session, twin):
                return True, None if isinstance(w, _Hold) else w
        return False, None

    def take_place(self, session: str, newcomer: W, twin: str | None = None) -> W | None:
        """Put ``newcomer`` at ``session``'s place (see ``place_of``, which must have found
        one); returns the waiter it replaces, if it was one (a hold is just gone)."""
        for i, w in enumerate(self._items):
            if _place_for(w, session, twin):
                self._items[i] = newcomer
                if isinstance(w, _Hold):
                    self._waiters += 1
                    return None
                return w
        raise LookupError(session)

    def rivals(self, session: str, twin: str | None = None) -> list[W]:
        """The session's supersedable waiters that are not twins of a newcomer with key
        ``twin``: those it supersedes."""
        return [w for w in self._items if not isinstance(w, _Hold) and _place_for(w, session, twin)]

    def drop_hold(self, session: str) -> None:
        """The session got a grant without queueing: its hold is no longer needed."""
        self._items = [w for w in self._items if not _held_for(w, session)]

    def remove(self, waiter: W) -> None:
        """``waiter`` left without a grant: a supersedable one leaves a hold in its place."""
        i = self._index(waiter)
        self._waiters -= 1
        if not (waiter.supersedable and self.hold_s > 0 and self.max_holds > 0):
            del self._items[i]
            return
        self._items[i] = _Hold(waiter.session, self._clock() + self.hold_s)
        if self.holds > self.max_holds:
            held = [(h.until, j) for j, h in enumerate(self._items) if isinstance(h, _Hold)]
            del self._items[min(held)[1]]

    def discard(self, waiter: W) -> None:
        """``waiter`` leaves, and its place with it (granted, superseded, shut down)."""
        self._drop(waiter)

    def clear(self) -> list[W]:
        """Empty the list; returns the waiters."""
        waiters = list(self)
        self._items, self._waiters = [], 0
        return waiters

    def _drop(self, waiter: W) -> None:
        del self._items[self._index(waiter)]
        self._waiters -= 1

    def _index(self, waiter: W) -> int:
        for i, w in enumerate(self._items):
            if w is waiter:
                return i
        raise ValueError("not waiting here")

    def _expire(self) -> None:
        if self._waiters == len(self._items):
            return
        now = self._clock()
        self._items = [w for w in self._items if not isinstance(w, _Hold) or w.until > now]


def _place_for(item: Waiter | _Hold, session: str, twin: str | None) -> bool:
    """Is ``item`` a place of ``session`` a newcomer with key ``twin`` may take?"""
    if isinstance(item, _Hold):
        return item.session == session
    return item.supersedable and item.session == session and not twins(item.twin, twin)


def _held_for(item: object, session: str) -> bool:
    return isinstance(item, _Hold) and item.session == session
