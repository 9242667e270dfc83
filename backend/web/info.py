"""Monitoring routes of the backend: GET /health, /props, /slots and /v1/models.

Shapes follow llama-server (what the proxy and editors poll), plus our own fields:
per-worker state in /props and /slots, ``engine`` in /props. /health answers 200
``{"status": "ok"}`` only when every worker is ready, else a 503 error envelope with
``status`` (``loading``/``error``), ``progress`` and ``workers`` (a worker stuck in one
step says so in the message, and /slots in ``worker_message``). All read-only.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmproxy.backend.runtime.supervisor import STUCK
from llmproxy.backend.web.context import DISPATCHER, SETTINGS, alias, model_path
from llmproxy.backend.web.errors import error_response, json_response
from llmproxy.backend.web.gen import gen_settings


async def health(request: web.Request) -> web.Response:
    d = request.app[DISPATCHER]
    workers = d.workers
    if all(w.ready for w in workers):
        states = {w.state for w in workers} - {"ready"}
        # llama-server's shape, plus the model's state while an idle engine unloaded it
        return json_response(
            {"status": "ok", "model": sorted(states)[0]} if states else {"status": "ok"}
        )
    status = "error" if any(w.state in ("error", "stopped") for w in workers) else "loading"
    progress = min(w.progress if not w.ready else 1.0 for w in workers)
    msg = "Loading model" if status == "loading" else "Model worker failed; restarting"
    stuck = next((w.message for w in workers if w.message.startswith(STUCK)), "")
    msg = f"{msg}: {stuck}" if stuck else msg
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
                "params": gen_settings(None),
            },
            "total_slots": len(d.slots),
            "model_path": model_path(app),
            "model_alias": alias(app),
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
                "is_processing": req is not None or bool(s.standins),  # see Dispatcher.submit
                "n_decoded": s.n_decoded,
                "params": gen_settings(s.params),
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
                "worker_message": s.worker.message[-500:] if s.worker.state != "ready" else "",
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
                    "id": alias(app),
                    "object": "model",
                    "created": int(d.started_at),
                    "owned_by": "llmproxy",
                    "meta": {
                        "n_ctx": info.n_ctx if info else app[SETTINGS].n_ctx,
                        "path": model_path(app),
                    },
                }
            ],
        }
    )
