"""One HTTP exchange with the upstream, as the event stream the relay understands.

``upstream_events`` sends the request through the adapter's ``UpstreamClient`` and yields
``Headers``, then one ``Chunk`` per piece of body as it arrives (no buffering), then
``End``; a body that arrived whole with the head is one ``Chunk``, yielded after the
connection went back to the pool. Client exceptions are mapped to ProxyErrors here (``map_client_errors``) and
raised, not yielded: the caller decides whether they become an HTTP error or an
in-stream error event. Close it with ``contextlib.aclosing`` so that a consumer that
stops early closes the upstream connection at once (that close is how a generation is
cancelled). Redirects are relayed, never followed: the proxy talks to the configured
upstream only, and what it sends there is what the gate admitted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

from llmproxy.proxy.adapters.base import Adapter
from llmproxy.proxy.channel import Chunk, End, Event, Headers
from llmproxy.proxy.errors import map_client_errors
from llmproxy.proxy.headers import response_headers


async def upstream_events(
    adapter: Adapter, method: str, raw_path: str, headers: Mapping[str, str], body: bytes | None,
    on_send: Callable[[], None] | None = None,
) -> AsyncIterator[Event]:
    """``method raw_path`` on the adapter's upstream, through its client, as events
    (``on_send``: see ``UpstreamClient.exchange``)."""
    whole: bytes | None = None
    with map_client_errors():
        async with adapter.client.exchange(method, raw_path, headers, body, on_send) as resp:
            head = Headers(resp.status, response_headers(resp.headers, adapter.base_url), resp.content_length)
            if resp.content.is_eof():  # the whole body came with the head (a non-streamed answer)
                whole = resp.content.read_nowait()
            else:
                yield head
                async for data in resp.content.iter_any():
                    yield Chunk(data)
    if whole is not None:  # the connection is back in the pool already
        yield head
        if whole:
            yield Chunk(whole)
    yield End()
