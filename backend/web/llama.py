"""llama-server native generation routes: POST /completion(s) and /infill.

Response shapes follow llama-server: a non-streamed request gets one JSON object with
``content``, ``stop_type``, ``timings`` and the ``generation_settings``; a streamed one
gets SSE events with one ``content`` piece each and then the same final object (empty
``content``). ``n_cmpl`` > 1 (llama.vscode; up to the slot count, as in llama-server)
gets a JSON array of that many final objects (``index`` 0..n-1), generated at once on that
many slots, as llama-server does: the request's ``id_slot`` (or the lowest free slot) runs
the first, the lowest other free slots the rest, all started together once all are free
(the proxy holds one permit per slot and grants the same slots); not streamed. A stream
that fails before its first token gets a plain JSON error with the right status; after
the first token, an SSE event ``data: {"error": {...}}``. A request's ``response_fields``
(llama.vim sends them) narrows each final object, not the partial events of a stream, to
those paths (``select_fields``), as llama-server does. Cancellation is ``Gen``'s (gen.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams, Token
from llmproxy.backend.web.context import DISPATCHER, SETTINGS, alias
from llmproxy.backend.web.errors import BadRequest, failed_response, json_response
from llmproxy.backend.web.gen import STOP_TYPE, Gen, collect, gen_settings, stream_sse, timings
from llmproxy.backend.web.params import boolean, sampling_params
from llmproxy.backend.web.requests import (
    check_model,
    id_slot,
    infill_prompt,
    n_cmpl,
    read_body,
    read_completion,
    response_fields,
)


def _context_full(d: Done, params: SamplingParams, n_ctx: int) -> bool:
    """llama-server's ``truncated``: the generation stopped because the context was full,
    not because it produced the ``n_predict`` asked for (checked first there, so a request
    for exactly the room left is not truncated)."""
    asked = params.n_predict
    return (
        d.stop_reason == "limit"
        and d.n_prompt_tokens + d.n_predicted >= n_ctx
        and not 0 <= asked <= d.n_predicted
    )


def select_fields(obj: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields`` rule (``json_get_nested_values``): ``obj`` itself
    when ``paths`` is empty; else, in the order of ``paths``, ``{path: value}`` for each path
    whose "/"-separated keys lead through nested objects to a value (the key is the whole
    path, e.g. ``{"timings/prompt_n": 12}``); a path that leads nowhere is left out."""
    if not paths:
        return obj
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = obj
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def _final_llama(
    app: web.Application, g: Gen, content: str, fields: Sequence[str], index: int = 0
) -> dict[str, Any]:
    d = g.done
    assert d is not None
    return select_fields(
        {
            "index": index,
            "content": content,
            "tokens": [],
            "id_slot": g.slot_id,
            "stop": True,
            "model": alias(app),
            "tokens_predicted": d.n_predicted,
            "tokens_evaluated": d.n_prompt_tokens,
            "generation_settings": gen_settings(g.params),
            "prompt": "",
            "has_new_line": "\n" in "".join(g.content),
            "truncated": _context_full(d, g.params, app[SETTINGS].n_ctx),
            "stop_type": STOP_TYPE[d.stop_reason],
            "stopping_word": d.stopping_word,
            "tokens_cached": d.n_prompt_tokens + d.n_predicted,
            "timings": timings(d),
        },
        fields,
    )


async def _run_llama(
    request: web.Request, body: dict[str, Any], prompt: Prompt
) -> web.StreamResponse:
    app = request.app
    params = sampling_params(body)
    slot = id_slot(body, app[DISPATCHER])
    stream = boolean(body, "stream")
    count = n_cmpl(body, app[DISPATCHER])
    fields = response_fields(body)
    if count > 1:
        if stream:
            raise BadRequest("'n_cmpl' > 1 is supported without streaming only")
        return await _several(request, prompt, params, slot, count, fields)
    async with Gen(request, prompt, params, slot) as g:
        if not stream:
            failed = await collect(g)
            return (
                failed_response(failed)
                if failed
                else json_response(_final_llama(app, g, "".join(g.content), fields))
            )

        def render(ev: Token | Done) -> list[Any]:
            if isinstance(ev, Done):
                return [_final_llama(app, g, "", fields)]
            return [
                {
                    "index": 0,
                    "content": ev.text,
                    "tokens": [],
                    "stop": False,
                    "id_slot": g.slot_id,
                    "tokens_predicted": ev.n_decoded,
                    "tokens_evaluated": 0,
                }
            ]

        return await stream_sse(request, g, render)


async def _several(
    request: web.Request,
    prompt: Prompt,
    params: SamplingParams,
    slot: int,
    count: int,
    fields: Sequence[str],
) -> web.Response:
    """``count`` completions of one prompt at once on ``count`` slots (a fixed seed advances
    by one for each). Each runs in its own ``Gen``; a client that leaves cancels them all
    (the handler's cancellation reaches every ``Gen`` through the exit stack), and one that
    fails stops the others, as in llama-server: the answer is that failure."""
    dispatcher = request.app[DISPATCHER]
    each = [
        params if params.seed is None or params.seed < 0 else replace(params, seed=params.seed + i)
        for i in range(count)
    ]
    reqs = await dispatcher.start_requests(prompt, each, slot)
    gens = [Gen(request, prompt, p, r.slot.id, req=r) for p, r in zip(each, reqs, strict=True)]

    async def run(g: Gen) -> Failed | None:
        failed = await collect(g)
        if failed is not None:
            for r in reqs:
                dispatcher.cancel(r)  # a no-op for those already finished
        return failed

    async with contextlib.AsyncExitStack() as stack:
        for g in gens:
            await stack.enter_async_context(g)

        def cancel_all() -> None:
            for r in reqs:
                dispatcher.cancel(r)

        # unwound first: on any early exit every request is told to stop before any Gen waits
        stack.callback(cancel_all)
        async with asyncio.TaskGroup() as tg:
            runs = [tg.create_task(run(g)) for g in gens]
    failed = next((f for f in (r.result() for r in runs) if f is not None), None)
    if failed:
        return failed_response(failed)
    return json_response(
        [_final_llama(request.app, g, "".join(g.content), fields, i) for i, g in enumerate(gens)]
    )


async def completion(request: web.Request) -> web.StreamResponse:
    body, prompt = await read_completion(request)
    return await _run_llama(request, body, prompt)


async def infill(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    check_model(request, body)
    return await _run_llama(request, body, infill_prompt(body))
