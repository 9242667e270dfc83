"""The raw floor for ``llmproxy bench overhead``: a TCP byte relay, no HTTP at all.

``python -m llmproxy.bench.overhead.splice --upstream URL`` accepts connections and gives
each one its own connection to the upstream's host and port, then copies bytes both ways
as they arrive (asyncio Protocols: no parsing, no buffering beyond the transports' own,
no per-request Python work at all). Its column in the bench is the cheapest any Python
proxy on this event loop could be: two more loopback hops and a wake-up of one more
process. Next to the aiohttp "floor" (forwarder.py) it separates what the loopback hop
costs on this machine from what the aiohttp server + client stack costs. A reference to
measure against, not a product path: it never runs outside the bench.

Concurrency contract: one ``_Pair`` per client connection, owning both transports. The
upstream connect runs in a task tracked in the server's set (cancelled on shutdown);
client bytes that arrive before it completes wait in a list (not flow-controlled: the
connect is one loopback round trip). An EOF from either side is passed on as a half-close
(``write_eof``) and the pair closes once both directions ended or either side's
connection is lost (``transport.close`` flushes what was written first). A side whose
peer's write buffer is full is paused (``pause_writing`` -> ``pause_reading``) until it
drains. SIGINT/SIGTERM stop the server and close every pair.
"""

from __future__ import annotations

import asyncio
from typing import cast

from pydantic_settings import SettingsConfigDict
from yarl import URL

from llmproxy.bench.child import ReferenceSettings, announce, run_child_main, stop_event


class SpliceSettings(ReferenceSettings):
    """Options of ``python -m llmproxy.bench.overhead.splice`` (env ``LLMPROXY_SPLICE_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_SPLICE_", frozen=True, extra="forbid")


class _Side(asyncio.Protocol):
    """One end of a pair: what it reads goes to the other end's transport."""

    def __init__(self, pair: _Pair) -> None:
        self.pair = pair
        self.transport: asyncio.Transport | None = None
        self.eof = False  # this end sent EOF (half-close): its reading direction is done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(
            asyncio.Transport, transport
        )  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.pair.forward(self, data)

    def eof_received(self) -> bool:
        self.pair.half_close(self)
        return True  # keep our transport open: the other direction may still be writing to it

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.close()

    def pause_writing(self) -> None:  # our transport is full: stop reading the other end
        self.pair.other(self).pause()

    def resume_writing(self) -> None:
        self.pair.other(self).resume()

    def pause(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


class _Pair:
    def __init__(self, registry: set[_Pair]) -> None:
        self.registry = registry  # the relay's open pairs: this one leaves it on close
        self.client = _Side(self)
        self.upstream = _Side(self)
        self.pending: list[bytes] | None = []  # client bytes before the upstream connected
        self.closed = False

    def other(self, side: _Side) -> _Side:
        return self.upstream if side is self.client else self.client

    def forward(self, side: _Side, data: bytes) -> None:
        if side is self.client and self.pending is not None:
            self.pending.append(data)
            return
        target = self.other(side).transport
        if target is not None and not target.is_closing():
            target.write(data)

    def half_close(self, side: _Side) -> None:
        """``side`` sent EOF: pass it on (after the pending bytes, if still connecting);
        the pair closes once both directions are done."""
        side.eof = True
        if self.client.eof and self.upstream.eof:
            self.close()
        elif not (side is self.client and self.pending is not None):
            target = self.other(side).transport
            if target is not None and not target.is_closing() and target.can_write_eof():
                target.write_eof()

    def connected(self) -> None:
        pending, self.pending = self.pending or [], None
        transport = self.upstream.transport
        assert transport is not None
        if self.closed:
            transport.close()
            return
        for data in pending:
            transport.write(data)
        if self.client.eof and transport.can_write_eof():
            transport.write_eof()

    def close(self) -> None:
        self.closed = True
        self.registry.discard(self)
        for side in (self.client, self.upstream):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()


class _Relay:
    """The server side: a pair per accepted connection, its connect task tracked."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.tasks: set[asyncio.Task[None]] = set()
        self.pairs: set[_Pair] = set()

    def accept(self) -> _Side:
        pair = _Pair(self.pairs)
        self.pairs.add(pair)
        task = asyncio.get_running_loop().create_task(self._connect(pair))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return pair.client

    async def _connect(self, pair: _Pair) -> None:
        try:
            await asyncio.get_running_loop().create_connection(
                lambda: pair.upstream, self.host, self.port
            )
        except Exception:  # refused, unreachable, or anything else: the client sees a close
            pair.close()
        else:
            pair.connected()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for pair in list(self.pairs):
            pair.close()


async def _serve(settings: SpliceSettings) -> None:
    upstream = URL(settings.upstream)
    if upstream.scheme != "http" or upstream.host is None or upstream.port is None:
        raise SystemExit(
            f"splice: --upstream must be an http:// URL with a host, got {settings.upstream!r}"
        )
    stop = stop_event()
    relay = _Relay(upstream.host, upstream.port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(relay.accept, settings.host, settings.port)
    try:
        announce(settings.port_file, server.sockets[0].getsockname()[1])
        await stop.wait()
    finally:
        server.close()
        relay.close()
        await server.wait_closed()
        if relay.tasks:
            await asyncio.wait(relay.tasks)


def main(argv: list[str] | None = None) -> int:
    return run_child_main(
        "llmproxy.bench.overhead.splice",
        "TCP byte relay (bench raw floor).",
        SpliceSettings,
        _serve,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
