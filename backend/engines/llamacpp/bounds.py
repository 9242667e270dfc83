"""What a prompt may cost llama.cpp's tokenizer, decided before it is tokenized.

llama.cpp first splits a text on the strings of special (and user-defined) tokens
(``tokenizer_st_partition``) in time that grows with the square of the matches: 40k
``<|im_end|>`` take seconds, 150k minutes, in one C call that nothing can interrupt and
that would hold the slot's worker meanwhile. A text that cannot fit the context is
therefore refused (``PromptTooLong``, a 400 ``exceed_context_size_error``) by two linear
scans, before any tokenization:

* it has more bytes than ``n_ctx`` times the longest token's bytes (so more than
  ``n_ctx`` tokens), or
* it holds ``n_ctx`` or more special-token strings (each one becomes one token).

What remains reaches the tokenizer with fewer than ``n_ctx`` matches and a bounded size.
Infill texts, which are cut to fit rather than refused, are trimmed to ``max_chars``
before tokenizing (``prompts.infill_tokens``). Built once per loaded model, on the
engine's thread; read-only afterwards.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from llmproxy.backend.engines.prompts import PromptTooLong

PIECE_BUF = 1024


class TokenBounds:
    """The longest token and the special-token strings of one vocabulary, and the checks."""

    def __init__(self, vocab: Any, n_ctx: int) -> None:
        import llama_cpp

        self.n_ctx = n_ctx
        buf = ctypes.create_string_buffer(PIECE_BUF)
        longest = 1
        special: list[bytes] = []
        user: list[bytes] = []
        ctrl = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        for tok in range(llama_cpp.llama_vocab_n_tokens(vocab)):
            n = llama_cpp.llama_token_to_piece(vocab, tok, buf, PIECE_BUF, 0, True)
            longest = max(longest, abs(n))
            attr = llama_cpp.llama_vocab_get_attr(vocab, tok)
            if attr & (ctrl | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED):
                text = llama_cpp.llama_vocab_get_text(vocab, tok)
                if text:
                    special.append(text)
                    if not attr & ctrl:
                        user.append(text)
        self.longest_token_bytes = longest
        self.max_bytes = n_ctx * longest
        # a token covers at most ``longest`` bytes, so at most that many characters
        self.max_chars = self.max_bytes
        self._all = _alternation(special)
        self._user = _alternation(user)

    def check(self, data: bytes, special: bool) -> None:
        """Raise ``PromptTooLong`` if ``data`` (UTF-8) cannot fit ``n_ctx`` tokens; linear.
        ``special``: special tokens are parsed (user-defined ones always are)."""
        if len(data) > self.max_bytes:
            raise PromptTooLong(
                "the request exceeds the available context size: the prompt has "
                f"{len(data)} bytes, more than {self.n_ctx} tokens of at most "
                f"{self.longest_token_bytes} bytes each (the context is {self.n_ctx})"
            )
        pattern = self._all if special else self._user
        if pattern is None:
            return
        for count, _ in enumerate(pattern.finditer(data), 1):
            if count >= self.n_ctx:
                raise PromptTooLong(
                    "the request exceeds the available context size: the prompt has "
                    f"{self.n_ctx} or more special-token strings, each one token "
                    f"(the context is {self.n_ctx})"
                )


def _alternation(texts: list[bytes]) -> re.Pattern[bytes] | None:
    """One pattern matching any of ``texts``, longest first (as llama.cpp splits)."""
    if not texts:
        return None
    ordered = sorted(set(texts), key=len, reverse=True)
    return re.compile(b"|".join(re.escape(t) for t in ordered))
