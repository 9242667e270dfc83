"""One HTTP exchange with the upstream, as typed events (relay/events.py).

``exchange_events`` sends the request through the adapter's ``UpstreamClient`` and yields
``Head``, then the body's ``Piece``s as they arrive (no buffering), then ``End`` once the
body was read to its end and the connection went back to the pool; or ``Failed`` with the
ProxyError a client exception maps to (client_errors.py: the one boundary), after which
nothing follows. A body that came whole with the head is all in ``End``; so is the last
piece of one that came in pieces, so that it goes out with the terminator.

Redirects are relayed, never followed: the proxy talks to the configured upstream only,
and what it sends there is what the gate admitted.

Concurrency contract: one task iterates the generator, inside ``contextlib.aclosing``. A
cancellation while it waits for the upstream, or the consumer leaving the loop early (an
exception, a stop at the head), closes the upstream connection at once: that close is how
a generation is cancelled. ``on_send`` is called just before the request's bytes are
handed to the connection.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Mapping

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.relay.events import End, Event, Failed, Head, Piece, Timing
from llmproxy.proxy.relay.sse import Framer
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.client_errors import map_client_errors
from llmproxy.proxy.upstream.headers import response_headers


async def exchange_events(
    adapter: Adapter,
    method: str,
    raw_path: str,
    headers: Mapping[str, str],
    body: bytes | None,
    *,
    on_send: Callable[[], None] | None = None,
    framer: Framer | None = None,
    timing: Timing | None = None,
) -> AsyncGenerator[Event]:
    """``method raw_path`` on the adapter's upstream, as events (see the module's docstring).

    ``framer``: frame a 200 event stream's body into ``SseEvent``s (relay/sse.py), carried
    by each ``Piece`` and the ``End``. ``timing``: filled in as the parts come."""
    timing = timing if timing is not None else Timing()
    start = timing.start = time.monotonic()
    last = b""
    failed: ProxyError | None = None
    frame: Framer | None = None
    try:
        with map_client_errors():
            async with adapter.client.exchange(method, raw_path, headers, body, on_send) as resp:
                content = resp.content
                head = response_headers(resp.headers, adapter.base_url)
                stream = resp.status == 200 and head.get("Content-Type", "").startswith(
                    "text/event-stream"
                )
                whole = content.is_eof()
                frame = framer if stream else None
                yield Head(resp.status, head, resp.content_length, stream, whole)
                if whole:
                    last = content.read_nowait()
                else:
                    pieces = 0
                    async for data in content.iter_any():
                        now = time.monotonic()
                        if timing.ttfb_s is None:
                            timing.ttfb_s = now - start
                        else:  # the mean gap since the first piece: about a token's time
                            timing.piece_gap_s = (now - start - timing.ttfb_s) / pieces
                        pieces += 1
                        if content.is_eof():  # the last piece: it goes out with the terminator
                            last = data
                            break
                        yield Piece(data, frame.feed(data) if frame is not None else ())
    except ProxyError as exc:
        failed = exc
    finally:
        timing.total_s = time.monotonic() - start  # to the end, or to the failure
    if failed is not None:
        yield Failed(failed)
        return
    # The connection is back in the pool: the upstream is done with this request.
    if timing.ttfb_s is None and last:
        timing.ttfb_s = timing.total_s
    yield End(last, frame.feed(last) + frame.flush() if frame is not None else ())
