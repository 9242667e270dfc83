"""Driving the torch engine in-process in tests: settings, a loaded engine, and ``Run``,
which feeds requests and steps and records what each step produced."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmproxy.backend.protocol import Done, Failed, Prompt, SamplingParams, Submit, Token

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf"))
GREEDY = SamplingParams(n_predict=10, temperature=0)
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "Once upon a time",
]


def settings(cache_dir: Path, **kw: Any) -> Any:
    """Small torch engine settings (n_ctx 512, 4 slots, 64-token prefill chunks), ``kw`` wins."""
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
    """A loaded torch engine (``settings(cache_dir, **kw)``); the caller closes it."""
    from llmproxy.backend.engines.torch.engine import create_engine

    eng = create_engine(settings(cache_dir, **kw))
    eng.load(lambda _p: None)
    return eng


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
    """The text of ``text`` run by itself to its end on engine ``e``."""
    r = Run()
    r.admit(e, "solo", text, params)
    r.finish(e)
    return r.text.get("solo", "")
