"""Torch engine: prompts -> token ids, and token ids -> streamed text.

Prompt rules are the llama-cpp engine's (shared in ``prompts``), over a Hugging Face
tokenizer: completion text is tokenized with special tokens parsed (BOS as the model's
``add_bos`` says), chat uses the tokenizer's chat template (ChatML when it has none),
infill uses the FIM tokens when the vocabulary has them
(``BOS [FIM_REP "myproject\\n" (FIM_SEP name "\\n" text)* FIM_SEP "filename\\n"] FIM_PRE
prefix+prompt FIM_SUF suffix FIM_MID``) and otherwise the documented prefix-only fallback
(plain continuation of extra texts + prefix + prompt; the suffix is ignored).

``Detokenizer`` turns one token at a time into text without splitting a multi-byte
character: text is only released once it no longer ends in U+FFFD.
"""

from __future__ import annotations

from typing import Any

from llmproxy.backend.engines.prompts import CHATML, chat_messages, given_tokens, infill_tokens
from llmproxy.backend.protocol import Prompt

_FIM_NAMES = {
    "pre": ("<fim_prefix>", "<|fim_prefix|>", "<|fim_begin|>", "<PRE>"),
    "suf": ("<fim_suffix>", "<|fim_suffix|>", "<|fim_hole|>", "<SUF>"),
    "mid": ("<fim_middle>", "<|fim_middle|>", "<|fim_end|>", "<MID>"),
    "rep": ("<reponame>", "<repo_name>", "<|repo_name|>"),
    "sep": ("<file_sep>", "<|file_sep|>"),
}
_EOG_NAMES = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
)


def _vocab_id(vocab: dict[str, int], names: tuple[str, ...]) -> int:
    for n in names:
        if n in vocab:
            return vocab[n]
    return -1


class PromptBuilder:
    """Builds token ids for a ``Prompt`` with one tokenizer (llama-cpp engine's rules)."""

    def __init__(self, tokenizer: Any, add_bos: bool, n_ctx: int, n_predict_max: int) -> None:
        self.tok = tokenizer
        self.n_ctx = n_ctx
        self.n_predict_max = n_predict_max
        vocab = tokenizer.get_vocab()
        ids = {k: _vocab_id(vocab, names) for k, names in _FIM_NAMES.items()}
        self.fim = (
            (ids["pre"], ids["suf"], ids["mid"])
            if min(ids["pre"], ids["suf"], ids["mid"]) >= 0
            else None
        )
        self.fim_rep, self.fim_sep = ids["rep"], ids["sep"]
        bos = tokenizer.bos_token_id
        self.bos = [bos] if add_bos and bos is not None else []
        self.bos_text = tokenizer.bos_token if self.bos else ""
        self.chat_template = tokenizer.chat_template or CHATML
        eog = {vocab[n] for n in _EOG_NAMES if n in vocab}
        if tokenizer.eos_token_id is not None:
            eog.add(tokenizer.eos_token_id)
        self.eog = frozenset(eog)

    def _tok(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids) if text else []

    def _plain(self, text: str) -> list[int]:
        """Tokenize without parsing special tokens (user code must not inject them)."""
        if not text:
            return []
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def tokens(self, prompt: Prompt, n_predict: int) -> list[int]:
        if prompt.kind == "completion":
            if prompt.tokens is not None:
                return given_tokens(prompt.tokens, len(self.tok))
            return self.bos + self._tok(prompt.text)
        if prompt.kind == "chat":
            text = self.tok.apply_chat_template(
                chat_messages(prompt),
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )
            bos = [] if (self.bos_text and text.startswith(self.bos_text)) else self.bos
            return bos + self._tok(text)
        return self._infill(prompt, n_predict)

    def _infill(self, prompt: Prompt, n_predict: int) -> list[int]:
        return infill_tokens(
            prompt,
            self._plain,
            self.bos,
            self.fim,
            self.fim_rep,
            self.fim_sep,
            self.n_ctx,
            n_predict,
            self.n_predict_max,
        )


class Detokenizer:
    """Incremental decoding (prefix/read offsets): never emits half a UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (possibly an incomplete character) at the end."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]
