"""The engine interface the worker loop drives.

Concurrency contract: an engine is used from exactly one thread of one worker process.
The worker loop (backend/runtime/worker.py) owns it: it calls ``load`` once, then repeatedly
``admit``s new Submits, ``cancel``s, and calls ``step`` while ``active() > 0``. Between
two ``step`` calls the loop drains its inbound queue, so a Cancel takes effect between
tokens and a new request joins a batching engine at the next decode step. ``step`` must
be bounded in time (one decode step, or one prompt chunk), never a whole generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llmproxy.backend.protocol import EngineInfo, Event, Submit


class Engine(Protocol):
    def load(self, progress: Callable[[float], None]) -> EngineInfo:
        """Load the model (reporting 0..1 progress) and run a warm-up generation."""
        ...

    def capacity(self) -> int:
        """How many sequences this engine instance runs at once (its slots)."""
        ...

    def admit(self, submit: Submit) -> list[Event]:
        """Accept a request. Bad input (prompt too long...) returns ``[Failed(...)]``."""
        ...

    def cancel(self, request_id: str) -> list[Event]:
        """Drop a request; returns its ``Done(stop_reason="cancelled")`` (or nothing if unknown)."""
        ...

    def step(self) -> list[Event]:
        """Advance every active sequence by one bounded unit of work."""
        ...

    def active(self) -> int:
        """Number of admitted, unfinished requests."""
        ...

    def sleep(self) -> None:
        """Optional: free the model while idle (torch ``idle_unload_s``); ``admit`` reloads."""
        ...

    def close(self) -> None:
        """Free the model (and GPU memory)."""
        ...
