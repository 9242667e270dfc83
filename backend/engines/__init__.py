"""Model engines. Each runs only inside a worker process (never in the web process).

``create_engine(settings, worker_index)`` picks the engine named by ``settings.engine``:

* ``llama-cpp``: ``llamacpp_engine.LlamaCppEngine`` (one slot per worker process).
* ``torch``: ``torch_engine.create_engine(settings, worker_index)`` if that module defines
  it, else ``torch_engine.TorchEngine(settings)`` (one process, ``max_batch_size`` slots).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmproxy.backend.engines.base import Engine
    from llmproxy.backend.settings import BackendSettings


def create_engine(settings: BackendSettings, worker_index: int = 0) -> Engine:
    if settings.engine == "llama-cpp":
        from llmproxy.backend.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(settings, worker_index)
    if settings.engine == "torch":
        mod = importlib.import_module("llmproxy.backend.engines.torch.engine")
        factory = getattr(mod, "create_engine", None)
        if factory is not None:
            return factory(settings, worker_index)
        return mod.TorchEngine(settings)
    raise ValueError(f"unknown engine {settings.engine!r}")
