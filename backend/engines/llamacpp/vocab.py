"""The llama-cpp engine's prompt rules over a vocabulary-only model, for tokenizer threads.

``load_prompts`` opens the GGUF with ``vocab_only=True`` (the vocabulary and metadata,
no weights: about 0.2 s and a few MB for SmolLM2) and wraps it in the same
``LlamaPrompts`` the engine uses, so the token ids it gives are the ones the worker would
have made (and its prompt cache finds the same prefixes). Built once per server, on a
thread of the runtime's tokenizer pool; afterwards ``LlamaPrompts.tokens`` is called from
several of those threads at once: llama.cpp's tokenizer only reads the vocabulary, and
ctypes releases the GIL for the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmproxy.backend.engines.llamacpp.text import LlamaPrompts
from llmproxy.backend.model_path import resolve_model

if TYPE_CHECKING:
    from llmproxy.backend.settings import BackendSettings


def load_prompts(settings: BackendSettings) -> LlamaPrompts:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(resolve_model(settings.model)),
        vocab_only=True,
        n_ctx=int(settings.n_ctx),
        verbose=False,
    )
    return LlamaPrompts(llm, int(settings.n_ctx), int(settings.n_predict_max))
