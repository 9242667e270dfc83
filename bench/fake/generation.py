"""One generation on the fake upstream, from its arrival to its last byte or its abort.

``Generation(upstream, request, rec, body, shape).run()`` is the handler of a POST to a
generation route: it reads how many slots the request needs (``completions``, ``inputs``),
counts it in ``concurrent`` at once, waits for its slots, then answers as its ``Script``
says. It gives its slots back right before its last bytes go out, as llama-server releases
a slot before its HTTP thread sends the final result (so a client that sends its next
request at once never finds the slot still busy). A client that leaves (the handler is
cancelled) is recorded in ``aborted`` at once; its slots stay busy ``abort_linger_s`` more
(``SlotTable.linger``). With the prompt-cache model on, it evaluates the part of its
prompt its first slot has not cached (prefill, a sleep on its slots before its first
token, cancelled like the rest when the client leaves) and leaves its prompt in the
cache of every slot it ran on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmproxy.bench.fake.prompts import (
    add_timings,
    common_prefix,
    continues_at,
    prompt_text,
    trailing_assistants,
)
from llmproxy.bench.fake.script import Kind, Received, Script
from llmproxy.bench.fake.shapes import (
    Shape,
    dumps,
    error_body,
    indexed,
    json_response,
    pick_fields,
    text,
    token_count,
)

if TYPE_CHECKING:
    from llmproxy.bench.fake.upstream import FakeUpstream


def completions(kind: Kind, body: dict[str, Any]) -> int:
    """Completions (slots) a llama-server request asks for, read as llama-server reads it:
    ``json_value(data, "n_cmpl", json_value(data, "n", 1))``, where a missing or null
    field gives the default, a number of the wrong type is cut to an int (2.7 -> 2,
    true -> 1) and any other type gives the default. Other kinds: always 1."""
    if kind != "llamacpp":
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


def inputs(body: dict[str, Any]) -> int:
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


def _cut(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Break the connection (reset mid-stream, or a hang ended by ``stop()``)."""
    if request.transport is not None:
        request.transport.abort()
    return resp


ERROR_EVENT = {"code": 500, "message": "the fake failed mid-stream", "type": "server_error"}


class Generation:
    """One POST to a generation route of ``upstream``; see the module docstring."""

    def __init__(
        self,
        upstream: FakeUpstream,
        request: web.Request,
        rec: Received,
        body: dict[str, Any],
        shape: Shape,
    ) -> None:
        self.up, self.table = upstream, upstream.table
        self.request, self.rec, self.body, self.shape = request, rec, body, shape
        self.prompt = prompt_text(rec.path, body) if upstream.prefill_s_per_char > 0 else None
        # its first token's index
        self.first = continues_at(rec.path, body, upstream.kind) if upstream.continues else 0
        # llama-server's streamed chat continuation repeats its prefill in its first piece
        self.echo = text(self.first) if self.first and shape.fmt == "oai_chat" else ""

    async def run(self) -> web.StreamResponse:
        up, table, rec, body = self.up, self.table, self.rec, self.body
        script = up.script(rec.path, body)
        if self.shape.per_input:  # llama-server: one task per input (document), on any idle slot
            k = min(inputs(body), len(table)) if up.kind == "llamacpp" else 1
        else:
            k = completions(up.kind, body)
        msg = ""
        if k > len(table):  # llama-server's messages
            msg = "n_cmpl cannot be greater than the number of slots, please increase -np"
        elif trailing_assistants(rec.path, body, up.kind) > 1:
            msg = "Cannot have 2 or more assistant messages at the end of the list."
        if msg:  # refused: ended, as a scripted error is
            up.completed.append(rec.id)
            table.changed()
            return json_response(error_body(msg, "invalid_request_error", 400), 400)
        if not 200 <= script.status < 300:
            up.completed.append(rec.id)
            table.changed()
            return json_response(
                error_body(f"scripted error {script.status}", "server_error", script.status),
                script.status,
            )
        table.enter(k)
        slots: tuple[int, ...] = ()
        held = True  # its slots (and its k in ``concurrent``) not given back yet

        def release() -> None:
            nonlocal held
            if held:
                held = False
                table.free(slots, k)

        try:
            slots = await table.take(body.get("id_slot"), k, rec.id, self.prompt)
            prefill_s = self._evaluate_prompt(slots)
            return await self._respond(script, slots, release, prefill_s)
        except (asyncio.CancelledError, ConnectionError):
            if held:  # not after the generation completed (a client gone during the last write)
                up.aborted.append(rec.id)
                table.changed()
                if slots and up.abort_linger_s > 0:
                    held = False  # the linger task frees them
                    table.linger(slots, k, up.abort_linger_s)
            raise
        finally:
            release()

    def _evaluate_prompt(self, slots: tuple[int, ...]) -> float:
        """Count the prompt against the cache of ``slots[0]`` (the model on), leave it in
        every slot's cache, and return the prefill's seconds (0.0: the model off)."""
        up, rec, prompt = self.up, self.rec, self.prompt
        if prompt is None:
            return 0.0
        cached = common_prefix(self.table.slots[slots[0]].prompt, prompt)
        evaluated = len(prompt) - cached
        for i in slots:
            self.table.slots[i].prompt = prompt
        rec.prompt_chars_evaluated, rec.prompt_chars_cached = evaluated, cached
        up.prompt_chars_evaluated += evaluated
        up.prompt_chars_cached += cached
        self.table.changed()
        return evaluated * up.prefill_s_per_char

    def _timed(self, obj: Any) -> Any:
        """``obj`` (closing pieces or a whole body) with llama-server's prompt ``timings``
        when the model is on and the fake imitates llama-server, then, on its native routes,
        only the request's ``response_fields`` (as llama-server filters its final object)."""
        if self.prompt is not None and self.up.kind == "llamacpp":
            add_timings(
                self.shape.fmt, obj, self.rec.prompt_chars_evaluated, self.rec.prompt_chars_cached
            )
        if self.up.kind == "llamacpp" and self.shape.fmt == "llama":
            return pick_fields(obj, self.body.get("response_fields"))
        return obj

    async def _respond(
        self,
        script: Script,
        slots: tuple[int, ...],
        release: Callable[[], None],
        prefill_s: float,
    ) -> web.StreamResponse:
        """Prefill for ``prefill_s``, generate on ``slots`` and answer; ``release()`` frees
        them right before the last bytes go out."""
        # a continuation ends where the answer it continues would have (the script's tokens)
        tokens = max(script.tokens - self.first, 0)
        request, shape, n = self.request, self.shape, token_count(tokens, self.body)
        stream = shape.wants_stream(self.body)
        resp = web.StreamResponse()
        if stream and script.fail != "hang_before_headers":  # llama-server: the head at start
            resp.content_type = shape.stream_type
            await resp.prepare(request)
        if script.hold is not None:
            await script.hold.wait()
        if script.fail == "hang_before_headers":
            await self.table.hang()
            return _cut(request, web.StreamResponse(status=503))
        if prefill_s > 0:
            await asyncio.sleep(prefill_s)
        if stream:
            return await self._stream(resp, script, slots, n, release)
        return await self._whole(resp, script, slots, n, release)

    async def _stream(
        self,
        resp: web.StreamResponse,
        script: Script,
        slots: tuple[int, ...],
        n: int,
        release: Callable[[], None],
    ) -> web.StreamResponse:
        shape, rid = self.shape, self.rec.id
        start, delay = asyncio.get_running_loop().time(), script.token_delay_s
        for i in range(n):
            await self.table.tick(slots, start + (i + 1) * delay)
            if script.fail == "reset_mid_stream" and i == max(1, n // 2):
                return self._reset(resp)
            if script.fail == "error_event" and i == max(1, n // 2) and not shape.ndjson:
                return await self._error_event(resp, release)
            chunks = [indexed(shape.chunk(self.first + i, rid, s), j) for j, s in enumerate(slots)]
            if i == 0 and self.echo:
                for c in chunks:
                    c["choices"][0]["delta"]["content"] = (
                        self.echo + c["choices"][0]["delta"]["content"]
                    )
            await resp.write(b"".join(shape.frame(c) for c in chunks))
            if script.padding and not shape.ndjson:
                await resp.write(b": " + b"x" * script.padding + b"\n\n")
            if i == 0 and script.fail == "malformed":
                await resp.write(
                    b'data: {"content":"t1 ",\n\n'
                    if shape.stream_type != "application/x-ndjson"
                    else b'{"response":\n'
                )
            if i == 0 and script.fail == "hang_mid_body":
                await self.table.hang()
                return _cut(self.request, resp)
        self.up.completed.append(rid)
        release()
        finals = self._timed(shape.final(n, rid, slots))
        await resp.write(b"".join(shape.frame(obj) for obj in finals))
        await resp.write_eof()
        return resp

    async def _whole(
        self,
        resp: web.StreamResponse,
        script: Script,
        slots: tuple[int, ...],
        n: int,
        release: Callable[[], None],
    ) -> web.StreamResponse:
        rid = self.rec.id
        start, delay = asyncio.get_running_loop().time(), script.token_delay_s
        for i in range(n):
            await self.table.tick(slots, start + (i + 1) * delay)
        whole = self._timed(self.shape.whole_all(n, rid, slots, inputs(self.body), self.first))
        payload = dumps(whole).encode()
        if script.fail == "error_event":
            resp.set_status(500)
            payload = dumps({"error": ERROR_EVENT}).encode()
        if script.fail == "malformed":
            payload = payload[: len(payload) // 2]
        resp.content_type = "application/json"
        if self.up.kind == "llamacpp":
            resp.charset = "utf-8"  # llama-server: application/json; charset=utf-8
        resp.content_length = len(payload)
        await resp.prepare(self.request)
        if script.fail in ("reset_mid_stream", "hang_mid_body"):
            await resp.write(payload[: len(payload) // 2])
            if script.fail == "reset_mid_stream":
                return self._reset(resp)
            await self.table.hang()
            return _cut(self.request, resp)
        self.up.completed.append(rid)
        release()
        await resp.write(payload)
        await resp.write_eof()
        return resp

    async def _error_event(
        self, resp: web.StreamResponse, release: Callable[[], None]
    ) -> web.StreamResponse:
        """End a started stream with llama-server's in-stream error event."""
        self.up.failed.append(self.rec.id)
        release()
        await resp.write(b"data: " + dumps({"error": ERROR_EVENT}).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    def _reset(self, resp: web.StreamResponse) -> web.StreamResponse:
        self.up.failed.append(self.rec.id)  # published by SlotTable.free()
        return _cut(self.request, resp)
