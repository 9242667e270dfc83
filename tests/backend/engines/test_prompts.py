"""Prompt rules shared by both engines (``engines/prompts.py``), over a stand-in tokenizer."""

from __future__ import annotations

import pytest

from llmproxy.backend.protocol import Prompt


@pytest.mark.parametrize("n_predict", [-1, 64, 1500, 4096])
def test_infill_prompt_keeps_most_of_the_context_whatever_n_predict(n_predict: int) -> None:
    """The room kept for generation is at most a quarter of the context: a large n_predict
    (Continue sends 4096; it runs until the context is full) must not squeeze the prompt."""
    from llmproxy.backend.engines.prompts import infill_tokens

    plain = lambda text: [ord(c) for c in text]  # noqa: E731  one token per character
    prompt = Prompt(kind="infill", prefix="p" * 5000, suffix="s" * 5000)
    tokens = infill_tokens(prompt, plain, [1], (2, 3, 4), -1, -1, 2048, n_predict, 4096)
    reserve = min(n_predict if n_predict > 0 else 4096, 2048 // 4)
    assert len(tokens) == 2048 - reserve - 1
    # BOS FIM_PRE ... FIM_SUF ... FIM_MID
    assert tokens[:2] == [1, 2] and 3 in tokens and tokens[-1] == 4


@pytest.mark.parametrize("fim", [(2, 3, 4), None])
def test_infill_text_is_cut_to_what_can_reach_the_context(fim: tuple[int, int, int] | None) -> None:
    """With ``max_chars`` (n_ctx x the longest token's size) the tokenizer never sees more
    than that many characters of a text, and the prompt is the same as without the cut."""
    from llmproxy.backend.engines.prompts import infill_tokens

    seen: list[int] = []

    def plain(text: str) -> list[int]:  # one token per character, each of up to 2
        seen.append(len(text))
        return [ord(c) for c in text]

    extra = (("a.py", "e" * 300_000), ("b.py", "f" * 10))
    prompt = Prompt(kind="infill", prefix="q" + "p" * 500_000, suffix="s" * 500_000, extra=extra)
    whole = infill_tokens(prompt, plain, [1], fim, 5, 6, 2048, 64, 512)
    assert max(seen) > 500_000
    seen.clear()
    cut = infill_tokens(prompt, plain, [1], fim, 5, 6, 2048, 64, 512, max_chars=2 * 2048)
    assert cut == whole and max(seen) <= 2 * 2048
