"""OpenAI-compatible backends (vLLM, llama-cpp-python's server, LM Studio, ...).

A streaming generation stops at its next token when its connection closes (vLLM aborts
it; llama-cpp-python's server checks for a dropped client after each chunk). A
non-streaming one may run on unseen (llama-cpp-python never checks), so a non-streaming
``/v1/completions`` request is sent as a stream and answered whole (assemble.py), unless
``upstream_stream`` is off: cancelling it then stops its generation at the next token too.
The answer carries ``usage`` only where the stream does (llama-cpp-python's does not;
``stream_options`` is not sent, as servers that do not know it may refuse it). Other
non-streaming requests (chat, ``n`` > 1, ``logprobs``) are sent as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmproxy.proxy.relay.assemble import OAI_ROUTES
from llmproxy.proxy.request import Body
from llmproxy.proxy.upstream.assemble import assembles
from llmproxy.proxy.upstream.dialects.base import Dialect
from llmproxy.proxy.upstream.dialects.body import set_top_level


@dataclass(frozen=True, slots=True)
class OpenAIDialect(Dialect):
    kind: str = "openai"
    stops_streams: bool = True
    #: ``upstream_stream`` is not off: completions may be sent as streams
    streams: bool = True

    def assembles(self, path: str, body: Body) -> bool:
        if not self.streams or path not in OAI_ROUTES:
            return False
        return body.get("n") in (None, 1) and assembles(path, body)

    def prepare_body(self, path: str, raw: bytes, body: Body, slot: int) -> bytes:
        if self.assembles(path, body):
            raw = set_top_level(raw, "stream", True, present="stream" in body)
        return raw
