"""Model engines. Each runs only inside a worker process (never in the web process).

``create_engine(settings, worker_index)`` builds the engine named by ``settings.engine``:

* ``llama-cpp``: ``llamacpp.engine.LlamaCppEngine`` (one slot per worker process).
* ``torch``: ``torch.engine.create_engine`` (one process, ``max_batch_size`` slots).

Each engine's module is imported only when it is chosen: torch and llama-cpp-python are
optional extras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmproxy.backend.engines.base import Engine
    from llmproxy.backend.settings import BackendSettings


def create_engine(settings: BackendSettings, worker_index: int = 0) -> Engine:
    if settings.engine == "llama-cpp":
        from llmproxy.backend.engines.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine(settings, worker_index)
    if settings.engine == "torch":
        from llmproxy.backend.engines.torch.engine import create_engine as create_torch

        return create_torch(settings, worker_index)
    raise ValueError(f"unknown engine {settings.engine!r}")
