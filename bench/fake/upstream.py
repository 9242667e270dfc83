"""FakeUpstream: a real loopback aiohttp server that imitates an LLM backend for tests and benches.

It speaks the wire shapes of llama.cpp's ``llama-server`` (``kind="llamacpp"``), an
OpenAI-compatible server (``"openai"``) or Ollama (``"ollama"``), generates deterministic
tokens (token i is ``f"t{i} "``) and records what actually reached it: every request
(``received``), which generations completed or were abandoned by their client
(``completed`` / ``aborted``), and how many generations ran at once (``concurrent`` /
``max_concurrent``).

Concurrency contract:

- A *generation* is a POST to a generation route. It counts in ``concurrent`` from the
  moment its request is received (including while it waits for a slot, like llama-server's
  deferred queue) until its slot is idle again. ``id_slot`` >= 0 waits for that slot,
  otherwise the lowest free slot is taken; waiting requests are woken in arrival order
  (a newcomer that finds a slot free takes it at once, as in llama-server). A request that
  found no slot for it on arrival is recorded in ``deferred``. A generation gives its slots
  back right before its last bytes go out, as llama-server releases a slot before it
  answers. ``Script.hold`` keeps a generation on its slots until the test sets it.
- ``n_cmpl`` (alias ``n``; llamacpp kind) = k > 1 asks for k completions at once, as
  llama-server runs them: on k slots together (``id_slot``'s, or the lowest idle, plus
  the lowest other idle ones), waiting until all k are idle; it counts k in ``concurrent``.
  More than the slot count is a 400. The answer is a JSON array (llama-server's native
  routes) or k ``choices`` (OpenAI routes); streamed, each token comes once per completion.
  An embeddings batch of n inputs (a rerank of n documents) takes min(n, slots) slots at
  once (llama-server runs each input as a task on any idle slot) and answers one vector
  (score) per input. ``/v1/messages`` (Anthropic-style chat) runs like a chat completion.
- The app runs with ``handler_cancellation=True``: a client disconnect cancels the handler.
  The abort is recorded at once; the slot stays busy for ``abort_linger_s`` more (llama-server
  notices disconnects by polling) in a background task owned by this object, which
  ``stop()`` cancels and awaits.
- State is mutated synchronously (so a cancelled handler can never leave a slot busy);
  every change then notifies one ``asyncio.Condition`` from a short tracked task (only
  when someone waits on it); ``wait_for`` waits on it.
- ``stop()`` wakes the ``hang_*`` fail modes, cancels linger tasks and closes the server.

Wire formats (llama/OpenAI/Ollama JSON, SSE/NDJSON framing) live in fake_shapes.py; the
command line (``python -m llmproxy.bench.fake.upstream``) in fake_main.py.

Per-request behaviour comes from ``script(path, body) -> Script``. The number of tokens is
``Script.tokens``, capped by the request's own limit (``n_predict``, ``max_tokens``,
``options.num_predict``) when that is >= 0, so ``n_predict: 0`` warm-ups answer at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web
from multidict import CIMultiDict

from llmproxy.bench.fake.shapes import (
    Shape,
    dumps,
    error_body,
    indexed,
    info_routes,
    json_response,
    shape_for,
    token_count,
)

Kind = Literal["llamacpp", "openai", "ollama"]
FailMode = Literal[None, "reset_mid_stream", "hang_before_headers", "hang_mid_body", "malformed"]


@dataclass
class Script:
    """How the fake answers one generation request."""

    tokens: int = 8
    token_delay_s: float = 0.005
    status: int = 200
    fail: FailMode = None
    hold: asyncio.Event | None = None  # once on its slots, generate only after this is set
    padding: int = 0  # SSE streams: a comment line of this many bytes after each token's event (clients skip it)


@dataclass(frozen=True)
class Received:
    """One request as it reached the fake (``t`` is ``time.monotonic()`` at receipt)."""

    path: str
    body: dict[str, Any] | None
    raw: bytes
    headers: CIMultiDict[str]  # as received; lookups ignore case
    t: float
    id: int


@dataclass
class _Slot:
    busy: bool = False
    id_task: int = -1
    n_decoded: int = 0


class FakeUpstream:
    """Loopback fake LLM server; see the module docstring for the concurrency contract."""

    def __init__(
        self,
        *,
        kind: Kind = "llamacpp",
        slots: int = 1,
        abort_linger_s: float = 0.2,
        slots_endpoint: bool = True,
        script: Callable[[str, dict[str, Any]], Script] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.kind: Kind = kind
        self.abort_linger_s = abort_linger_s
        self.slots_endpoint = slots_endpoint
        self.script: Callable[[str, dict[str, Any]], Script] = script or (lambda _p, _b: Script())
        self._host, self._port = host, port
        self.url = ""
        self.received: list[Received] = []
        self.aborted: list[int] = []
        self.completed: list[int] = []
        self.failed: list[int] = []  # ids the fake itself broke off (reset_mid_stream)
        self.deferred: list[int] = []  # generations that found no slot free for them on arrival
        self.concurrent = 0
        self.max_concurrent = 0
        self._slots = [_Slot() for _ in range(slots)]
        self._cond = asyncio.Condition()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiters = 0  # coroutines waiting on _cond (wait_for, deferred generations)
        self._runner: web.AppRunner | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self._host}:{port}"

    async def stop(self) -> None:
        self._stopping.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- state
    @property
    def slot_busy(self) -> list[bool]:
        return [s.busy for s in self._slots]

    @property
    def generations(self) -> list[Received]:
        """The received requests that were generations (POSTs to a route this kind generates on)."""
        return [r for r in self.received if shape_for(r.path, self.kind) is not None]

    def snapshot(self) -> dict[str, Any]:
        return {
            "received": [(r.id, r.path) for r in self.received][-20:],
            "completed": self.completed,
            "aborted": self.aborted,
            "failed": self.failed,
            "deferred": self.deferred,
            "concurrent": self.concurrent,
            "max_concurrent": self.max_concurrent,
            "slot_busy": self.slot_busy,
        }

    async def wait_for(
        self, predicate: Callable[[FakeUpstream], bool], timeout: float = 5.0
    ) -> None:
        """Wait until ``predicate(self)`` holds; re-checked at every state change."""
        self._waiters += 1
        try:
            async with asyncio.timeout(timeout), self._cond:
                await self._cond.wait_for(lambda: predicate(self))
        except TimeoutError:
            name = getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(
                f"FakeUpstream.wait_for({name}) still false after {timeout}s; state: {self.snapshot()}"
            ) from None
        finally:
            self._waiters -= 1

    # ----------------------------------------------------------------- routing
    def _get_routes(self) -> dict[str, Callable[[], web.Response]]:
        routes = info_routes(self.kind, len(self._slots))
        if self.kind == "llamacpp":
            routes["/slots"] = self._slots_response
        return routes

    def _slots_response(self) -> web.Response:
        if not self.slots_endpoint:
            return json_response(
                error_body(
                    "This server does not support slots endpoint.", "not_supported_error", 501
                ),
                501,
            )
        return json_response(
            [
                {
                    "id": i,
                    "id_task": s.id_task,
                    "n_ctx": 4096,
                    "is_processing": s.busy,
                    "next_token": {
                        "has_next_token": s.busy,
                        "n_remain": -1,
                        "n_decoded": s.n_decoded,
                    },
                }
                for i, s in enumerate(self._slots)
            ]
        )

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        body = parsed if isinstance(parsed, dict) else None
        rec = Received(
            request.path,
            body,
            raw,
            CIMultiDict(request.headers),
            time.monotonic(),
            len(self.received),
        )
        self.received.append(rec)
        self._notify()
        shape = shape_for(request.path, self.kind)
        if request.method == "POST" and shape is not None:
            if body is None:
                return json_response(
                    error_body("invalid JSON body", "invalid_request_error", 400), 400
                )
            return await self._generation(request, rec, body, shape)
        handler = self._get_routes().get(request.path) if request.method == "GET" else None
        if handler is None:
            return json_response(
                error_body(f"not found: {request.method} {request.path}", "not_found_error", 404),
                404,
            )
        return handler()

    # ----------------------------------------------------------------- generations
    def _completions(self, body: dict[str, Any]) -> int:
        """Completions (slots) a llama-server request asks for, read as llama-server reads it:
        ``json_value(data, "n_cmpl", json_value(data, "n", 1))``, where a missing or null
        field gives the default, a number of the wrong type is cut to an int (2.7 -> 2,
        true -> 1) and any other type gives the default."""
        if self.kind != "llamacpp":
            return 1

        def json_value(key: str, default: int) -> int:
            v = body.get(key)
            if v is None:
                return default
            if isinstance(v, (bool, int, float)):
                try:
                    return int(v)
                except (OverflowError, ValueError):  # inf, nan
                    return default
            return default

        return max(1, json_value("n_cmpl", json_value("n", 1)))

    def _prompts(self, body: dict[str, Any]) -> int:
        """Inputs of an embeddings request (``input``, else llama-server's ``content``): a
        list of strings or of token lists is one each; a string or a single token list is
        one. A rerank request: its ``documents`` (else ``texts``), one each."""
        docs = body.get("documents")
        docs = docs if isinstance(docs, list) else body.get("texts")
        if "query" in body and isinstance(docs, list):
            return max(1, len(docs))
        value = body.get("input") if "input" in body else body.get("content")
        if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
            return len(value)
        return 1

    async def _generation(
        self, request: web.Request, rec: Received, body: dict[str, Any], shape: Shape
    ) -> web.StreamResponse:
        script = self.script(rec.path, body)
        if shape.per_input:  # llama-server: one task per input (document), each on any idle slot
            k = min(self._prompts(body), len(self._slots)) if self.kind == "llamacpp" else 1
        else:
            k = self._completions(body)
        if k > len(self._slots):
            msg = "n_cmpl cannot be greater than the number of slots, please increase -np"  # llama-server's
            return json_response(error_body(msg, "invalid_request_error", 400), 400)
        if not 200 <= script.status < 300:
            self.completed.append(rec.id)
            self._notify()
            return json_response(
                error_body(f"scripted error {script.status}", "server_error", script.status),
                script.status,
            )
        self.concurrent += k
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        self._notify()
        slots: tuple[int, ...] = ()
        held = True  # its slots (and its k in ``concurrent``) not given back yet

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._free(slots, k)

        try:
            slots = await self._take_slots(body.get("id_slot"), k, rec.id)
            return await self._respond(request, rec, body, shape, script, slots, release)
        except (asyncio.CancelledError, ConnectionError):
            if held:  # not after the generation completed (a client gone during the last write)
                self.aborted.append(rec.id)
                self._notify()
                if slots and self.abort_linger_s > 0:
                    held = False  # the linger task frees them
                    self._spawn(self._linger(slots, k))
            raise
        finally:
            release()

    async def _take_slots(self, want: Any, k: int, task_id: int) -> tuple[int, ...]:
        """Wait until slot ``want`` (or any slot when absent or < 0) and k - 1 others are idle
        (all at once, as llama-server launches a request with its extra completions), mark
        them busy and return them, the first one ``want``'s."""
        wanted = want if isinstance(want, int) and 0 <= want < len(self._slots) else None

        def free() -> tuple[int, ...] | None:
            idle = [i for i, s in enumerate(self._slots) if not s.busy]
            if wanted is not None:
                if wanted not in idle:
                    return None
                idle.remove(wanted)
                idle.insert(0, wanted)
            return tuple(idle[:k]) if len(idle) >= k else None

        got = free()
        if got is None:
            self.deferred.append(task_id)
            self._waiters += 1
            try:
                async with self._cond:
                    await self._cond.wait_for(lambda: free() is not None)
            finally:
                self._waiters -= 1
            got = free()
            assert got is not None
        for i in got:
            self._slots[i] = _Slot(busy=True, id_task=task_id)
        self._notify()
        return got

    def _free(self, slots: tuple[int, ...], k: int) -> None:
        """End a generation now (synchronously): free its slots, drop its k from ``concurrent``."""
        for i in slots:
            self._slots[i] = _Slot()
        self.concurrent -= k
        self._notify()

    async def _linger(self, slots: tuple[int, ...], k: int) -> None:
        """After an abort, keep the slots busy ``abort_linger_s`` (cancelled by ``stop()``)."""
        await asyncio.sleep(self.abort_linger_s)
        self._free(slots, k)

    def _notify(self) -> None:
        """Publish a state change to ``wait_for``/slot waiters (state is mutated synchronously).

        Notifying needs the condition's lock, so it runs in a tracked task; skipped when
        nobody waits or the server is stopping.
        """
        if self._waiters and not self._stopping.is_set():
            self._spawn(self._notify_all())

    async def _notify_all(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tick(self, script: Script, slots: tuple[int, ...], due: float) -> None:
        """Decode one token: wait until ``due`` (loop time), the token's place on the schedule.

        Tokens are paced against the generation's start, not by relative sleeps, so timer
        overshoot does not accumulate: a generation of n tokens takes n x delay plus one
        wake-up, however busy the machine (relative sleeps made it drift by +-2 ms of 80).
        """
        await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
        for i in slots:
            self._slots[i].n_decoded += 1

    async def _hang(self) -> None:
        await self._stopping.wait()

    async def _respond(
        self,
        request: web.Request,
        rec: Received,
        body: dict[str, Any],
        shape: Shape,
        script: Script,
        slots: tuple[int, ...],
        release: Callable[[], None],
    ) -> web.StreamResponse:
        """Generate and answer; ``release()`` frees the slots right before the last bytes go
        out, as llama-server releases a slot before its HTTP thread sends the final result
        (so a client that sends its next request at once never finds the slot still busy)."""
        n = token_count(script.tokens, body)
        stream = shape.wants_stream(body)
        resp = web.StreamResponse()
        if (
            stream and script.fail != "hang_before_headers"
        ):  # llama-server: the head once the task starts
            resp.content_type = shape.stream_type
            await resp.prepare(request)
        if script.hold is not None:
            await script.hold.wait()
        if script.fail == "hang_before_headers":
            await self._hang()
            return self._cut(request, web.StreamResponse(status=503))
        start, delay = asyncio.get_running_loop().time(), script.token_delay_s
        if stream:
            for i in range(n):
                await self._tick(script, slots, start + (i + 1) * delay)
                if script.fail == "reset_mid_stream" and i == max(1, n // 2):
                    return self._reset(request, rec, resp)
                await resp.write(
                    b"".join(
                        shape.frame(indexed(shape.chunk(i, rec.id, s), j))
                        for j, s in enumerate(slots)
                    )
                )
                if script.padding and not shape.ndjson:
                    await resp.write(b": " + b"x" * script.padding + b"\n\n")
                if i == 0 and script.fail == "malformed":
                    await resp.write(
                        b'data: {"content":"t1 ",\n\n'
                        if shape.stream_type != "application/x-ndjson"
                        else b'{"response":\n'
                    )
                if i == 0 and script.fail == "hang_mid_body":
                    await self._hang()
                    return self._cut(request, resp)
            self.completed.append(rec.id)
            release()
            await resp.write(b"".join(shape.frame(obj) for obj in shape.final(n, rec.id, slots)))
        else:
            for i in range(n):
                await self._tick(script, slots, start + (i + 1) * delay)
            payload = dumps(shape.whole_all(n, rec.id, slots, self._prompts(body))).encode()
            if script.fail == "malformed":
                payload = payload[: len(payload) // 2]
            resp.content_type = "application/json"
            if self.kind == "llamacpp":
                resp.charset = "utf-8"  # llama-server: application/json; charset=utf-8
            resp.content_length = len(payload)
            await resp.prepare(request)
            if script.fail in ("reset_mid_stream", "hang_mid_body"):
                await resp.write(payload[: len(payload) // 2])
                if script.fail == "reset_mid_stream":
                    return self._reset(request, rec, resp)
                await self._hang()
                return self._cut(request, resp)
            self.completed.append(rec.id)
            release()
            await resp.write(payload)
        await resp.write_eof()
        return resp

    def _reset(
        self, request: web.Request, rec: Received, resp: web.StreamResponse
    ) -> web.StreamResponse:
        self.failed.append(rec.id)  # published by _free()
        return self._cut(request, resp)

    @staticmethod
    def _cut(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """Break the connection (reset mid-stream, or a hang ended by ``stop()``)."""
        if request.transport is not None:
            request.transport.abort()
        return resp


if __name__ == "__main__":
    from llmproxy.bench.fake.cli import main

    raise SystemExit(main())
