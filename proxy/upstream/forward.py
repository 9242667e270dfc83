"""One HTTP exchange with the upstream, written to the client as it arrives.

``forward`` sends the request through the adapter's ``UpstreamClient`` and writes the
response through a ``Responder`` (responder.py): a body that arrived whole with the head goes
out in one write, after the connection went back to the pool; otherwise the head at once,
then each piece of body as it arrives (no buffering). Client exceptions are mapped to
ProxyErrors here (``map_client_errors``) and raised: the caller decides whether they become
an HTTP error or an in-stream error event. Writes to the client never raise (see responder.py),
so whatever is raised comes from the upstream. A cancellation closes the upstream
connection at once (that close is how a generation is cancelled). Redirects are relayed,
never followed: the proxy talks to the configured upstream only, and what it sends there
is what the gate admitted.

A request the proxy turned into a stream (assemble.py) is read to its end, then its
non-streaming form goes out whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.assemble import CONTENT_TYPE, Assembler
from llmproxy.proxy.upstream.client_errors import map_client_errors
from llmproxy.proxy.upstream.headers import response_headers
from llmproxy.proxy.upstream.responder import Responder
from llmproxy.proxy.upstream.resume import Framed


async def forward(
    adapter: Adapter,
    method: str,
    raw_path: str,
    headers: Mapping[str, str],
    body: bytes | None,
    out: Responder | Framed,
    rec: RequestRecord,
    on_end: Callable[[], None] | None = None,
    on_head: Callable[[], None] | None = None,
    assembler: Assembler | None = None,
    observe: Callable[[bytes], None] | None = None,
) -> None:
    """``method raw_path`` on the adapter's upstream, its response written through ``out``.

    Records on ``rec``: the request handed to the connection (``mark_sent``), the upstream's
    status, time to its first body byte and to its end. ``on_head`` is called when the
    upstream's response head arrived, before anything is written (it may raise
    CancelledError: the exchange then ends there and its connection is closed). ``on_end`` is
    called once the upstream's body was read to its end, before its last bytes are written
    to the client (the upstream is idle for this request from then on, however slow the
    client).

    ``assembler``: the request was sent with ``stream: true`` for a client that did not ask
    for a stream (assemble.py). An event stream (200, ``text/event-stream``) is fed to it and
    its rendering written in one piece once the upstream's body ended; any other answer (an
    error the upstream gave before streaming) is relayed as it came.

    ``observe``: called with each piece of a 200 event stream's body as it is read, before
    it is written (type-through records the generation with it). Never for other answers.

    ``out`` may be a resumable stream's ``Framed`` writer (resume.py): a continuation's head
    is then not written again, and its body, come whole, goes out as the stream's end."""
    start = time.monotonic()
    last: bytes | None = None  # the body's last piece (all of it, if it came whole with the head)
    assembled = False
    try:
        with map_client_errors():
            async with adapter.client.exchange(
                method, raw_path, headers, body, rec.mark_sent
            ) as resp:
                status, content = resp.status, resp.content
                rec.upstream_status = status
                if on_head is not None:
                    on_head()
                head = response_headers(resp.headers, adapter.base_url)
                events = status == 200 and head.get("Content-Type", "").startswith(
                    "text/event-stream"
                )
                seen = observe if events else None
                if assembler is not None and events:
                    assembled, pieces = True, 0
                    async for data in content.iter_any():
                        now = time.monotonic()
                        if rec.upstream_ttfb_s is None:
                            rec.upstream_ttfb_s = now - start
                        else:  # as below: the permit hold after a cut stream follows it
                            rec.piece_gap_s = (now - start - rec.upstream_ttfb_s) / pieces
                        pieces += 1
                        assembler.feed(data)
                        if seen is not None:
                            seen(data)
                elif content.is_eof():  # a non-streamed answer, or a stream that came whole
                    last = content.read_nowait()
                    if seen is not None:
                        seen(last)
                else:
                    await out.head(status, head, resp.content_length)
                    pieces = 0
                    async for data in content.iter_any():
                        now = time.monotonic()
                        if rec.upstream_ttfb_s is None:
                            rec.upstream_ttfb_s = now - start
                        else:  # the mean gap since the first piece: about a token's time
                            rec.piece_gap_s = (now - start - rec.upstream_ttfb_s) / pieces
                        pieces += 1
                        if seen is not None:
                            seen(data)
                        if content.is_eof():  # the last piece: it goes out with the terminator
                            last = data
                            break
                        await out.piece(data)
                    else:
                        last = b""
    finally:
        rec.upstream_s = time.monotonic() - start  # to the end, or to the failure
    # The connection is back in the pool: the upstream is done with this request.
    if rec.upstream_ttfb_s is None and last:
        rec.upstream_ttfb_s = rec.upstream_s
    if on_end is not None:
        on_end()
    if assembled:
        assert assembler is not None
        status, payload = assembler.render()  # or UpstreamFailed: the stream had no end
        head["Content-Type"] = CONTENT_TYPE
        await out.whole(status, head, payload)
    elif out.started:
        await out.end(last or b"")
    elif last:
        await out.whole(status, head, last)
    else:  # no body (HEAD, 204, an empty answer): the head keeps the upstream's framing
        await out.head(status, head, resp.content_length)
        await out.end()
