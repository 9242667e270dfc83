"""OpenAI-compatible backends (vLLM, llama-cpp-python server, LM Studio, ...).

Nothing shows whether a generation stopped. A streaming one stops at its next token when
its connection closes (vLLM aborts it; llama-cpp-python's server checks for a dropped client
after each chunk), so policy auto cancels a stream and holds its permit about one token's
time; a non-streaming one may run on unseen (llama-cpp-python never checks), so auto lets
it finish (drain and discard).
"""

from __future__ import annotations

from llmproxy.proxy.upstream.adapters.base import Adapter


class OpenAIAdapter(Adapter):
    kind = "openai"
    stops_streams = True
