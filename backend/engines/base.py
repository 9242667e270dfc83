"""The engine interface the worker loop drives.

Concurrency contract: an engine is used from exactly one thread of one worker process.
The worker loop (backend/runtime/worker.py) owns it: it calls ``load`` once, then repeatedly
``admit``s new Submits, ``cancel``s, and calls ``step`` while ``active() > 0``. Between
two ``step`` calls the loop drains its inbound queue, so a Cancel takes effect between
tokens and a new request joins a batching engine at the next decode step. ``step`` must
be bounded in time (one decode step, or one prompt chunk), never a whole generation.
The worker loop calls ``close`` when it exits, whatever the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from llmproxy.backend.protocol import EngineInfo, Event, Prompt, Submit


class PromptTokens(Protocol):
    """An engine's prompt rules over its tokenizer: a ``Prompt`` (completion text, chat
    messages, infill parts) to the token ids its engine would make of it. Raises
    ``prompts.BadPrompt`` (``PromptTooLong``) for a prompt the model cannot take. May be
    called from several threads at once; blocks for as long as the tokenizer runs."""

    def tokens(self, prompt: Prompt, n_predict: int) -> list[int]: ...


class Engine(ABC):
    """One model instance with ``capacity()`` slots; see the module docstring."""

    @abstractmethod
    def load(self, progress: Callable[[float], None]) -> EngineInfo:
        """Load the model (reporting 0..1 progress) and run a warm-up generation.

        Called once before any other method, and again to reload after ``sleep``."""

    @abstractmethod
    def capacity(self) -> int:
        """How many sequences this engine instance runs at once (its slots)."""

    @abstractmethod
    def admit(self, submit: Submit) -> list[Event]:
        """Accept a request. Bad input (prompt too long...) returns ``[Failed(...)]``."""

    @abstractmethod
    def cancel(self, request_id: str) -> list[Event]:
        """Drop a request; returns its ``Done(stop_reason="cancelled")`` (or nothing if unknown)."""

    @abstractmethod
    def step(self) -> list[Event]:
        """Advance every active sequence by one bounded unit of work."""

    @abstractmethod
    def active(self) -> int:
        """Number of admitted, unfinished requests."""

    @abstractmethod
    def active_ids(self) -> list[str]:
        """The request ids of the admitted, unfinished requests (``active()`` of them)."""

    def sleep(self) -> None:
        """Free the model while idle (``idle_unload_s``); the worker calls ``load`` to wake it.

        By default nothing is freed (the model stays loaded)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Free the model (and GPU memory)."""
