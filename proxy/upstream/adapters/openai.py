"""OpenAI-compatible backends (vLLM, llama-cpp-python server, LM Studio, ...).

Nothing shows whether a generation stopped. A streaming one stops at its next token when
its connection closes (vLLM aborts it; llama-cpp-python's server checks for a dropped client
after each chunk), so policy auto cancels a stream and holds its permit about one token's
time. A non-streaming one may run on unseen (llama-cpp-python never checks), so a
non-streaming ``/v1/completions`` request is sent as a stream and answered whole
(assemble.py), like llama-server's (``upstream_stream``, unless off): cancelling it then
stops its generation at the next token too. The answer carries ``usage`` only where the
stream does (llama-cpp-python's does not; ``stream_options`` is not sent, as servers that
do not know it may refuse it). Other non-streaming requests (chat, ``n`` > 1,
``logprobs``) are sent as they are, and policy auto lets them finish (drain and discard).
"""

from __future__ import annotations

from llmproxy.proxy.relay.assemble import OAI_ROUTES
from llmproxy.proxy.request import Body
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.adapters.body import set_top_level
from llmproxy.proxy.upstream.assemble import assembles


class OpenAIAdapter(Adapter):
    kind = "openai"
    stops_streams = True

    def assembles(self, path: str, parsed: Body) -> bool:
        if self.settings.upstream_stream == "off" or path not in OAI_ROUTES:
            return False
        several = isinstance(parsed, dict) and parsed.get("n") not in (None, 1)
        return not several and assembles(path, parsed)

    def prepare_body(self, path: str, raw: bytes, parsed: Body, slot: int) -> bytes:
        if self.assembles(path, parsed):
            raw = set_top_level(raw, "stream", True, present="stream" in parsed)
        return raw
