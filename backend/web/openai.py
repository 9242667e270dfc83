"""OpenAI-compatible generation routes: POST /v1/completions and /v1/chat/completions.

Non-streamed: one ``text_completion`` / ``chat.completion`` object with ``usage`` and
llama-server's ``timings``. Streamed: SSE chunks (chat starts with a ``role`` delta), a
last chunk carrying ``finish_reason``, ``usage`` and ``timings``, then ``data: [DONE]``.
Errors before the first token are plain JSON; after it, an SSE error event. Cancellation
is ``Gen``'s (gen.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from llmproxy.backend.protocol import Done, Prompt, Token
from llmproxy.backend.web.context import DISPATCHER, SETTINGS, alias
from llmproxy.backend.web.errors import BadRequest, failed_response, json_response
from llmproxy.backend.web.gen import FINISH, Gen, collect, stream_sse, timings
from llmproxy.backend.web.params import boolean, sampling_params
from llmproxy.backend.web.requests import (
    chat_prompt,
    check_model,
    id_slot,
    read_body,
    read_completion,
)


def _usage(d: Done) -> dict[str, int]:
    return {
        "prompt_tokens": d.n_prompt_tokens,
        "completion_tokens": d.n_predicted,
        "total_tokens": d.n_prompt_tokens + d.n_predicted,
    }


async def _run_openai(
    request: web.Request, body: dict[str, Any], prompt: Prompt, chat: bool
) -> web.StreamResponse:
    app = request.app
    params = sampling_params(body, openai=True)
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    slot = id_slot(body, app[DISPATCHER])
    stream = boolean(body, "stream")
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = body.get("model") or alias(app)
    obj = "chat.completion" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if piece is not None:
                delta["content"] = piece
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {
            "id": cid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
        }

    async with Gen(request, prompt, params, slot) as g:
        if not stream:
            if failed := await collect(g):
                return failed_response(failed)
            d = g.done
            assert d is not None
            text = "".join(g.content)
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": FINISH[d.stop_reason],
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": FINISH[d.stop_reason],
                }
            return json_response(
                {
                    "id": cid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": _usage(d),
                    "timings": timings(d),
                }
            )

        def render(ev: Token | Done) -> list[Any]:
            if isinstance(ev, Token):
                return [chunk(ev.text, None)]
            last = chunk(None if chat else "", FINISH[ev.stop_reason])
            last["usage"] = _usage(ev)
            last["timings"] = timings(ev)
            return [last, b"data: [DONE]\n\n"]

        return await stream_sse(
            request, g, render, prelude=[chunk(None, None, first=True)] if chat else []
        )


async def v1_completions(request: web.Request) -> web.StreamResponse:
    body, prompt = await read_completion(request)
    return await _run_openai(request, body, prompt, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    check_model(request, body)
    prompt = chat_prompt(body, request.app[SETTINGS].n_ctx)
    return await _run_openai(request, body, prompt, chat=True)
