"""FakeUpstream: a real loopback aiohttp server that imitates an LLM backend for tests and benches.

It speaks the wire shapes of llama.cpp's ``llama-server`` (``kind="llamacpp"``), an
OpenAI-compatible server (``"openai"``) or Ollama (``"ollama"``), generates deterministic
tokens (token i is ``f"t{i} "``; with ``continues`` on, a request that continues its
answer, a text prompt or a llama-server chat's closing assistant message ending with
``t0 `` .. ``t{k-1} ``, goes on at token k, up to its script's ``tokens``, as a
deterministic model would: prompts.continues_at; a streamed chat's first piece repeats
the prefill first, as llama-server's does) and records what actually reached it:
every request
(``received``), which generations completed or were abandoned by their client
(``completed`` / ``aborted``), and how many generations ran at once (``concurrent`` /
``max_concurrent``).

Concurrency contract:

- A *generation* is a POST to a generation route. It counts in ``concurrent`` from the
  moment its request is received (including while it waits for a slot, like llama-server's
  deferred queue) until its slot is idle again. ``id_slot`` >= 0 waits for that slot,
  otherwise the lowest free slot is taken (with the prompt-cache model on: see below);
  waiting requests are woken in arrival order (a newcomer that finds a slot free takes it
  at once, as in llama-server). A request that found no slot for it on arrival is recorded
  in ``deferred``. A generation gives its slots back right before its last bytes go out,
  as llama-server releases a slot before it answers. ``Script.hold`` keeps a generation on
  its slots until the test sets it.
- ``n_cmpl`` (alias ``n``; llamacpp kind) = k > 1 asks for k completions at once, as
  llama-server runs them: on k slots together (``id_slot``'s, or the lowest idle or the
  model's pick, plus the lowest other idle ones), waiting until all k are idle; it counts
  k in ``concurrent``. More than the slot count is a 400. The answer is a JSON array
  (llama-server's native routes) or k ``choices`` (OpenAI routes); streamed, each token
  comes once per completion.
  An embeddings batch of n inputs (a rerank of n documents) takes min(n, slots) slots at
  once (llama-server runs each input as a task on any idle slot) and answers one vector
  (score) per input. ``/v1/messages`` (Anthropic-style chat) runs like a chat completion.
- The app runs with ``handler_cancellation=True``: a client disconnect cancels the handler.
  The abort is recorded at once; the slot stays busy for ``abort_linger_s`` more
  (llama-server notices disconnects by polling) in a background task owned by the slot
  table, which ``stop()`` cancels and awaits.
- State is mutated synchronously (so a cancelled handler can never leave a slot busy);
  every change notifies the slot table's condition, on which ``wait_for`` waits.
- ``stop()`` wakes the ``hang_*`` fail modes, cancels linger tasks and closes the server.

Prompt-cache model (opt-in: ``prefill_s_per_char`` > 0; at 0 nothing of it runs). Each
slot caches (``slot_prompts``) the prompt text (prompts.py's ``prompt_text``, compared by
characters) of the last generation that got it, kept if that generation is aborted. A
generation without ``id_slot`` >= 0 takes the idle slot whose cache shares the longest
prefix with its prompt (ties: the lowest id). Once on its slots it counts ``cached`` (that
prefix) and ``evaluated`` (the rest) in ``prompt_chars_cached`` / ``prompt_chars_evaluated``
and on its ``Received``, caches its prompt, and sleeps ``evaluated * prefill_s_per_char``
before its first token, holding its slots (an abort then is handled as during generation).
The llamacpp kind reports both in ``timings`` (``prompt_n``, ``cache_n``) of its final
pieces, and with ``metrics_endpoint`` serves llama-server's ``GET /metrics`` counters of
them and of the tokens decoded (else 501, as llama-server without ``--metrics``). Routes
without a prompt (embeddings, rerank) are outside the model.

Per-request behaviour comes from ``script(path, body) -> Script`` (script.py), read when a
generation arrives; ``script`` may be replaced between requests. The modules: slots and
counters in slots.py, one generation's handling in generation.py, prompt texts in
prompts.py, wire formats (llama/OpenAI/Ollama JSON, SSE/NDJSON framing) in shapes.py, the
command line (``python -m llmproxy.bench.fake.upstream``) in cli.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from llmproxy.bench.fake.generation import Generation
from llmproxy.bench.fake.loopback import Loopback
from llmproxy.bench.fake.script import Kind, Received, Script
from llmproxy.bench.fake.shapes import error_body, info_routes, json_response, shape_for
from llmproxy.bench.fake.slots import Slot, SlotTable


class FakeUpstream:
    """Loopback fake LLM server; see the module docstring for the concurrency contract."""

    def __init__(
        self,
        *,
        kind: Kind = "llamacpp",
        slots: int = 1,
        abort_linger_s: float = 0.2,
        slots_endpoint: bool = True,
        metrics_endpoint: bool = False,
        prefill_s_per_char: float = 0.0,
        continues: bool = False,
        models: Sequence[str] = ("fake",),
        script: Callable[[str, dict[str, Any]], Script] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if prefill_s_per_char < 0:
            raise ValueError("prefill_s_per_char must be >= 0")
        self.kind: Kind = kind
        self.abort_linger_s = abort_linger_s
        self.slots_endpoint = slots_endpoint
        self.metrics_endpoint = metrics_endpoint
        self.prefill_s_per_char = prefill_s_per_char  # > 0: the prompt-cache model is on
        self.continues = continues  # a prompt ending with its own tokens goes on after them
        self.models = tuple(models)  # the ids /v1/models lists (any name is served)
        self.script: Callable[[str, dict[str, Any]], Script] = script or (lambda _p, _b: Script())
        self._host, self._port = host, port
        self.url = ""
        self.received: list[Received] = []
        self.aborted: list[int] = []
        self.completed: list[int] = []
        self.failed: list[int] = []  # ids the fake itself broke off (reset_mid_stream)
        self.prompt_chars_evaluated = 0  # prompt-cache model: totals over all generations
        self.prompt_chars_cached = 0
        self.table = SlotTable(slots)
        self._server: Loopback | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._server = Loopback(self._dispatch, self._host, self._port)
        self.url = await self._server.start()

    async def stop(self) -> None:
        """Stop as a killed server does: from now on the port refuses connections, and every
        connection accepted before is closed, a request on it unanswered."""
        await self.table.stop()
        if self._server is not None:
            await self._server.close()
            self._server = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- state
    @property
    def concurrent(self) -> int:
        return self.table.concurrent

    @property
    def max_concurrent(self) -> int:
        return self.table.max_concurrent

    @property
    def deferred(self) -> list[int]:
        """Generations that found no slot free for them on arrival."""
        return self.table.deferred

    @property
    def slot_busy(self) -> list[bool]:
        return self.table.busy

    @property
    def slot_prompts(self) -> list[str]:
        """Each slot's cached prompt (the prompt-cache model; "" while it holds none)."""
        return [s.prompt for s in self.table.slots]

    # Subclasses (test doubles built on this one) override ``_dispatch`` and read these two.
    @property
    def _slots(self) -> list[Slot]:
        return self.table.slots

    @property
    def _stopping(self) -> asyncio.Event:
        """Set once ``stop()`` runs."""
        return self.table.stopping

    @property
    def generations(self) -> list[Received]:
        """The received requests that were generations (POSTs to a route this kind generates
        on)."""
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
            "prompt_chars_evaluated": self.prompt_chars_evaluated,
            "prompt_chars_cached": self.prompt_chars_cached,
        }

    async def wait_for(
        self,
        predicate: Callable[[FakeUpstream], bool],
        timeout: float = 5.0,  # noqa: ASYNC109 - part of the API the tests call
    ) -> None:
        """Wait until ``predicate(self)`` holds; re-checked at every state change."""
        try:
            async with asyncio.timeout(timeout):
                await self.table.wait(lambda: predicate(self))
        except TimeoutError:
            name = getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(
                f"FakeUpstream.wait_for({name}) still false after {timeout}s; "
                f"state: {self.snapshot()}"
            ) from None

    # ----------------------------------------------------------------- routing
    def _get_routes(self) -> dict[str, Callable[[], web.Response]]:
        routes = info_routes(self.kind, len(self.table), self.models)
        if self.kind == "llamacpp":
            routes["/slots"] = self._slots_response
            routes["/metrics"] = self._metrics_response
        return routes

    def _metrics_response(self) -> web.Response:
        """llama-server's ``--metrics`` counters: the prompt-cache model's evaluated prompt
        characters (0 with the model off) stand for prompt tokens."""
        if not self.metrics_endpoint:
            return json_response(
                error_body(
                    "This server does not support metrics endpoint. Start it with `--metrics`",
                    "not_supported_error",
                    501,
                ),
                501,
            )
        lines = [
            f"llamacpp:prompt_tokens_total {self.prompt_chars_evaluated}",
            f"llamacpp:tokens_predicted_total {self.table.tokens_decoded}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

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
                for i, s in enumerate(self.table.slots)
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
        self.table.changed()
        shape = shape_for(request.path, self.kind)
        if request.method == "POST" and shape is not None:
            if body is None:
                return json_response(
                    error_body("invalid JSON body", "invalid_request_error", 400), 400
                )
            return await Generation(self, request, rec, body, shape).run()
        handler = self._get_routes().get(request.path) if request.method == "GET" else None
        if handler is None:
            return json_response(
                error_body(f"not found: {request.method} {request.path}", "not_found_error", 404),
                404,
            )
        return handler()


if __name__ == "__main__":
    from llmproxy.bench.fake.cli import main

    raise SystemExit(main())
