"""Prompt rules shared by the llama-cpp and torch engines (over any tokenizer).

* chat: the model's chat template, else ``CHATML``; ``chat_messages`` gives its input.
* infill (``infill_tokens``): with FIM tokens ``BOS [FIM_REP "myproject\\n" (FIM_SEP name
  "\\n" text)* FIM_SEP "filename\\n"] FIM_PRE prefix+prompt FIM_SUF suffix FIM_MID``
  (llama-server's layout), the prefix truncated on the left and the suffix on the right
  to fit the context, the extra chunks all or nothing. Without FIM tokens: the documented
  prefix-only fallback (plain continuation of extra texts + prefix + prompt; the suffix
  is ignored).
* admission (``admit_tokens``): empty / too long prompts, token ids outside the vocabulary
  (``given_tokens``) and the effective ``n_predict`` (capped by the context left).

Pure functions: the tokenizer comes in as a callable; called on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmproxy.backend.protocol import Failed, Prompt

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class BadPrompt(ValueError):
    """A prompt the model cannot take (a 400 invalid_request_error)."""


class PromptTooLong(BadPrompt):
    """The prompt cannot fit the context at all."""


def given_tokens(tokens: tuple[int, ...], n_vocab: int) -> list[int]:
    """A prompt sent as token ids, each checked against the vocabulary (an id outside it
    would fail inside the model's decode, or index past its embeddings)."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise BadPrompt(
            f"token id {bad} is out of range: the model's vocabulary has {n_vocab} tokens"
        )
    return list(tokens)


def too_long(n: int, n_ctx: int) -> str:
    return (
        "the request exceeds the available context size: "
        f"the prompt has {n} tokens, the context is {n_ctx}"
    )


def chat_messages(prompt: Prompt) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in prompt.messages]


def infill_tokens(
    prompt: Prompt,
    plain: Callable[[str], list[int]],
    bos: list[int],
    fim: tuple[int, int, int] | None,
    fim_rep: int,
    fim_sep: int,
    n_ctx: int,
    n_predict: int,
    n_predict_max: int,
    max_chars: int | None = None,
) -> list[int]:
    """Token ids of an infill prompt; ``plain`` tokenizes without parsing special tokens.

    ``max_chars``: no token covers more characters than ``max_chars / n_ctx``, so only the
    last ``max_chars`` characters of the prefix, the first of the suffix and extra chunks
    of at most that many in all can reach the context: the rest is cut before tokenizing
    (``trim_infill``), which bounds the tokenizer's work whatever the body's size."""
    if max_chars is not None:
        prompt = trim_infill(prompt, max_chars, keep_extra_tail=fim is None)
    # room for the prompt: leave space for generation, at most a quarter of the context (a
    # large n_predict, Continue's 4096 say, runs until the context is full, see admit_tokens,
    # and must not squeeze the prompt to nothing)
    reserve = min(n_predict if n_predict > 0 else n_predict_max, n_ctx // 4)
    budget = max(16, n_ctx - reserve - 1)
    prefix = plain(prompt.prefix + prompt.text)
    if fim is None:
        extra = plain("".join(t for _, t in prompt.extra))
        take = budget - len(bos)
        return bos + ((extra + prefix)[-take:] if take > 0 else [])
    suffix = plain(prompt.suffix)
    pre, suf, mid = fim
    n_fixed = len(bos) + 3
    room = budget - n_fixed
    if room <= 0:
        raise PromptTooLong(too_long(n_fixed, n_ctx))
    n_suffix = min(len(suffix), room // 4)
    n_prefix = min(len(prefix), room - n_suffix)
    n_suffix = min(len(suffix), room - n_prefix)
    prefix, suffix = prefix[len(prefix) - n_prefix :], suffix[:n_suffix]
    room -= n_prefix + n_suffix
    extra = []
    if prompt.extra and room > 0:
        if fim_rep >= 0 and fim_sep >= 0:
            extra = [fim_rep] + plain("myproject\n")
            for name, text in prompt.extra:
                extra += [fim_sep] + plain(f"{name}\n{text}")
            extra += [fim_sep] + plain("filename\n")
        else:
            extra = plain("".join(t for _, t in prompt.extra))
        if len(extra) > room:
            extra = []  # all or nothing: a cut chunk would mislead the model
    return bos + extra + [pre] + prefix + [suf] + suffix + [mid]


def trim_infill(prompt: Prompt, max_chars: int, keep_extra_tail: bool) -> Prompt:
    """``prompt`` without the text that cannot reach a context of ``max_chars`` characters:
    the prefix's head, the suffix's tail, and extra chunks longer than that in all (dropped,
    as they are all or nothing; with ``keep_extra_tail``, the prefix-only fallback that
    takes the tail of their joined text, that tail as one chunk)."""
    prefix = prompt.prefix + prompt.text
    extra = prompt.extra
    if sum(len(name) + len(text) + 2 for name, text in extra) > max_chars:
        joined = "".join(t for _, t in extra)
        extra = (("", joined[-max_chars:]),) if keep_extra_tail else ()
    if len(prefix) <= max_chars and len(prompt.suffix) <= max_chars and extra is prompt.extra:
        return prompt
    return replace(
        prompt, prefix=prefix[-max_chars:], text="", suffix=prompt.suffix[:max_chars], extra=extra
    )


def admit_tokens(
    request_id: str, build: Callable[[], list[int]], n_predict: int, n_ctx: int, n_predict_max: int
) -> tuple[list[int], int] | Failed:
    """``(tokens, effective n_predict cap)`` for a request, or the ``Failed`` rejecting it."""
    try:
        tokens = build()
    except PromptTooLong as exc:
        return Failed(request_id, 400, str(exc), "exceed_context_size_error")
    except BadPrompt as exc:
        return Failed(request_id, 400, str(exc), "invalid_request_error")
    n = len(tokens)
    if n == 0:
        return Failed(request_id, 400, "empty prompt", "invalid_request_error")
    if n >= n_ctx:
        return Failed(request_id, 400, too_long(n, n_ctx), "exceed_context_size_error")
    # An n_predict beyond the context left is not an error (llama-server generates until the
    # context is full, then stops with stop_type "limit", truncated): Continue sends 4096.
    cap = n_predict_max if n_predict < 0 else min(n_predict_max, n_predict)
    return tokens, min(cap, n_ctx - n)
