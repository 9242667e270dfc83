"""The torch engine's sampling (in-process, real model): a seeded request reproduces alone
or batched, whatever its prompt's chunking; top_k 1 is greedy; min_p above 1 keeps one
token."""

from __future__ import annotations

from typing import Any

import pytest

from llmproxy.backend.protocol import Prompt, SamplingParams
from tests.helpers.backend.engine import HAVE_TORCH, PROMPTS, Run, alone

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]


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


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {k: getattr(p, k) for k in SamplingParams.__slots__}


def test_min_p_above_one_keeps_the_likeliest_token() -> None:
    """min_p > 1 filters out every token but the likeliest, as llama.cpp (min_keep 1): no
    empty distribution (which would raise in the worker, failing every request it runs)."""
    import torch

    from llmproxy.backend.engines.torch.sampling import Sampler

    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=1.5, seed=1))
    assert [sampler(torch.tensor([0.1, 3.0, 0.2])) for _ in range(5)] == [1] * 5
