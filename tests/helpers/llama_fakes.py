"""Fake llama-servers for the detection tests: one still loading its model, one started
with ``--api-key``, and one whose ``/slots`` fails or is slow at first. Built on the bench's
FakeUpstream (llmproxy.bench.fake), on real loopback sockets.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from llmproxy.bench.fake.shapes import json_response
from llmproxy.bench.fake.upstream import FakeUpstream

_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


# llama-server's routes open without the key, with --api-key
_PUBLIC = ("/health", "/v1/health", "/models", "/v1/models", "/api/tags")


class LoadingFake(FakeUpstream):
    """A llama-server still loading its model: 503 on every API route until ``ready`` is
    set, or until it has answered ``loading_answers`` requests that way."""

    def __init__(self, *, loading_answers: int | None = None, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.ready = asyncio.Event()
        self.loading_answers = loading_answers
        self.answered_loading = 0

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if self.loading_answers is not None and self.answered_loading >= self.loading_answers:
            self.ready.set()
        if not self.ready.is_set() and request.path not in _PUBLIC:
            await request.read()
            self.answered_loading += 1
            return json_response(_LOADING, 503)
        return await super()._dispatch(request)


class KeyedFake(FakeUpstream):
    """A llama-server started with ``--api-key K``."""

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.path not in _PUBLIC and request.headers.get("Authorization") != "Bearer K":
            await request.read()
            return json_response(
                {
                    "error": {
                        "code": 401,
                        "message": "Invalid API Key",
                        "type": "authentication_error",
                    }
                },
                401,
            )
        return await super()._dispatch(request)


class SlotsLaterFake(FakeUpstream):
    """/slots answers ``first`` until ``ready`` is set (a 503, or 501 as with --no-slots), or
    with ``first`` None does not answer until then (llama-server answers /slots from its
    main loop: during a long prompt, later than the proxy's probe timeout)."""

    def __init__(self, *, first: int | None, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.first = first
        self.ready = asyncio.Event()
        self.slots_asked = 0

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.slots_asked += request.path == "/slots"
        if request.path == "/slots" and not self.ready.is_set():
            if self.first is None:
                await self.ready.wait()
            else:
                return json_response(
                    {"error": {"code": self.first, "message": "not now", "type": "x"}}, self.first
                )
        return await super()._dispatch(request)
