"""What an exchange with the upstream yields (upstream/stream.py), in order: one ``Head``,
any number of ``Piece``s, then ``End``; or ``Failed`` at any point, after which nothing
follows. The upstream job reads them, and the relay writes them (writer.py).

Events of an event stream come framed where the job asked for it (sse.py): each ``Piece``
and the ``End`` carry the whole events they complete, parsed once for every reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from multidict import CIMultiDict

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.relay.sse import SseEvent


@dataclass(frozen=True, slots=True)
class Head:
    """The upstream's response head. ``headers``: as relayed to the client (hop-by-hop and
    proxy-owned ones left out); ``stream``: a 200 event stream; ``whole``: its body came
    with it (the ``End`` that follows carries all of it)."""

    status: int
    headers: CIMultiDict[str]
    content_length: int | None
    stream: bool
    whole: bool


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of the body as it came, and the events it completes (framed streams)."""

    data: bytes
    events: Sequence[SseEvent] = ()


@dataclass(frozen=True, slots=True)
class End:
    """The body was read to its end and the connection went back: the upstream is idle for
    this request. ``last``: the body's last piece (all of it for a ``whole`` one), not
    written yet; ``events``: those it completes, and one left without its blank line."""

    last: bytes
    events: Sequence[SseEvent] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """The exchange failed (the upstream unreachable, timed out, cut, malformed)."""

    error: ProxyError


Event = Head | Piece | End | Failed


@dataclass(slots=True)
class Timing:
    """When the exchange's parts came, in seconds from its start (telemetry): the first
    piece of body, the mean gap between pieces after it, and the end (or the failure)."""

    start: float = 0.0
    ttfb_s: float | None = None
    piece_gap_s: float | None = None
    total_s: float | None = None
