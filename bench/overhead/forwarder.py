"""The floor for ``llmproxy bench overhead``: a featureless aiohttp forwarder.

``python -m llmproxy.bench.overhead.forwarder --upstream URL`` forwards every request to
the upstream with the same aiohttp server settings, upstream client
(proxy/upstream/client.py) and event loop (``--loop``) the proxy uses, and relays the
response chunk by chunk, with none of the proxy's work: no gate, no permits, no sessions,
no job task, no metrics, no logging, no header filtering beyond the bare minimum. It
writes like the proxy's relay (a body that arrived whole in one send; a last chunk with
the terminator), so the two differ only in the proxy's own work. The bench measures it
next to the proxy in the same run, so the table shows how much of the added latency is the
proxy's and how much is the stack's (two more loopback hops through an aiohttp server and
client) on this machine. A reference to measure against, not a product path: it never runs
outside the bench.

Concurrency contract: one handler task per request, which owns its upstream exchange
(its connection is closed when the handler is cancelled by a client disconnect). The
event loop owns the server and the one UpstreamClient; SIGINT/SIGTERM stop both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from pydantic_settings import SettingsConfigDict
from yarl import URL

from llmproxy.bench.child import ReferenceSettings, announce, run_child_main, stop_event
from llmproxy.proxy.upstream.client import UpstreamClient

CLIENT = web.AppKey("client", UpstreamClient)
UPSTREAM = web.AppKey("upstream", URL)


class ForwarderSettings(ReferenceSettings):
    """Options of ``python -m llmproxy.bench.overhead.forwarder`` (env ``LLMPROXY_FORWARDER_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_FORWARDER_", frozen=True, extra="forbid")


async def _forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/octet-stream")}
    async with request.app[CLIENT].exchange(request.method, request.raw_path, headers, body) as up:
        out = {"Content-Type": up.headers.get("Content-Type", "")}
        if up.content.is_eof():  # the whole body is here: one send, as the proxy's relay does
            return web.Response(status=up.status, headers=out, body=up.content.read_nowait())
        resp = web.StreamResponse(status=up.status, headers=out)
        if up.content_length is not None:
            resp.content_length = up.content_length
        await resp.prepare(request)
        async for data in up.content.iter_any():
            if up.content.is_eof():  # last chunk and terminator together, as the proxy's relay
                await resp.write_eof(data)
                return resp
            await resp.write(data)
        await resp.write_eof()
        return resp


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    client = UpstreamClient(app[UPSTREAM], connect_timeout_s=5, read_timeout_s=600)  # as the proxy
    app[CLIENT] = client
    yield
    client.close()


async def _serve(settings: ForwarderSettings) -> None:
    stop = stop_event()
    app = web.Application()
    app[UPSTREAM] = URL(settings.upstream)
    app.cleanup_ctx.append(_client_ctx)
    app.router.add_route("*", "/{tail:.*}", _forward)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        announce(settings.port_file, runner.addresses[0][1])
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    description = "Featureless aiohttp forwarder (bench floor)."
    return run_child_main(
        "llmproxy.bench.overhead.forwarder", description, ForwarderSettings, _serve, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
