"""OpenAI-compatible backends (vLLM, llama-cpp-python's server, LM Studio, ...).

Nothing shows whether a generation stopped: no view of the slots, so policy auto cancels a
stream (its generation stops at the next token: ``OpenAIDialect.stops_streams``) and holds
its permit about one token's time, and lets other requests finish (drain and discard). How
their bodies are written is ``OpenAIDialect``'s (dialects/openai.py).
"""

from __future__ import annotations

from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.dialects.base import Dialect
from llmproxy.proxy.upstream.dialects.openai import OpenAIDialect


class OpenAIAdapter(Adapter):
    kind = "openai"

    def initial_dialect(self) -> Dialect:
        return OpenAIDialect(streams=self.settings.upstream_stream != "off")
