"""llama-cpp engine: prompts -> token ids, and token ids -> streamed text.

Prompt rules are the shared ones (``engines/prompts.py``) over a loaded ``Llama``:

* completion: the text (special tokens parsed) or the given token ids; a text that cannot
  fit the context is refused before it is tokenized (``bounds.TokenBounds``).
* infill: with FIM tokens in the vocab (``llama_vocab_fim_pre/suf/mid``):
  ``[BOS] [extra: FIM_REP "myproject\\n" (FIM_SEP filename "\\n" text)*] FIM_PRE prefix+prompt
  FIM_SUF suffix FIM_MID`` (llama-server's layout), the prefix truncated on the left and
  the suffix on the right to fit the context. **Fallback** for vocabularies without FIM
  tokens: plain continuation of ``extra texts + prefix + prompt`` (the suffix is
  ignored), so the model still completes the current line.
* chat: the GGUF's ``tokenizer.chat_template`` (Jinja2), else ChatML.

``Utf8Stream`` turns one token at a time into text without splitting a UTF-8 character.
Both are used only on the engine's thread.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from llmproxy.backend.engines.llamacpp.bounds import TokenBounds
from llmproxy.backend.engines.prompts import CHATML, chat_messages, given_tokens, infill_tokens
from llmproxy.backend.protocol import Prompt

if TYPE_CHECKING:
    from llama_cpp import Llama
    from llama_cpp.llama_types import ChatCompletionRequestMessage


class Utf8Stream:
    """Token ids to text through ``Llama.detokenize`` (bytes), one token at a time; an
    incremental UTF-8 decoder keeps a split character back until it is complete."""

    def __init__(self, detokenize: Callable[[list[int]], bytes]) -> None:
        self._detokenize = detokenize
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._detokenize([token]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class LlamaPrompts:
    """Token ids for a ``Prompt`` over one loaded ``Llama``, and its end-of-generation tokens."""

    def __init__(self, llm: Llama, n_ctx: int, n_predict_max: int) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm = llm
        self.n_ctx = n_ctx
        self.n_predict_max = n_predict_max
        model = llm._model
        self._vocab = model.vocab
        self.bounds = TokenBounds(self._vocab, n_ctx)
        self._is_eog = llama_cpp.llama_vocab_is_eog
        self.fim: tuple[int, int, int] | None = None
        self.fim_rep = -1
        self.fim_sep = -1
        pre, suf, mid = model.token_prefix(), model.token_suffix(), model.token_middle()
        if min(pre, suf, mid) >= 0:
            self.fim = (pre, suf, mid)
            self.fim_rep = llama_cpp.llama_vocab_fim_rep(self._vocab)
            self.fim_sep = llama_cpp.llama_vocab_fim_sep(self._vocab)
        meta = llm.metadata or {}
        self.chat_template: str = meta.get("tokenizer.chat_template") or CHATML
        bos_id, eos_id = model.token_bos(), model.token_eos()
        bos = (
            llm.detokenize([bos_id], special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
        )
        eos = (
            llm.detokenize([eos_id], special=True).decode("utf-8", "replace") if eos_id >= 0 else ""
        )
        self._chat = Jinja2ChatFormatter(template=self.chat_template, eos_token=eos, bos_token=bos)
        self._bos_text = bos

    def eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, EOT...)."""
        return bool(self._is_eog(self._vocab, token))

    def tokens(self, prompt: Prompt, n_predict: int) -> list[int]:
        if prompt.kind == "completion":
            if prompt.tokens is not None:
                return given_tokens(prompt.tokens, self.llm.n_vocab())
            return self._add_bos() + self._tok(prompt.text)
        if prompt.kind == "chat":
            # llama_cpp types messages as TypedDicts; ours are plain dicts with the same keys
            messages = cast("list[ChatCompletionRequestMessage]", chat_messages(prompt))
            text = self._chat(messages=messages).prompt
            bos = [] if (self._bos_text and text.startswith(self._bos_text)) else self._add_bos()
            return bos + self._tok(text)
        return infill_tokens(
            prompt,
            lambda text: self._tok(text, special=False, check=False),
            self._add_bos(),
            self.fim,
            self.fim_rep,
            self.fim_sep,
            self.n_ctx,
            n_predict,
            self.n_predict_max,
            self.bounds.max_chars,
        )

    def _tok(
        self, text: str, add_bos: bool = False, special: bool = True, check: bool = True
    ) -> list[int]:
        """``text``'s tokens; with ``check``, a text that cannot fit the context is refused
        first (``TokenBounds.check``: ``PromptTooLong``) rather than tokenized."""
        if not text:
            return []
        data = text.encode("utf-8")
        if check:
            self.bounds.check(data, special)
        return self.llm.tokenize(data, add_bos=add_bos, special=special)

    def _add_bos(self) -> list[int]:
        model = self.llm._model
        return [model.token_bos()] if model.add_bos_token() and model.token_bos() >= 0 else []
