"""What a job needs of type-through (proxy/reuse/): the upstream side's protocols.

A job whose request may be continued by later keystrokes records its event stream in a
``Listener`` that a ``Recorder`` starts for it (the app's type-through registry, passed in
by the HTTP layer; None when type-through is off or the request cannot be continued). The
upstream side depends on these protocols only, never on proxy/reuse/.

Concurrency contract: event loop thread only; nothing here blocks, starts a task or holds
a permit. The job owns the calls: ``take`` with the events of each piece of the upstream's
body as it arrives, ``end`` when it ended (the first call counts, later ones are no-ops), ``leave``
once when its own client reads the generation no more. The recorder owns the callbacks it
is given and calls them from the loop: ``on_orphaned`` when no reader is left (after its
grace), ``on_superseded`` when a later keystroke continues the generation, ``on_joined``
with each new reader's twin key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.relay.sse import SseEvent
from llmproxy.proxy.request import Body


class Listener(Protocol):
    """The record of one generation, as its job feeds and ends it."""

    @property
    def done(self) -> bool:
        """Ended: by its upstream, a stop or an error."""
        ...

    @property
    def events(self) -> Sequence[object]:
        """The events recorded so far (empty: no event stream came)."""
        ...

    def take(self, events: Iterable[SseEvent]) -> None:
        """Whole events of the upstream's event stream, as they arrive (shared: read only)."""

    def end(self, error: ProxyError | None = None) -> None:
        """The generation ended, complete (``error`` None) or not; the first call counts."""

    def leave(self) -> None:
        """One reader (the job's own client) reads it no more."""


class Recorder(Protocol):
    """Starts the record of a request's generation (the type-through registry)."""

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
    ) -> Listener | None:
        """The listener for a request of ``session`` on ``route`` with ``body``, recorded as
        the session's latest generation; None when it cannot be continued (``streamed``: the
        proxy asks the upstream for an event stream where the client did not)."""
