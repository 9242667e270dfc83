"""Reading a response the way editor clients do: to its end, noting whether it ended whole.

A stream the proxy ends with its error event on a completion route is cut after it, without
its terminator (proxy/relay/error_event.py): aiohttp then raises ``ClientPayloadError``
where a client would see a transfer error (curl exits 18).
"""

from __future__ import annotations

import aiohttp


async def read_all(resp: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """The body as read, and whether it ended with its terminator (else ``resp`` is
    closed)."""
    data = bytearray()
    try:
        async for chunk in resp.content.iter_any():
            data += chunk
    except aiohttp.ClientPayloadError:
        resp.close()  # its connection is broken: never back to the pool
        return bytes(data), False
    return bytes(data), True
