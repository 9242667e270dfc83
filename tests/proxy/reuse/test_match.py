"""Which request continues which: the text typed at the cursor, per route."""

from __future__ import annotations

from typing import Any

import pytest

from llmproxy.proxy.reuse.match import typed

INFILL = {"input_prefix": "def f(x):\n", "prompt": "    ret", "input_suffix": "\n\nf(1)\n",
          "input_extra": [], "n_predict": 64, "cache_prompt": True}  # fmt: skip


def infill(**changes: Any) -> dict[str, Any]:
    return {**INFILL, **changes}


def test_infill_compares_prefix_and_prompt_together() -> None:
    assert typed("/infill", INFILL, infill(prompt="    return")) == ("urn",)
    # llama.vim moves whole lines from prompt into input_prefix: only the concatenation counts
    moved = infill(input_prefix="def f(x):\n    return x\n", prompt="")
    assert typed("/infill", INFILL, moved) == ("urn x\n",)


def test_infill_context_may_change_but_the_suffix_may_not() -> None:
    context = infill(prompt="    retu", input_extra=[{"text": "y"}])
    assert typed("/infill", INFILL, context) == ("u",)
    assert typed("/infill", INFILL, infill(prompt="    retu", input_suffix="\n")) == ()


@pytest.mark.parametrize(
    "change",
    [
        {"prompt": "    re"},  # backspace
        {"prompt": "    ret"},  # nothing typed
        {"prompt": "    rex"},  # a different character at the cursor
        {"input_prefix": "def g(x):\n", "prompt": "    retu"},  # an edit before the cursor
        {"prompt": "    retu", "n_predict": 32},
        {"prompt": "    retu", "temperature": 0.5},
        {"prompt": "    retu", "stream": True},
        {"prompt": "    retu", "n_probs": 3},
        {"prompt": "    retu", "n_predict": 0},  # a warm-up
    ],
)
def test_infill_is_not_continued(change: dict[str, Any]) -> None:
    assert typed("/infill", INFILL, infill(**change)) == ()


def test_completion_insertion_at_the_cursor_of_a_client_built_fim_prompt() -> None:
    old = {"prompt": "<fim_prefix>x = <fim_suffix>\n<fim_middle>", "n_predict": 16}
    new = {"prompt": "<fim_prefix>x = 4<fim_suffix>\n<fim_middle>", "n_predict": 16}
    assert typed("/completion", old, new) == ("4",)
    assert typed("/completions", old, new) == ("4",)
    two_places = {"prompt": "<fim_prefix>y = 4<fim_suffix>\n<fim_middle>!", "n_predict": 16}
    assert typed("/completion", old, two_places) == ()


def test_completion_plain_continuation() -> None:
    assert typed("/completion", {"prompt": "Once upon"}, {"prompt": "Once upon a"}) == (" a",)
    assert typed("/completion", {"prompt": ["tok"]}, {"prompt": ["tok", 1]}) == ()


def test_openai_completions_prompt_grows_and_suffix_stays() -> None:
    old = {"prompt": "def f(", "suffix": "):", "max_tokens": 8}
    assert typed("/v1/completions", old, {**old, "prompt": "def f(x"}) == ("x",)
    fim = {"prompt": "<fim_prefix>x = <fim_suffix>\n<fim_middle>", "max_tokens": 8}  # llm-ls
    grown = {**fim, "prompt": "<fim_prefix>x = 42<fim_suffix>\n<fim_middle>"}
    assert typed("/v1/completions", fim, grown) == ("42",)
    assert typed("/v1/completions", old, {**old, "prompt": "def f(x", "suffix": ""}) == ()
    assert typed("/v1/completions", old, {**old, "prompt": "def f(x", "n": 2}) == ()
    assert typed("/v1/completions", old, {**old, "prompt": "def f(x", "logprobs": 1}) == ()


def test_chat_routes_are_never_continued() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    grown = {"messages": [{"role": "user", "content": "hi there"}]}
    assert typed("/v1/chat/completions", body, grown) == ()


def test_an_insertion_where_the_typed_text_meets_the_text_after_it_reads_every_way() -> None:
    """The cursor is not marked in a client-built prompt: ``<a`` typed before ``<fim_suffix>``
    is also ``a<`` typed after its ``<``. Both are candidates (the generation's text decides)."""
    old = {"prompt": "<fim_prefix>List<fim_suffix>\n<fim_middle>"}
    new = {"prompt": "<fim_prefix>List<a<fim_suffix>\n<fim_middle>"}
    assert typed("/completion", old, new) == ("<a", "a<")
    # plain continuation of a repeating text: every rotation, each once
    assert typed("/completion", {"prompt": "xa"}, {"prompt": "xaba"}) == ("ab", "ba")
    assert typed("/completion", {"prompt": "    "}, {"prompt": "        "}) == ("    ",)
    assert typed("/completion", {"prompt": "abc"}, {"prompt": "abXc"}) == ("X",)
