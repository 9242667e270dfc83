"""FakeRouter: a real loopback aiohttp server that imitates llama-server's router mode.

``llama-server --models-dir DIR --models-max N`` serves many models, each one a child
llama-server that it starts on demand (a load), stops on an unload, and proxies to. Here
each child is a ``FakeUpstream(kind="llamacpp", slots=k, ...)`` on its own ephemeral port
(router_models.py keeps the models, their status, loads and children). What the fake
matches, as measured against llama-server b11434:

- ``GET /props`` without ``?model=``: the router's own props (``"role": "router"``,
  ``max_instances`` = ``models_max``, ``models_autoload``); ``GET /health``:
  ``{"status": "ok"}``; ``GET /models`` and ``/v1/models``: every model with its
  ``status.value`` (``unloaded``, ``loading``, ``loaded``).
- ``GET /slots``, ``/props``, ``/metrics`` with ``?model=NAME``: the child's answer, the
  model loaded first if it is not (the request waits for the load) unless
  ``&autoload=false`` (or ``0``): then 400 "model is not loaded". Without a model: 400
  "model name is missing from the request"; an unknown one: 400 "model 'X' not found".
- ``POST /models/load`` and ``/models/unload`` with ``{"model": NAME}``: ``{"success":
  true}`` at once (a load goes on in the background).
- Any other POST: the model is the JSON body's ``model`` (the same 400s); the body goes to
  the child unchanged and its answer comes back as it comes: status, content type, and a
  streamed body piece by piece.
- A client that leaves a streamed request (``"stream": true``) closes the router's
  connection to the child at once (the child records an abort); one that leaves a
  whole-answer request goes unnoticed: the child's generation runs to its end.

The fake's own choices (not measured): a child that fails before the head of its answer
(its model unloaded meanwhile, say) gives a 500 ``server_error``; one that fails after it
cuts the client's connection. A request whose model's load ends without a child (the
model unloaded while loading) gets a 500 too. A POST body that is no JSON object names no
model (400). A whole answer (a GET, a POST without ``"stream": true``) is read whole from
the child, then sent in one piece. ``received`` and ``abandoned`` record the requests and
those whose client left before their answer.

Concurrency contract: the app runs with ``handler_cancellation=True``, so a client
disconnect cancels the handler and, with it, a streamed relay (its child connection
closed). A whole-answer exchange with a child runs in a task the router owns, which its
handler awaits shielded: a disconnect leaves it running. ``stop()`` stops the models
(cancels their loads, stops every child: relays in flight fail at once), cancels and awaits
the exchanges left, closes the server, then the client session.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from llmproxy.bench.fake.loopback import Loopback
from llmproxy.bench.fake.router_models import (
    ModelNotFound,
    ModelNotLoaded,
    RouterModel,
    RouterModels,
    Status,
)
from llmproxy.bench.fake.shapes import error_body, json_response
from llmproxy.bench.fake.upstream import FakeUpstream

MISSING = "model name is missing from the request"
# GET routes answered by the model's child, chosen by ``?model=`` (/props without it: the router)
CHILD_GETS = frozenset({"/slots", "/props", "/metrics"})
CONTROL = frozenset({"/models/load", "/models/unload"})
# request headers not forwarded to the child (the client library sets its own)
HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass
class _Answer:
    """A child's whole answer."""

    status: int
    content_type: str
    body: bytes


def _bad(message: str, code: int = 400, type_: str = "invalid_request_error") -> web.Response:
    return json_response(error_body(message, type_, code), code)


def _cut(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


class FakeRouter:
    """Loopback fake of llama-server's router mode; see the module docstring.

    ``models``: model names, or names mapped to per-model settings, which override the
    router-wide ones: ``slots``, ``load_delay_s``, ``load_hold`` (an event a load waits
    for once its delay has passed), ``aliases`` (other names a request may give it, listed
    in ``/v1/models``) and any other ``FakeUpstream`` keyword argument (not
    ``kind``, ``models``, ``host``, ``port``), given to each of that model's children.
    ``child_kwargs`` are those arguments for every model.
    """

    def __init__(
        self,
        models: Mapping[str, Mapping[str, Any]] | Sequence[str],
        *,
        slots: int = 1,
        models_max: int = 4,
        load_delay_s: float = 0.0,
        load_hold: asyncio.Event | None = None,
        autoload: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        **child_kwargs: Any,
    ) -> None:
        specs: Mapping[str, Mapping[str, Any]] = (
            models if isinstance(models, Mapping) else {name: {} for name in models}
        )
        table: list[RouterModel] = []
        for name, own in specs.items():
            kw: dict[str, Any] = {
                "slots": slots,
                "load_delay_s": load_delay_s,
                "load_hold": load_hold,
                **child_kwargs,
                **own,
            }
            taken = {"kind", "models", "host", "port"} & kw.keys()
            if taken:
                raise TypeError(f"the router sets its children's {sorted(taken)}")
            delay, hold = kw.pop("load_delay_s"), kw.pop("load_hold")
            aliases = tuple(kw.pop("aliases", ()))
            table.append(RouterModel(name, kw, load_delay_s=delay, load_hold=hold, aliases=aliases))
        self.models = RouterModels(table, models_max)
        self.autoload = autoload  # llama-server's models_autoload (--no-models-autoload: off)
        self.created = int(time.time())
        self.url = ""
        self._server = Loopback(self._dispatch, host, port)
        self._session: aiohttp.ClientSession | None = None
        self._exchanges: set[asyncio.Task[_Answer | None]] = set()
        # records, published like a status change (``wait_for`` sees them)
        self.received: list[tuple[str, str | None]] = []  # (path, model) of each request
        self.abandoned: list[str] = []  # paths of requests whose client left before the end

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.url = await self._server.start()

    async def stop(self) -> None:
        """Stop every child (requests in flight to them fail), then the router itself."""
        await self.models.stop()
        for task in self._exchanges:
            task.cancel()
        await asyncio.gather(*self._exchanges, return_exceptions=True)
        await self._server.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FakeRouter:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- state
    @property
    def loads(self) -> dict[str, int]:
        """Loads started, per model (requests that waited for one load count it once)."""
        return self.models.loads

    @property
    def unloads(self) -> dict[str, int]:
        """Unloads, per model: asked for (``/models/unload``) or evictions."""
        return self.models.unloads

    def status(self, name: str) -> Status:
        return self.models.get(name).status

    def child(self, name: str) -> FakeUpstream | None:
        """The model's child while it is loaded."""
        return self.models.get(name).child

    def children(self, name: str) -> list[FakeUpstream]:
        """Every child the model had, the current one last (their records outlive them)."""
        return list(self.models.get(name).children)

    def snapshot(self) -> dict[str, Any]:
        return {
            name: {"status": m.status, "loads": self.loads[name], "unloads": self.unloads[name]}
            for name, m in self.models.models.items()
        }

    async def wait_for(
        self,
        predicate: Callable[[FakeRouter], bool],
        timeout: float = 5.0,  # noqa: ASYNC109 - part of the API the tests call
    ) -> None:
        """Wait until ``predicate(self)`` holds; re-checked at every change of a model's
        status (its children's state changes are waited on with their own ``wait_for``)."""
        try:
            async with asyncio.timeout(timeout):
                await self.models.wait(lambda: predicate(self))
        except TimeoutError:
            name = getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(
                f"FakeRouter.wait_for({name}) still false after {timeout}s; "
                f"state: {self.snapshot()}"
            ) from None

    # ----------------------------------------------------------------- routing
    def _listing(self) -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "owned_by": "llamacpp",
                "aliases": list(m.aliases),
                "tags": [],
                "created": self.created,
                "status": {"value": m.status, "args": []},
            }
            for name, m in self.models.models.items()
        ]
        return {"object": "list", "data": data}

    def _props(self) -> dict[str, Any]:
        return {
            "role": "router",
            "max_instances": self.models.models_max,
            "models_autoload": self.autoload,
            "model_alias": "llama-server",
            "model_path": "none",
            "default_generation_settings": {"params": None, "n_ctx": 0},
            "ui_settings": {},
            "build_info": "b0-unknown",
        }

    def _record(self, path: str, model: str | None) -> None:
        self.received.append((path, model))
        self.models.changed()

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path, query = request.path, request.rel_url.query
        if request.method == "GET":
            self._record(path, query.get("model"))
            if path in ("/health", "/v1/health"):
                return json_response({"status": "ok"})
            if path in ("/models", "/v1/models"):
                return json_response(self._listing())
            if path == "/props" and "model" not in query:
                return json_response(self._props())
            if path in CHILD_GETS:
                return await self._forward(request, query.get("model"), b"", stream=False)
        elif request.method == "POST":
            raw = await request.read()
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = None
            body = parsed if isinstance(parsed, dict) else {}
            model = body.get("model") if isinstance(body.get("model"), str) else None
            self._record(path, model)
            if path in CONTROL:
                return await self._control(path, model)
            return await self._forward(request, model, raw, stream=body.get("stream") is True)
        return _bad("File Not Found", 404, "not_found_error")

    async def _control(self, path: str, model: str | None) -> web.Response:
        if not model:
            return _bad(MISSING)
        try:
            if path == "/models/load":
                self.models.load(model)
            else:
                await self.models.unload(model)
        except ModelNotFound:
            return _bad(f"model '{model}' not found")
        return json_response({"success": True})

    def _autoload(self, request: web.Request) -> bool:
        value = request.rel_url.query.get("autoload", "").lower()
        if value in ("false", "0"):
            return False
        if value in ("true", "1"):
            return True
        return self.autoload

    async def _forward(
        self, request: web.Request, model: str | None, raw: bytes, *, stream: bool
    ) -> web.StreamResponse:
        """The request to ``model``'s child, loaded first if need be, and its answer back."""
        try:
            return await self._to_child(request, model, raw, stream=stream)
        except asyncio.CancelledError:
            self.abandoned.append(request.path)
            self.models.changed()
            raise

    async def _to_child(
        self, request: web.Request, model: str | None, raw: bytes, *, stream: bool
    ) -> web.StreamResponse:
        if not model:
            return _bad(MISSING)
        try:
            child = await self.models.ensure_loaded(model, self._autoload(request))
        except ModelNotFound:
            return _bad(f"model '{model}' not found")
        except ModelNotLoaded as e:
            code = 400 if str(e) == "model is not loaded" else 500
            return _bad(str(e), code, "invalid_request_error" if code == 400 else "server_error")
        self.models.touch(self.models.get(model))
        rest = {k: v for k, v in request.rel_url.query.items() if k not in ("model", "autoload")}
        url = URL(child.url).with_path(request.path).with_query(rest)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        if stream:
            return await self._relay(request, url, headers, raw)
        task = asyncio.get_running_loop().create_task(
            self._exchange(request.method, url, headers, raw)
        )
        self._exchanges.add(task)
        task.add_done_callback(self._exchanges.discard)
        answer = await asyncio.shield(task)  # the client leaving goes unnoticed
        if answer is None:
            return _bad("the model's server closed the connection", 500, "server_error")
        return web.Response(
            status=answer.status, body=answer.body, headers={"Content-Type": answer.content_type}
        )

    async def _exchange(
        self, method: str, url: URL, headers: dict[str, str], raw: bytes
    ) -> _Answer | None:
        """A whole exchange with a child (None: it failed)."""
        assert self._session is not None
        try:
            async with self._session.request(method, url, headers=headers, data=raw) as up:
                body = await up.read()
                return _Answer(up.status, up.headers.get("Content-Type", ""), body)
        except aiohttp.ClientError:
            return None

    async def _relay(
        self, request: web.Request, url: URL, headers: dict[str, str], raw: bytes
    ) -> web.StreamResponse:
        """A streamed answer, each piece sent on as it comes; the client leaving (this
        handler cancelled) closes the child's connection at once."""
        assert self._session is not None
        try:
            up = await self._session.post(url, headers=headers, data=raw)
        except aiohttp.ClientError:
            return _bad("the model's server closed the connection", 500, "server_error")
        try:
            resp = web.StreamResponse(status=up.status)
            resp.headers["Content-Type"] = up.headers.get("Content-Type", "")
            await resp.prepare(request)
            try:
                async for data in up.content.iter_any():
                    await resp.write(data)
            except aiohttp.ClientError:  # the child went away mid-answer
                _cut(request)
                return resp
            await resp.write_eof()
            return resp
        finally:
            up.close()  # not back to the pool: a client gone mid-stream drops the child's
