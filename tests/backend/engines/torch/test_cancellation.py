"""Cancelling in the torch engine (in-process, real model): a running row leaves the batch
at once and the others go on unchanged; a waiting or unknown request."""

from __future__ import annotations

from typing import Any

import pytest

from llmproxy.backend.protocol import Done, SamplingParams
from tests.helpers.backend.engine import HAVE_TORCH, PROMPTS, Run, alone

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]


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


def test_cancel_waiting_and_unknown(eng: Any) -> None:
    r = Run()
    r.admit(eng, "w", PROMPTS[0])
    (ev,) = eng.cancel("w")
    assert isinstance(ev, Done) and ev.stop_reason == "cancelled" and ev.n_predicted == 0
    assert eng.active() == 0
    assert eng.cancel("nope") == []
