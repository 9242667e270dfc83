"""OpenAI-compatible backends (vLLM, llama-cpp-python server, LM Studio, ...).

Nothing shows whether a generation stopped, so the default in-flight policy is
``finish`` (drain and discard); cancel = close the connection, unconfirmed.
"""

from __future__ import annotations

from llmproxy.proxy.adapters.base import Adapter


class OpenAIAdapter(Adapter):
    kind = "openai"
