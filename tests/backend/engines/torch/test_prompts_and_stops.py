"""What the torch engine takes and how its answers end (in-process, real model): stop
words, prompts too long or with ids outside the vocabulary, n_predict past the context,
chat and infill prompts, and text never split inside a character."""

from __future__ import annotations

from typing import Any

import pytest

from llmproxy.backend.protocol import SamplingParams, Submit
from tests.helpers.backend.engine import GREEDY, HAVE_TORCH, PROMPTS, Run, alone

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]


def test_stop_word_cuts_and_reports(eng: Any) -> None:
    full = alone(eng, PROMPTS[0], SamplingParams(n_predict=24, temperature=0))
    word = "return"
    assert word in full
    r = Run()
    r.admit(
        eng, "s", PROMPTS[0], SamplingParams(n_predict=24, temperature=0, stop=(word, "never-seen"))
    )
    r.finish(eng)
    assert r.text.get("s", "") == full[: full.index(word)]
    assert r.done["s"].stop_reason == "word" and r.done["s"].stopping_word == word


def test_prompt_too_long_is_400(eng: Any) -> None:
    r = Run()
    r.admit(eng, "big", "hello " * 600)
    assert r.failed["big"].status == 400
    assert eng.active() == 0


def test_n_predict_beyond_the_context_runs_until_the_context_is_full(eng: Any) -> None:
    """As llama-server: not a 400 (Continue sends n_predict 4096); it stops at the context."""
    r = Run()
    r.admit(eng, "sum", PROMPTS[0], SamplingParams(n_predict=4096, temperature=0, ignore_eos=True))
    r.finish(eng)
    done = r.done["sum"]
    assert "sum" not in r.failed and done.stop_reason == "limit"
    assert done.n_prompt_tokens + done.n_predicted == eng.n_ctx


def test_token_ids_outside_the_vocabulary_are_400(eng: Any) -> None:
    from llmproxy.backend.protocol import Prompt as P

    r = Run()
    for rid, ids in [("high", (1, len(eng.tokenizer))), ("negative", (-1,))]:
        r.feed(eng.admit(Submit(rid, 0, P(kind="completion", tokens=ids), GREEDY)))
        assert r.failed[rid].status == 400 and "out of range" in r.failed[rid].message
    assert eng.active() == 0


def test_chat_and_infill_prompts(eng: Any) -> None:
    from llmproxy.backend.protocol import Prompt as P

    r = Run()
    r.feed(eng.admit(Submit("c", 0, P(kind="chat", messages=(("user", "Say hi"),)), GREEDY)))
    r.finish(eng)
    assert r.text["c"].strip() and r.done["c"].n_prompt_tokens > 10
    # SmolLM2 has no FIM tokens: infill falls back to continuing extra + prefix + prompt
    assert eng.prompts.fim is None
    infill = P(
        kind="infill", prefix="def add(a, b):\n", text="    return", suffix="\n\nprint(add(1, 2))\n"
    )
    r.feed(eng.admit(Submit("i", 0, infill, GREEDY)))
    r.finish(eng)
    assert r.text["i"] == alone(eng, "def add(a, b):\n    return")


def test_detokenizer_never_splits_characters(eng: Any) -> None:
    from llmproxy.backend.engines.torch.text import Detokenizer

    text = "naïve café — 世界 🎉 ok"
    ids = eng.tokenizer(text, add_special_tokens=False).input_ids
    d = Detokenizer(eng.tokenizer)
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
