"""The torch engine driven directly in-process (a plain synchronous class), real model.

Covers batch correctness (greedy batched == alone), joining a running batch, stall-free
chunked prefill, cancellation mid-batch, per-request sampling, stop words, context
checks, static vs continuous batching, sleep/reload and the converted-weights cache.
One continuous engine per module (converting the GGUF once into a temporary cache) and
one static engine loaded from that cache.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams, Submit, Token

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf"))
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]

GREEDY = SamplingParams(n_predict=10, temperature=0)
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "Once upon a time",
]


def settings(cache_dir: Path, **kw: Any) -> Any:
    from llmproxy.backend.settings import BackendSettings

    base: dict[str, Any] = dict(
        engine="torch",
        cache_dir=cache_dir,
        n_ctx=512,
        max_batch_size=4,
        prefill_chunk=64,
        n_threads=1,
    )
    return BackendSettings(**{**base, **kw})


def make_engine(cache_dir: Path, **kw: Any) -> Any:
    from llmproxy.backend.engines.torch.engine import create_engine

    eng = create_engine(settings(cache_dir, **kw))
    eng.load(lambda _p: None)
    return eng


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch-cache")


@pytest.fixture(scope="module")
def eng(cache_dir: Path) -> Any:
    e = make_engine(cache_dir)
    yield e
    e.close()


@dataclass
class Run:
    """What a drive produced, with the step index of each request's first token / Done."""

    text: dict[str, str] = field(default_factory=dict)
    done: dict[str, Done] = field(default_factory=dict)
    failed: dict[str, Failed] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    done_step: dict[str, int] = field(default_factory=dict)
    tokens_per_step: dict[int, dict[str, int]] = field(default_factory=dict)  # step -> Token events
    steps: int = 0

    def feed(self, events: list[Any]) -> None:
        counts: dict[str, int] = {}
        for ev in events:
            if isinstance(ev, Token):
                self.text[ev.request_id] = self.text.get(ev.request_id, "") + ev.text
                self.first_step.setdefault(ev.request_id, self.steps)
                counts[ev.request_id] = counts.get(ev.request_id, 0) + 1
            elif isinstance(ev, Done):
                self.done[ev.request_id] = ev
                self.done_step[ev.request_id] = self.steps
            elif isinstance(ev, Failed):
                self.failed[ev.request_id] = ev
        self.tokens_per_step[self.steps] = counts

    def step(self, e: Any) -> None:
        self.steps += 1
        self.feed(e.step())

    def admit(self, e: Any, rid: str, text: str, params: SamplingParams = GREEDY) -> None:
        self.feed(e.admit(Submit(rid, 0, Prompt(kind="completion", text=text), params)))

    def finish(self, e: Any, max_steps: int = 2000) -> Run:
        while e.active() and self.steps < max_steps:
            self.step(e)
        assert e.active() == 0
        return self


def alone(e: Any, text: str, params: SamplingParams = GREEDY) -> str:
    r = Run()
    r.admit(e, "solo", text, params)
    r.finish(e)
    return r.text.get("solo", "")


def test_batch_equals_alone(eng: Any) -> None:
    solo = [alone(eng, p) for p in PROMPTS]
    r = Run()
    for i, p in enumerate(PROMPTS):
        r.admit(eng, f"r{i}", p)
    r.finish(eng)
    assert [r.text[f"r{i}"] for i in range(len(PROMPTS))] == solo
    assert all(r.done[f"r{i}"].n_predicted == 10 for i in range(len(PROMPTS)))
    assert all(s.strip() for s in solo)


def test_join_mid_batch_next_step(eng: Any) -> None:
    long = SamplingParams(n_predict=30, temperature=0, ignore_eos=True)
    solo_b = alone(eng, PROMPTS[1])
    r = Run()
    r.admit(eng, "a", PROMPTS[0], long)
    for _ in range(5):
        r.step(eng)
    r.admit(eng, "b", PROMPTS[1])
    r.step(eng)
    assert r.first_step["b"] == r.steps, (
        "a new request must produce its first token at the next step"
    )
    assert r.tokens_per_step[r.steps].get("a") == 1, (
        "the running request kept decoding in that step"
    )
    r.finish(eng)
    assert r.text["b"] == solo_b
    assert r.done_step["b"] < r.done_step["a"]


def test_long_prompt_prefill_is_chunked_and_stall_free(eng: Any) -> None:
    long_prompt = "def f(x):\n    return x + 1\n" * 40  # ~400 tokens: several 64-token chunks
    n_prompt = len(eng.prompts.tokens(Prompt(kind="completion", text=long_prompt), 4))
    assert n_prompt > 3 * eng.chunk
    r = Run()
    r.admit(eng, "a", PROMPTS[0], SamplingParams(n_predict=24, temperature=0, ignore_eos=True))
    r.step(eng)
    r.admit(eng, "b", long_prompt, SamplingParams(n_predict=4, temperature=0))
    start = r.steps
    while "b" not in r.first_step:
        r.step(eng)
    chunks = r.first_step["b"] - start
    assert chunks == -(-n_prompt // eng.chunk)  # one chunk per step
    # "a" kept decoding one token per step while "b" was being prefilled
    assert all(
        r.tokens_per_step[i].get("a", 0) == 1 for i in range(start + 1, r.first_step["b"] + 1)
    )
    r.finish(eng)


def test_cancel_mid_batch(eng: Any) -> None:
    long = SamplingParams(n_predict=40, temperature=0, ignore_eos=True)
    solo_b = alone(eng, PROMPTS[2], SamplingParams(n_predict=12, temperature=0))
    r = Run()
    r.admit(eng, "a", PROMPTS[0], long)
    r.admit(eng, "b", PROMPTS[2], SamplingParams(n_predict=12, temperature=0))
    for _ in range(4):
        r.step(eng)
    events = eng.cancel("a")
    assert len(events) == 1 and isinstance(events[0], Done) and events[0].stop_reason == "cancelled"
    assert eng.cancel("a") == []
    n_a = len(r.text.get("a", ""))
    r.finish(eng)
    assert len(r.text.get("a", "")) == n_a, "no token after cancel"
    assert r.text["b"] == solo_b


def test_slot_shuffles_keep_every_sequence_exact(eng: Any) -> None:
    """Rows leaving mid-batch, two chunked prefills where the first joins while the second
    (partly prefilled) holds the slot it moves to (a slot swap), KV growth past the
    initial columns and a cancelled prefill: every survivor's text == alone."""
    texts = {
        "l1": "def g(y):\n    return y * 2\n" * 24,  # ~290 tokens: 5 chunks of 64
        "l2": "Paris is in France, Rome is in Italy, Madrid is in Spain. " * 6 + "Berlin is in",
    }
    params = SamplingParams(n_predict=12, temperature=0, ignore_eos=True)
    solo = {k: alone(eng, t, params) for k, t in texts.items()}
    r = Run()
    r.admit(eng, "a", PROMPTS[0], SamplingParams(n_predict=24, temperature=0, ignore_eos=True))
    r.admit(eng, "b", PROMPTS[1], SamplingParams(n_predict=60, temperature=0, ignore_eos=True))
    r.step(eng)
    for rid, text in texts.items():
        r.admit(eng, rid, text, params)
    swapped_with_data = False
    while "l1" not in r.first_step:
        before = {s.rid: (s.slot, s.pos) for s in eng.prefilling}
        r.step(eng)
        row_of_l1 = next((i for i, s in enumerate(eng.batch.rows) if s.rid == "l1"), None)
        swapped_with_data = (
            row_of_l1 is not None and before["l2"][0] == row_of_l1 and eng.prefilling[0].pos > 0
        )
    assert swapped_with_data, "l1 joined into the slot of l2, which already held prompt tokens"
    while not {"l1", "l2", "a"} <= r.done.keys():
        r.step(eng)
    assert "b" not in r.done
    r.admit(eng, "z", texts["l1"], params)
    r.step(eng)
    assert [s.rid for s in eng.prefilling] == ["z"]
    events = eng.cancel("z")
    assert [type(ev) for ev in events] == [Done]
    r.finish(eng)
    assert {k: r.text[k] for k in solo} == solo
    assert r.done["a"].n_predicted == 24 and r.done["b"].n_predicted == 60
    assert all(o is None for o in eng.batch.owner), "every KV slot is free again"


def test_cancel_waiting_and_unknown(eng: Any) -> None:
    r = Run()
    r.admit(eng, "w", PROMPTS[0])
    (ev,) = eng.cancel("w")
    assert isinstance(ev, Done) and ev.stop_reason == "cancelled" and ev.n_predicted == 0
    assert eng.active() == 0
    assert eng.cancel("nope") == []


def test_sampling_seeded_reproducible_alone_and_batched(eng: Any) -> None:
    hot = SamplingParams(
        n_predict=12, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7, ignore_eos=True
    )
    first = alone(eng, PROMPTS[3], hot)
    assert alone(eng, PROMPTS[3], hot) == first
    r = Run()
    r.admit(
        eng,
        "x",
        PROMPTS[0],
        SamplingParams(n_predict=12, temperature=1.5, seed=99, ignore_eos=True),
    )
    r.admit(eng, "s", PROMPTS[3], hot)
    r.finish(eng)
    assert r.text["s"] == first
    seeds = {
        alone(eng, PROMPTS[3], SamplingParams(**{**_fields(hot), "seed": s})) for s in range(4)
    }
    assert len(seeds) > 1, "different seeds at temperature 1.5 should not all agree"


def test_seeded_text_does_not_depend_on_prompt_chunking(eng: Any) -> None:
    """A seeded request draws only once its prompt is complete: sharing the prefill budget
    with another prompt (one chunk more for it) must not change its text."""

    def n_tokens(text: str) -> int:
        return len(eng.prompts.tokens(Prompt(kind="completion", text=text), 4))

    c = eng.chunk
    other = "import os\nimport sys\n" * 40
    while n_tokens(other) >= c:
        other = other[: len(other) * 9 // 10]
    k = n_tokens(other)  # the other prompt fits one chunk and takes k tokens of the first step
    long_prompt = next(p for p in ("def f(x):\n    return x + 1\n" * r for r in range(4, 80))
                       if n_tokens(p) > c and n_tokens(p) % c + k > c)  # fmt: skip
    n = n_tokens(long_prompt)
    assert 1 + -(-(n - (c - k)) // c) == -(-n // c) + 1  # batched: one prompt chunk more than alone
    hot = SamplingParams(
        n_predict=8, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=11, ignore_eos=True
    )
    first = alone(eng, long_prompt, hot)
    r = Run()
    r.admit(eng, "x", other, SamplingParams(n_predict=4, temperature=0))
    r.admit(eng, "s", long_prompt, hot)
    r.finish(eng)
    assert r.text["s"] == first


def test_top_k_one_is_greedy(eng: Any) -> None:
    greedy = alone(eng, PROMPTS[0])
    k1 = SamplingParams(n_predict=10, temperature=2.0, top_k=1, seed=3)
    assert alone(eng, PROMPTS[0], k1) == greedy


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


def test_static_batching_groups_and_blocks_late_requests(eng: Any, cache_dir: Path) -> None:
    static = make_engine(cache_dir, batching="static", max_batch_wait_ms=20)
    try:
        assert static.last_load["converted"] is False, (
            "second load must reuse the converted weights"
        )
        assert dict(static.info.extra)["weights_from_cache"] == "true"
        long = SamplingParams(n_predict=12, temperature=0, ignore_eos=True)
        r = Run()
        r.admit(static, "a", PROMPTS[0], long)
        r.admit(static, "b", PROMPTS[1], long)
        while "a" not in r.first_step:
            r.step(static)
        assert r.first_step["a"] == r.first_step["b"], (
            "requests within the wait window run as one batch"
        )
        r.admit(static, "late", PROMPTS[2], SamplingParams(n_predict=4, temperature=0))
        r.finish(static)
        assert r.first_step["late"] > max(r.done_step["a"], r.done_step["b"]), (
            "static: late request waits"
        )
        assert r.text["late"] == alone(eng, PROMPTS[2], SamplingParams(n_predict=4, temperature=0))
    finally:
        static.close()
    # the same scenario with continuous batching: the late request starts at once
    r = Run()
    r.admit(eng, "a", PROMPTS[0], long)
    r.admit(eng, "b", PROMPTS[1], long)
    r.step(eng)
    r.admit(eng, "late", PROMPTS[2], SamplingParams(n_predict=4, temperature=0))
    r.step(eng)
    assert (
        r.first_step["late"]
        == r.steps
        < min(r.done_step.get("a", 10**9), r.done_step.get("b", 10**9))
    )
    r.finish(eng)


def test_sleep_then_admit_reloads(eng: Any) -> None:
    before = alone(eng, PROMPTS[1])
    loads = eng.load_count
    eng.sleep()
    assert eng.batch is None
    assert alone(eng, PROMPTS[1]) == before
    assert eng.load_count == loads + 1 and eng.last_load["converted"] is False


def test_sleep_frees_the_kv_store_with_the_worker_gc_frozen(eng: Any) -> None:
    """The worker freezes the loaded engine's objects out of the garbage collector
    (worker.py): the store must go by reference counting alone, with no cycle holding it."""
    import gc
    import weakref

    alone(eng, PROMPTS[0])
    store = weakref.ref(eng.batch.kv.store)
    gc.freeze()
    try:
        eng.sleep()
        assert store() is None
    finally:
        gc.unfreeze()
    alone(eng, PROMPTS[0])  # and it reloads


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {k: getattr(p, k) for k in SamplingParams.__slots__}


def test_min_p_above_one_keeps_the_likeliest_token() -> None:
    """min_p > 1 filters out every token but the likeliest, as llama.cpp (min_keep 1): no
    empty distribution (which raised in the worker and took every client's generation down)."""
    import torch

    from llmproxy.backend.engines.torch.sampling import Sampler

    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=1.5, seed=1))
    assert [sampler(torch.tensor([0.1, 3.0, 0.2])) for _ in range(5)] == [1] * 5
