"""App-level state of the backend's web layer: typed ``AppKey``s and the model's names.

``create_app`` (app.py) fills the keys once; handlers only read them. The model answers
to its alias (``--model-alias`` or the GGUF file's stem), its path, its file name and
whatever the workers report.
"""

from __future__ import annotations

from aiohttp import web

from llmproxy.backend.runtime.dispatch import Dispatcher
from llmproxy.backend.settings import BackendSettings

DISPATCHER = web.AppKey("dispatcher", Dispatcher)
SETTINGS = web.AppKey("settings", BackendSettings)
MODEL_PATH = web.AppKey("model_path", str)


def model_path(app: web.Application) -> str:
    return app[MODEL_PATH]


def alias(app: web.Application) -> str:
    s = app[SETTINGS]
    return s.model_alias or app[MODEL_PATH].rsplit("/", 1)[-1].rsplit(".", 1)[0]


def model_names(app: web.Application) -> set[str]:
    d = app[DISPATCHER]
    names = {alias(app)}
    path = model_path(app)
    names |= {path, path.rsplit("/", 1)[-1]}
    names.add(path.rsplit("/", 1)[-1].rsplit(".", 1)[0])
    for w in d.workers:
        if w.info is not None:
            names |= {w.info.model_alias, w.info.model_path}
    return {n for n in names if n}
