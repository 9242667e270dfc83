"""The llama-cpp engine's prompt rules over a vocabulary-only model, for tokenizer threads.

``load_prompts`` opens the GGUF with ``vocab_only`` (the vocabulary and metadata, no
weights and no context: about 0.2 s and a few MB for SmolLM2) and wraps it in the same
``LlamaPrompts`` the engine uses, so the token ids it gives are the ones the worker would
have made (and its prompt cache finds the same prefixes). ``VocabOnly`` is the part of
``llama_cpp.Llama`` that ``LlamaPrompts`` reads, over llama-cpp-python's model object
alone: a ``Llama`` would also create a context (and llama.cpp would warn, on every start,
that it exceeds a vocabulary's training context of 0). Built once per server, on a thread
of the runtime's tokenizer pool; afterwards ``LlamaPrompts.tokens`` is called from several
of those threads at once: llama.cpp's tokenizer only reads the vocabulary, and ctypes
releases the GIL for the call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from llmproxy.backend.engines.llamacpp.text import LlamaPrompts
from llmproxy.backend.model_path import resolve_model

if TYPE_CHECKING:
    from llama_cpp import Llama

    from llmproxy.backend.settings import BackendSettings


class VocabOnly:
    """``Llama``'s ``_model``, ``metadata``, ``tokenize``, ``detokenize`` and ``n_vocab``
    over a vocabulary-only model (read-only once built)."""

    def __init__(self, model_path: Path) -> None:
        import llama_cpp
        from llama_cpp import _internals, _logger

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        # Quiet through llama.cpp's log callback (errors still shown), never with
        # ``verbose=False``: that points the process's fds 1 and 2 at /dev/null while the
        # model loads, and this runs on a thread of the server's process, whose other
        # threads' log lines would be lost meanwhile.
        _logger.set_verbose(False)
        self._model: Any = _internals.LlamaModel(
            path_model=str(model_path), params=params, verbose=True
        )
        self.metadata: dict[str, str] = self._model.metadata()

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return list(self._model.tokenize(text, add_bos=add_bos, special=special))

    def detokenize(self, tokens: list[int], special: bool = False) -> bytes:
        return bytes(self._model.detokenize(tokens, special=special))

    def n_vocab(self) -> int:
        return int(self._model.n_vocab())


def load_prompts(settings: BackendSettings) -> LlamaPrompts:
    vocab = VocabOnly(resolve_model(settings.model))
    # LlamaPrompts reads only what VocabOnly has of a Llama
    return LlamaPrompts(cast("Llama", vocab), int(settings.n_ctx), int(settings.n_predict_max))
