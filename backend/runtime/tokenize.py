"""Prompts to token ids off the slots: the web process's tokenizer threads.

Every prompt given as text (a completion's, a chat's after its template, an infill's
parts) is tokenized here before its request takes a slot; the worker receives the token
ids (``Prompt(kind="completion", tokens=...)``) and only checks them. A slot is never held
by a tokenizer: while a request is tokenized its slot serves others, and a cancel reaches
a generation between two tokens as before.

Concurrency contract (the public methods on the event loop's thread; ``_job`` on a
tokenizer thread, the job count under a lock from either):

* ``tokenizer_threads`` threads (a ``ThreadPoolExecutor`` this object owns) run the
  engine's prompt rules (``engines.create_prompts``), built once on one of them when the
  first worker is ready (``on_ready``; the torch engine's tokenizer comes from the
  weights its worker loaded). llama.cpp's tokenizer is a ctypes call, which releases the
  GIL, so a long tokenization does not stall the loop or the other threads; a Hugging
  Face fast tokenizer matches special tokens with an automaton (linear in the text).
* At most ``tokenizer_threads + max_queue`` requests tokenize or wait for a thread (jobs
  whose client left count until their thread is done with them); more get ``QueueFull``
  (429 + ``Retry-After``).
* ``tokenize`` awaits its job. A caller that is cancelled (its client left) stops waiting,
  and its job is dropped if no thread had started it; one already inside the tokenizer's
  C call runs to its end (nothing can interrupt that call; ``TokenBounds`` bounds its
  cost: fewer than ``n_ctx`` special-token strings and ``n_ctx`` tokens' worth of bytes)
  on its thread, and its result is dropped.
* A job that has not answered within ``tokenize_timeout_s`` is answered for:
  ``PromptRefused`` with a 400 when it was being tokenized (the prompt itself costs that
  much), a 503 when it was still waiting for a thread; the thread finishes as above.
* ``close`` (the dispatcher's stop) shuts the pool down without waiting for a running
  job; its thread ends with the C call it is in (the interpreter's exit waits for it,
  within ``TokenBounds``'s bound).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog

from llmproxy.backend.engines.prompts import admit_tokens
from llmproxy.backend.protocol import EngineInfo, Failed, Prompt
from llmproxy.backend.runtime.slots import QueueFull, Unavailable

if TYPE_CHECKING:
    from llmproxy.backend.engines.base import PromptTokens
    from llmproxy.backend.settings import BackendSettings

log = structlog.get_logger("llmproxy.backend.runtime.tokenize")


class PromptRefused(Exception):
    """The prompt cannot be run (too long, bad token ids, a tokenizer past its budget):
    ``failed`` is the answer (a 4xx/5xx envelope), no slot was taken."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.message)
        self.failed = failed


class Tokenizer:
    """The tokenizer pool; see the module docstring."""

    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        self._pool = ThreadPoolExecutor(
            settings.tokenizer_threads, thread_name_prefix="backend-tokenize"
        )
        self._rules: asyncio.Future[PromptTokens] | None = None
        self._lock = threading.Lock()
        self._active = 0

    @property
    def active(self) -> int:
        """Requests tokenizing or waiting for a thread, and jobs still on a thread whose
        caller left (what the threads owe): the cap counts these, /metrics shows them."""
        return self._active

    def _add(self, n: int) -> None:
        with self._lock:  # a job's end is counted on its thread
            self._active += n

    def on_ready(self, info: EngineInfo) -> None:
        """A worker is ready: build the prompt rules (once; again if building failed)."""
        if self._rules is not None and not (
            self._rules.done() and self._rules.exception() is not None
        ):
            return
        from llmproxy.backend.engines import create_prompts

        fut = asyncio.wrap_future(self._pool.submit(create_prompts, self.settings, info))
        fut.add_done_callback(_log_build)
        self._rules = fut

    async def tokenize(self, request_id: str, prompt: Prompt, n_predict: int) -> Prompt:
        """``prompt`` as token ids (unchanged when it is ids already); raises
        ``PromptRefused`` for a prompt that cannot run, ``QueueFull`` / ``Unavailable``."""
        if prompt.kind == "completion" and prompt.tokens is not None:
            return prompt
        limit = self.settings.tokenizer_threads + self.settings.max_queue
        if self.active >= limit:
            raise QueueFull(f"server busy: {self.active} requests already wait to be tokenized")
        rules = self._rules
        if rules is None:
            raise Unavailable("Loading model")
        started = threading.Event()
        budget_s = self.settings.tokenize_timeout_s
        self._add(1)
        on_thread = False  # from then on the job's end is counted (``_add(-1)``) by itself
        try:
            try:
                loaded = await asyncio.shield(rules)  # loading: not counted in the budget
            except Exception as exc:  # logged by _log_build; the next ready worker retries
                raise Unavailable(f"the tokenizer failed to load: {exc}") from None
            async with asyncio.timeout(budget_s):
                job = self._pool.submit(self._job, loaded, request_id, prompt, n_predict, started)
                job.add_done_callback(lambda _job: self._add(-1))  # ran, failed or dropped
                on_thread = True
                admitted = await asyncio.wrap_future(job)
        except TimeoutError:
            if started.is_set():
                failed = Failed(
                    request_id,
                    400,
                    f"the prompt took more than {budget_s:g} s to tokenize",
                    "invalid_request_error",
                )
            else:
                failed = Failed(
                    request_id,
                    503,
                    f"no tokenizer was free within {budget_s:g} s",
                    "unavailable_error",
                )
            raise PromptRefused(failed) from None
        finally:
            if not on_thread:
                self._add(-1)
        if isinstance(admitted, Failed):
            raise PromptRefused(admitted)
        return Prompt(kind="completion", tokens=tuple(admitted))

    def _job(
        self,
        rules: PromptTokens,
        request_id: str,
        prompt: Prompt,
        n_predict: int,
        started: threading.Event,
    ) -> list[int] | Failed:
        """On a tokenizer thread: the prompt's ids, or the ``Failed`` refusing it."""
        started.set()
        s = self.settings
        try:
            admitted = admit_tokens(
                request_id,
                lambda: rules.tokens(prompt, n_predict),
                n_predict,
                int(s.n_ctx),
                int(s.n_predict_max),
            )
        except Exception as exc:  # a tokenizer bug: this request fails, nothing else
            log.error("tokenize_failed", error=repr(exc))
            return Failed(request_id, 500, f"tokenizer error: {exc}")
        return admitted if isinstance(admitted, Failed) else admitted[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _log_build(fut: asyncio.Future[PromptTokens]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("tokenizer_load_failed", error=repr(fut.exception()))
