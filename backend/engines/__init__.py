"""Model engines. Each runs only inside a worker process (never in the web process).

``create_engine(settings, worker_index)`` builds the engine named by ``settings.engine``:

* ``llama-cpp``: ``llamacpp.engine.LlamaCppEngine`` (one slot per worker process).
* ``torch``: ``torch.engine.create_engine`` (one process, ``max_batch_size`` slots).

``create_prompts(settings, info)`` builds the chosen engine's prompt rules over its
tokenizer alone (``PromptTokens``): the one part of an engine that runs in the web
process, on the runtime's tokenizer threads (``runtime/tokenize.py``), so that no prompt
is tokenized on a slot.

Each engine's module is imported only when it is chosen: torch and llama-cpp-python are
optional extras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmproxy.backend.engines.base import Engine, PromptTokens
    from llmproxy.backend.protocol import EngineInfo
    from llmproxy.backend.settings import BackendSettings


def create_engine(settings: BackendSettings, worker_index: int = 0) -> Engine:
    if settings.engine == "llama-cpp":
        from llmproxy.backend.engines.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine(settings, worker_index)
    if settings.engine == "torch":
        from llmproxy.backend.engines.torch.engine import create_engine as create_torch

        return create_torch(settings, worker_index)
    raise ValueError(f"unknown engine {settings.engine!r}")


def create_prompts(settings: BackendSettings, info: EngineInfo) -> PromptTokens:
    """The prompt rules of ``settings.engine`` over its tokenizer; ``info`` is a ready
    worker's (the torch engine reads the tokenizer from the weights it loaded). Blocks
    (loads a vocabulary): call it on a tokenizer thread."""
    if settings.engine == "llama-cpp":
        from llmproxy.backend.engines.llamacpp.vocab import load_prompts

        return load_prompts(settings)
    if settings.engine == "torch":
        from llmproxy.backend.engines.torch.vocab import load_prompts as load_torch_prompts

        weights_dir = dict(info.extra).get("weights_dir")
        if not weights_dir:
            raise ValueError("the torch worker reported no weights_dir")
        return load_torch_prompts(settings, weights_dir)
    raise ValueError(f"unknown engine {settings.engine!r}")
