"""The torch engine's batching, driven in-process with a real model: batched greedy text
equals text alone, a request joins a running batch at the next step, long prompts prefill
in chunks without stalling the batch, slot moves keep every sequence exact, and static
batching groups requests while continuous batching starts them at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmproxy.backend.protocol import Done, Prompt, SamplingParams
from tests.helpers.backend.engine import HAVE_TORCH, PROMPTS, Run, alone, make_engine

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]


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
