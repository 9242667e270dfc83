"""The web layer: a llama-server compatible HTTP API (subset) over the dispatcher.

Routes: POST /completion /completions /infill /v1/completions /v1/chat/completions
/chat/completions; GET /health /props /slots /v1/models /models.

Errors use llama-server's envelope ``{"error": {"code", "message", "type"}}``. A
streamed request that fails before its first token gets a plain JSON error with the
right status; after the first token, an SSE event ``data: {"error": {...}}``.

Cancellation: the app runs with ``handler_cancellation=True``; when a client goes away
its handler is cancelled, sends ``Cancel`` to the worker and returns. The slot stays
``is_processing`` in /slots until the worker's ``Done`` arrives (the dispatcher owns
that bookkeeping), and a response body always ends after the worker finished with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import structlog
from aiohttp import web
from llmproxy.backend.dispatch import Dispatcher, Request, Unavailable
from llmproxy.backend.model_path import resolve_model
from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams, Token
from llmproxy.backend.settings import BackendSettings

log = structlog.get_logger("llmproxy.backend.app")

DISPATCHER = web.AppKey("dispatcher", Dispatcher)
SETTINGS = web.AppKey("settings", BackendSettings)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    502: "server_error",
    503: "unavailable_error",
}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def error_response(code: int, message: str, type_: str | None = None, **extra: Any) -> web.Response:
    body = {"error": {"code": code, "message": message, "type": type_ or _ERROR_TYPES.get(code, "server_error")}}
    body.update(extra)
    return json_response(body, code)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(exc.status, str(exc), exc.type)
    except Unavailable as exc:
        return error_response(503, str(exc), "unavailable_error")
    except web.HTTPException as exc:
        if exc.status >= 400:
            msg = "File Not Found" if exc.status == 404 else exc.reason
            return error_response(exc.status, msg)
        raise


# --- request parsing ----------------------------------------------------------------


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _num(body: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{key}' must be a number")
    return kind(v)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise BadRequest("'stop' must be a string or a list of strings")


def _params(body: dict[str, Any], openai: bool = False) -> SamplingParams:
    d = SamplingParams()
    n_predict = body.get("n_predict")
    if openai:
        n_predict = body.get("max_completion_tokens", body.get("max_tokens", n_predict))
    if n_predict is None:
        n_predict = -1
    if isinstance(n_predict, bool) or not isinstance(n_predict, int):
        raise BadRequest("'n_predict' / 'max_tokens' must be an integer")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer")
    tmax = body.get("t_max_predict_ms")
    if tmax is not None and (isinstance(tmax, bool) or not isinstance(tmax, (int, float))):
        raise BadRequest("'t_max_predict_ms' must be a number")
    return SamplingParams(
        n_predict=max(-1, n_predict),
        temperature=_num(body, "temperature", d.temperature, float),
        top_k=_num(body, "top_k", d.top_k, int),
        top_p=_num(body, "top_p", d.top_p, float),
        min_p=_num(body, "min_p", d.min_p, float),
        seed=None if seed is None or seed < 0 else seed,
        stop=_stop(body),
        t_max_predict_ms=int(tmax) if tmax else None,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _id_slot(body: dict[str, Any], dispatcher: Dispatcher) -> int:
    v = body.get("id_slot", -1)
    if v is None:
        return -1
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest("'id_slot' must be an integer")
    if v >= len(dispatcher.slots):
        raise BadRequest(f"id_slot {v} does not exist (total_slots={len(dispatcher.slots)})")
    return v if v >= 0 else -1


def _prompt_field(value: Any, key: str = "prompt") -> Prompt:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return Prompt(kind="completion", text=value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return Prompt(kind="completion", tokens=tuple(value))
    raise BadRequest(f"'{key}' must be a string or a list of token ids")


def _model_names(app: web.Application) -> set[str]:
    d = app[DISPATCHER]
    names = {_alias(app)}
    path = _model_path(app)
    names |= {path, path.rsplit("/", 1)[-1]}
    names.add(path.rsplit("/", 1)[-1].rsplit(".", 1)[0])
    for w in d.workers:
        if w.info is not None:
            names |= {w.info.model_alias, w.info.model_path}
    return {n for n in names if n}


def _check_model(request: web.Request, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is None or model == "":
        return
    if not isinstance(model, str) or model not in _model_names(request.app):
        raise BadRequest(f"model '{model}' not found", 404, "not_found_error")


def _alias(app: web.Application) -> str:
    s = app[SETTINGS]
    return s.model_alias or app["model_path"].rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _model_path(app: web.Application) -> str:
    return app["model_path"]


# --- generation driving ------------------------------------------------------------


class Gen:
    """Runs one request; tracks the text and final event for the response builders."""

    def __init__(self, request: web.Request, prompt: Prompt, params: SamplingParams, id_slot: int) -> None:
        self.http = request
        self.dispatcher = request.app[DISPATCHER]
        self.prompt = prompt
        self.params = params
        self.id_slot = id_slot
        self.req: Request | None = None
        self.content: list[str] = []
        self.done: Done | None = None
        self.failed: Failed | None = None

    async def __aenter__(self) -> Gen:
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


def _failed_response(f: Failed) -> web.Response:
    return error_response(f.status, f.message, f.type if f.type != "server_error" else None)


def _timings(d: Done) -> dict[str, Any]:
    prompt_n = max(0, d.n_prompt_tokens - d.n_cached)
    return {
        "prompt_n": prompt_n,
        "prompt_ms": round(d.prompt_ms, 3),
        "prompt_per_token_ms": round(d.prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(prompt_n * 1000.0 / d.prompt_ms, 3) if d.prompt_ms > 0 else 0.0,
        "predicted_n": d.n_predicted,
        "predicted_ms": round(d.predicted_ms, 3),
        "predicted_per_token_ms": round(d.predicted_ms / d.n_predicted, 3) if d.n_predicted else 0.0,
        "predicted_per_second": round(d.n_predicted * 1000.0 / d.predicted_ms, 3) if d.predicted_ms > 0 else 0.0,
    }


_STOP_TYPE = {"eos": "eos", "limit": "limit", "time": "limit", "word": "word", "cancelled": "none"}
_FINISH = {"eos": "stop", "word": "stop", "limit": "length", "time": "length", "cancelled": "stop"}


def _gen_settings(app: web.Application, p: SamplingParams | None) -> dict[str, Any]:
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
    }


def _final_llama(app: web.Application, g: Gen, content: str) -> dict[str, Any]:
    d = g.done
    assert d is not None
    return {
        "index": 0,
        "content": content,
        "tokens": [],
        "id_slot": g.slot_id,
        "stop": True,
        "model": _alias(app),
        "tokens_predicted": d.n_predicted,
        "tokens_evaluated": d.n_prompt_tokens,
        "generation_settings": _gen_settings(app, g.params),
        "prompt": "",
        "has_new_line": "\n" in "".join(g.content),
        "truncated": False,
        "stop_type": _STOP_TYPE[d.stop_reason],
        "stopping_word": d.stopping_word,
        "tokens_cached": d.n_prompt_tokens + d.n_predicted,
        "timings": _timings(d),
    }


async def _sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    await resp.prepare(request)
    return resp


async def _sse(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(f"data: {_dumps(obj)}\n\n".encode())


async def _sse_error(resp: web.StreamResponse, f: Failed) -> None:
    t = f.type if f.type != "server_error" else _ERROR_TYPES.get(f.status, "server_error")
    await _sse(resp, {"error": {"code": f.status, "message": f.message, "type": t}})


async def _run_llama(request: web.Request, body: dict[str, Any], prompt: Prompt) -> web.StreamResponse:
    app = request.app
    params = _params(body)
    id_slot = _id_slot(body, app[DISPATCHER])
    stream = bool(body.get("stream", False))
    async with Gen(request, prompt, params, id_slot) as g:
        if not stream:
            async for _ in g.events():
                pass
            if g.failed:
                return _failed_response(g.failed)
            return json_response(_final_llama(app, g, "".join(g.content)))
        resp: web.StreamResponse | None = None
        async for ev in g.events():
            if isinstance(ev, Failed):
                if resp is None:
                    return _failed_response(ev)
                await _sse_error(resp, ev)
                break
            if resp is None:
                resp = await _sse_start(request)
            if isinstance(ev, Token):
                await _sse(
                    resp,
                    {
                        "index": 0,
                        "content": ev.text,
                        "tokens": [],
                        "stop": False,
                        "id_slot": g.slot_id,
                        "tokens_predicted": ev.n_decoded,
                        "tokens_evaluated": 0,
                    },
                )
            elif isinstance(ev, Done):
                await _sse(resp, _final_llama(app, g, ""))
        assert resp is not None
        await resp.write_eof()
        return resp


async def completion(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    _check_model(request, body)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    return await _run_llama(request, body, _prompt_field(body["prompt"]))


async def infill(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    _check_model(request, body)
    def _str(key: str) -> str:
        v = body.get(key, "")
        if v is None:
            return ""
        if not isinstance(v, str):
            raise BadRequest(f"'{key}' must be a string")
        return v

    extra_raw = body.get("input_extra") or []
    if not isinstance(extra_raw, list):
        raise BadRequest("'input_extra' must be a list of {filename, text} objects")
    extra: list[tuple[str, str]] = []
    for chunk in extra_raw:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str):
            raise BadRequest("'input_extra' must be a list of {filename, text} objects")
        extra.append((str(chunk.get("filename", "")), chunk.get("text", "")))
    prompt = Prompt(
        kind="infill", text=_str("prompt"), prefix=_str("input_prefix"), suffix=_str("input_suffix"), extra=tuple(extra)
    )
    return await _run_llama(request, body, prompt)


# --- OpenAI-compatible ---------------------------------------------------------------


def _usage(d: Done) -> dict[str, int]:
    return {
        "prompt_tokens": d.n_prompt_tokens,
        "completion_tokens": d.n_predicted,
        "total_tokens": d.n_prompt_tokens + d.n_predicted,
    }


async def _run_openai(request: web.Request, body: dict[str, Any], prompt: Prompt, chat: bool) -> web.StreamResponse:
    app = request.app
    params = _params(body, openai=True)
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    id_slot = _id_slot(body, app[DISPATCHER])
    stream = bool(body.get("stream", False))
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = body.get("model") or _alias(app)
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

    async with Gen(request, prompt, params, id_slot) as g:
        if not stream:
            async for _ in g.events():
                pass
            if g.failed:
                return _failed_response(g.failed)
            d = g.done
            assert d is not None
            text = "".join(g.content)
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": _FINISH[d.stop_reason],
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _FINISH[d.stop_reason]}
            return json_response(
                {
                    "id": cid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": _usage(d),
                    "timings": _timings(d),
                }
            )
        resp: web.StreamResponse | None = None
        async for ev in g.events():
            if isinstance(ev, Failed):
                if resp is None:
                    return _failed_response(ev)
                await _sse_error(resp, ev)
                break
            if resp is None:
                resp = await _sse_start(request)
                if chat:
                    await _sse(resp, chunk(None, None, first=True))
            if isinstance(ev, Token):
                await _sse(resp, chunk(ev.text, None))
            elif isinstance(ev, Done):
                last = chunk(None if chat else "", _FINISH[ev.stop_reason])
                last["usage"] = _usage(ev)
                last["timings"] = _timings(ev)
                await _sse(resp, last)
                await resp.write(b"data: [DONE]\n\n")
        assert resp is not None
        await resp.write_eof()
        return resp


async def v1_completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    _check_model(request, body)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    return await _run_openai(request, body, _prompt_field(body["prompt"]), chat=False)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise BadRequest("only text content parts are supported")
        return "".join(parts)
    raise BadRequest("message 'content' must be a string or a list of text parts")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    _check_model(request, body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    msgs: list[tuple[str, str]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a 'role' and a 'content'")
        msgs.append((m["role"], _content_text(m.get("content"))))
    return await _run_openai(request, body, Prompt(kind="chat", messages=tuple(msgs)), chat=True)


# --- monitoring ----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    d = request.app[DISPATCHER]
    workers = d.workers
    if all(w.ready for w in workers):
        return json_response({"status": "ok"})
    status = "error" if any(w.state in ("error", "stopped") for w in workers) else "loading"
    progress = min(w.progress if not w.ready else 1.0 for w in workers)
    msg = "Loading model" if status == "loading" else "Model worker failed; restarting"
    return error_response(
        503,
        msg,
        "unavailable_error",
        status=status,
        progress=round(progress, 3),
        workers=[w.describe() for w in workers],
    )


def _engine_info(app: web.Application) -> dict[str, Any]:
    d = app[DISPATCHER]
    s = app[SETTINGS]
    info = next((w.info for w in d.workers if w.info is not None), None)
    out: dict[str, Any] = {"name": s.engine, "n_workers": len(d.workers)}
    if info is not None:
        out.update({"has_fim": info.has_fim, "n_ctx": info.n_ctx})
        out.update({k: v for k, v in info.extra if k != "chat_template"})
    return out


async def props(request: web.Request) -> web.Response:
    app = request.app
    d = app[DISPATCHER]
    s = app[SETTINGS]
    info = next((w.info for w in d.workers if w.info is not None), None)
    extra = dict(info.extra) if info is not None else {}
    return json_response(
        {
            "default_generation_settings": {
                "id": 0,
                "id_task": -1,
                "n_ctx": info.n_ctx if info else s.n_ctx,
                "speculative": False,
                "is_processing": False,
                "params": _gen_settings(app, None),
            },
            "total_slots": len(d.slots),
            "model_path": _model_path(app),
            "model_alias": _alias(app),
            "chat_template": extra.get("chat_template", ""),
            "modalities": {"vision": False, "audio": False},
            "build_info": "llmproxy-backend",
            "is_sleeping": any(w.state == "sleeping" for w in d.workers),
            "engine": _engine_info(app),
            "workers": [w.describe() for w in d.workers],
        }
    )


async def slots(request: web.Request) -> web.Response:
    app = request.app
    d = app[DISPATCHER]
    n_ctx = app[SETTINGS].n_ctx
    out = []
    for s in d.slots:
        req = s.request
        out.append(
            {
                "id": s.id,
                "id_task": s.id_task,
                "n_ctx": n_ctx,
                "speculative": False,
                "is_processing": req is not None,
                "n_decoded": s.n_decoded,
                "params": _gen_settings(app, s.params),
                "prompt": "",
                "next_token": {
                    "has_next_token": req is not None,
                    "has_new_line": s.has_new_line,
                    "n_remain": -1,
                    "n_decoded": s.n_decoded,
                    "stopping_word": "",
                },
                "worker": s.worker.index,
                "worker_pid": s.worker.pid,
                "worker_state": s.worker.state,
            }
        )
    return json_response(out)


async def models(request: web.Request) -> web.Response:
    app = request.app
    d = app[DISPATCHER]
    info = next((w.info for w in d.workers if w.info is not None), None)
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": _alias(app),
                    "object": "model",
                    "created": int(d.started_at),
                    "owned_by": "llmproxy",
                    "meta": {"n_ctx": info.n_ctx if info else app[SETTINGS].n_ctx, "path": _model_path(app)},
                }
            ],
        }
    )


# --- app -----------------------------------------------------------------------------


def create_app(settings: BackendSettings) -> web.Application:
    """The backend app; workers start with the app (on startup) and stop on cleanup."""
    app = web.Application(middlewares=[error_middleware], client_max_size=16 * 1024 * 1024)
    app[SETTINGS] = settings
    app["model_path"] = str(resolve_model(settings.model))
    dispatcher = Dispatcher(settings)
    app[DISPATCHER] = dispatcher

    async def lifecycle(app: web.Application) -> Any:
        await dispatcher.start()
        yield
        await dispatcher.stop(timeout_s=5.0)

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    for path in ("/completion", "/completions"):
        r.add_post(path, completion)
    r.add_post("/infill", infill)
    r.add_post("/v1/completions", v1_completions)
    for path in ("/v1/chat/completions", "/chat/completions"):
        r.add_post(path, chat_completions)
    r.add_get("/health", health)
    r.add_get("/v1/health", health)
    r.add_get("/props", props)
    r.add_get("/slots", slots)
    for path in ("/v1/models", "/models"):
        r.add_get(path, models)
    return app
