"""Driving one generation for the web layer, and the response pieces every route shares.

``Gen`` starts a request on the dispatcher and relays its events, collecting the text and
the final ``Done``/``Failed`` for the response builders in llama.py / openai.py.

Concurrency contract: the app runs with ``handler_cancellation=True``; when a client goes
away its handler is cancelled and ``Gen.__aexit__`` sends ``Cancel`` to the worker and
returns at once. On any other exit (normal or an exception) it also cancels a request
still running, then waits (up to 10 s) for the worker's ``Done`` so a response body
always ends after the worker finished with it. The slot stays ``is_processing`` in
/slots until that ``Done`` arrives (the dispatcher owns that bookkeeping).

SSE: ``sse_start`` prepares the stream, ``sse`` writes one ``data:`` event and
``sse_error`` the in-stream error event used after the first token. Every write has a
deadline (``write``: ``write_timeout_s``): a client that stops reading is dropped, so its
unsent events and connection are not held for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from aiohttp import web

from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams, Token
from llmproxy.backend.runtime.slots import Request
from llmproxy.backend.web.context import DISPATCHER, SETTINGS
from llmproxy.backend.web.errors import dumps, failed_body, failed_response

log = structlog.get_logger("llmproxy.backend.web")
STOP_TYPE = {"eos": "eos", "limit": "limit", "time": "limit", "word": "word", "cancelled": "none"}
FINISH = {"eos": "stop", "word": "stop", "limit": "length", "time": "length", "cancelled": "stop"}


class Gen:
    """Runs one request; tracks the text and final event for the response builders."""

    def __init__(
        self,
        request: web.Request,
        prompt: Prompt,
        params: SamplingParams,
        id_slot: int,
        req: Request | None = None,
    ) -> None:
        """``req``: a request already started on its slot (``Dispatcher.start_requests``)."""
        self.http = request
        self.dispatcher = request.app[DISPATCHER]
        self.prompt = prompt
        self.params = params
        self.id_slot = id_slot
        self.req: Request | None = req
        self.content: list[str] = []
        self.done: Done | None = None
        self.failed: Failed | None = None

    async def __aenter__(self) -> Gen:
        if self.req is None:
            self.req = await self.dispatcher.start_request(self.prompt, self.params, self.id_slot)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        req = self.req
        if req is None or req.finished:
            return
        self.dispatcher.cancel(req)
        if exc_type is None or not issubclass(exc_type, asyncio.CancelledError):
            # still here (not a client that left): end the body only once the worker stopped
            try:
                await asyncio.wait_for(req.done_event.wait(), 10.0)
            except (TimeoutError, asyncio.CancelledError):
                pass

    async def events(self) -> Any:
        assert self.req is not None
        async for ev in self.req.events():
            if isinstance(ev, Token):
                self.content.append(ev.text)
            elif isinstance(ev, Done):
                self.done = ev
            elif isinstance(ev, Failed):
                self.failed = ev
            yield ev

    @property
    def slot_id(self) -> int:
        return self.req.slot.id if self.req is not None else -1


def timings(d: Done) -> dict[str, Any]:
    prompt_n = max(0, d.n_prompt_tokens - d.n_cached)
    return {
        "prompt_n": prompt_n,
        "prompt_ms": round(d.prompt_ms, 3),
        "prompt_per_token_ms": round(d.prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(prompt_n * 1000.0 / d.prompt_ms, 3) if d.prompt_ms > 0 else 0.0,
        "predicted_n": d.n_predicted,
        "predicted_ms": round(d.predicted_ms, 3),
        "predicted_per_token_ms": round(d.predicted_ms / d.n_predicted, 3)
        if d.n_predicted
        else 0.0,
        "predicted_per_second": round(d.n_predicted * 1000.0 / d.predicted_ms, 3)
        if d.predicted_ms > 0
        else 0.0,
    }


def gen_settings(p: SamplingParams | None) -> dict[str, Any]:
    p = p or SamplingParams()
    return {
        "n_predict": p.n_predict,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "seed": -1 if p.seed is None else p.seed,
        "stop": list(p.stop),
        "t_max_predict_ms": p.t_max_predict_ms or 0,
        "n_indent": p.n_indent,
    }


async def sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    await resp.prepare(request)
    return resp


class SlowReader(ConnectionResetError):
    """The client read nothing for ``write_timeout_s``: its connection was dropped."""


async def write(request: web.Request, resp: web.StreamResponse, data: bytes | None) -> None:
    """Write ``data`` to a stream (None: end it). A client that reads none of it for
    ``write_timeout_s`` (the write waits while the socket's buffers are full) has its
    connection closed and gets ``SlowReader``, which ends the handler like a client that
    left (``Gen`` stops the generation)."""
    timeout_s = request.app[SETTINGS].write_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await (resp.write(data) if data is not None else resp.write_eof())
    except TimeoutError:
        log.warning("client_write_timeout", path=request.path, timeout_s=timeout_s)
        if request.transport is not None:
            request.transport.abort()
        raise SlowReader(f"the client read nothing for {timeout_s:g} s") from None


async def sse(request: web.Request, resp: web.StreamResponse, obj: Any) -> None:
    await write(request, resp, f"data: {dumps(obj)}\n\n".encode())


async def sse_error(request: web.Request, resp: web.StreamResponse, f: Failed) -> None:
    await sse(request, resp, failed_body(f))


async def collect(g: Gen) -> Failed | None:
    """Run a non-streamed generation to its end (text in ``g.content``); its failure, if any."""
    async for _ in g.events():
        pass
    return g.failed


async def stream_sse(
    request: web.Request,
    g: Gen,
    render: Callable[[Token | Done], list[Any]],
    prelude: Sequence[Any] = (),
) -> web.StreamResponse:
    """Stream a generation as SSE; ``render`` gives each event's frames (dicts become
    ``data:`` lines, bytes are written as they are). The response starts with the first
    event, after the ``prelude`` frames; a failure before it answers with plain JSON, a
    later one ends the stream with an error event."""
    resp: web.StreamResponse | None = None
    async for ev in g.events():
        if isinstance(ev, Failed):
            if resp is None:
                return failed_response(ev)
            await sse_error(request, resp, ev)
            break
        if resp is None:
            resp = await sse_start(request)
            for frame in prelude:
                await _write_frame(request, resp, frame)
        for frame in render(ev):
            await _write_frame(request, resp, frame)
    assert resp is not None
    await write(request, resp, None)
    return resp


async def _write_frame(request: web.Request, resp: web.StreamResponse, frame: Any) -> None:
    if isinstance(frame, bytes):
        await write(request, resp, frame)
    else:
        await sse(request, resp, frame)
