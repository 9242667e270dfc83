"""What the backend has computed since it started: llama-server's ``/metrics`` counters.

``Counters.add`` takes every ``Done`` the dispatcher sees, a cancelled generation's
included: its prompt tokens count as far as they were evaluated, its tokens as far as
they were decoded. A request that failed (``Failed``, a dead worker) adds nothing, as in
llama-server. Event loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmproxy.backend.protocol import Done


@dataclass
class Counters:
    prompt_tokens: int = 0  # evaluated, not counting those reused from a slot's cache
    prompt_tokens_cached: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    generations: int = 0  # every Done: finished, stopped or cancelled

    def add(self, done: Done) -> None:
        self.generations += 1
        self.prompt_tokens += done.n_evaluated
        self.prompt_tokens_cached += done.n_cached
        if done.n_evaluated:
            self.prompt_seconds += done.prompt_ms / 1000.0
        self.tokens_predicted += done.n_predicted
        if done.n_predicted:
            self.tokens_predicted_seconds += done.predicted_ms / 1000.0
