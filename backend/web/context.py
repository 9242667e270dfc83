"""App-level state of the backend's web layer: typed ``AppKey``s and the model's name.

``create_app`` (app.py) fills the keys once; handlers only read them. The model is
listed under its alias (``--model-alias`` or the GGUF file's stem); requests may name it
anything (one model is loaded, as in llama-server: ``requests.check_model``).
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
