"""The llama-cpp-python engine: one sequence (slot) per instance, token-by-token steps.

Each ``step`` does one bounded unit: evaluate one prompt chunk of ``n_batch`` tokens, or
decode and sample one token (through ``Llama.generate``, advanced one ``next()`` per
step). The worker loop checks its inbound queue between steps, so a Cancel stops the
generation between two tokens (or two prompt chunks). Requests admitted while one runs
wait in ``pending`` (FIFO).

Prompt caching: the KV cache of the previous request stays in the context; a new prompt
re-uses its longest common prefix (llama-server's ``cache_prompt``), which is what makes
editor autocomplete cheap. A warm-up (``n_predict: 0``) only evaluates its prompt into
that cache and answers with no tokens.

Prompts are built by ``text.LlamaPrompts``; how a generation ends is ``Seq``'s
(``engines/sequence.py``, shared with the torch engine).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from llmproxy.backend.engines.base import Engine
from llmproxy.backend.engines.llamacpp.text import LlamaPrompts, Utf8Stream
from llmproxy.backend.engines.prompts import admit_tokens
from llmproxy.backend.engines.sequence import Seq
from llmproxy.backend.model_path import resolve_model
from llmproxy.backend.protocol import (
    EngineInfo,
    Event,
    Failed,
    Prompt,
    StopReason,
    Submit,
    Token,
)

if TYPE_CHECKING:
    from llama_cpp import Llama

    from llmproxy.backend.settings import BackendSettings


@dataclass(eq=False)
class LlamaSeq(Seq):
    """A request of the llama-cpp engine; ``gen`` is its ``Llama.generate`` once sampling."""

    gen: Generator[int, None, None] | None = None

    def finish(
        self, reason: StopReason, emit_held: bool = True, stopping_word: str = ""
    ) -> list[Event]:
        if self.gen is not None:
            self.gen.close()
        return super().finish(reason, emit_held, stopping_word)


class LlamaCppEngine(Engine):
    def __init__(self, settings: BackendSettings, worker_index: int = 0) -> None:
        self.settings = settings
        self.worker_index = worker_index
        self.llm: Llama | None = None
        self.model_path = resolve_model(settings.model)
        self.alias = settings.model_alias or self.model_path.stem
        self.n_ctx = int(settings.n_ctx)
        self.n_batch = int(settings.n_batch)
        self.current: LlamaSeq | None = None
        self.pending: deque[LlamaSeq] = deque()
        self.prompts: LlamaPrompts | None = None  # set by load

    # --- Engine interface -------------------------------------------------------------

    def load(self, progress: Callable[[float], None]) -> EngineInfo:
        import llama_cpp

        progress(0.05)
        self.llm = llama_cpp.Llama(
            model_path=str(self.model_path),
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_threads=self.settings.threads_per_worker(),
            n_threads_batch=self.settings.threads_per_worker(),
            verbose=False,
        )
        progress(0.8)
        self.prompts = prompts = LlamaPrompts(
            self.llm, self.n_ctx, int(self.settings.n_predict_max)
        )
        if self.settings.warmup:
            self._warmup()
        progress(1.0)
        return EngineInfo(
            model_path=str(self.model_path),
            model_alias=self.alias,
            n_ctx=self.n_ctx,
            has_fim=prompts.fim is not None,
            n_slots=1,
            extra=(
                ("engine", "llama-cpp"),
                ("n_threads", str(self.settings.threads_per_worker())),
                ("n_batch", str(self.n_batch)),
                ("chat_template", prompts.chat_template),
                ("infill", "fim" if prompts.fim else "prefix-only fallback"),
            ),
        )

    def capacity(self) -> int:
        return 1

    def active(self) -> int:
        return (1 if self.current is not None else 0) + len(self.pending)

    def active_ids(self) -> list[str]:
        ids = [s.rid for s in self.pending]
        if self.current is not None:
            ids.insert(0, self.current.rid)
        return ids

    def admit(self, submit: Submit) -> list[Event]:
        prompts = self.prompts
        assert prompts is not None
        n_predict = submit.params.n_predict
        admitted = admit_tokens(
            submit.request_id,
            lambda: prompts.tokens(submit.prompt, n_predict),
            n_predict,
            self.n_ctx,
            int(self.settings.n_predict_max),
        )
        if isinstance(admitted, Failed):
            return [admitted]
        tokens, cap = admitted
        seq = LlamaSeq(submit, tokens, cap, Utf8Stream(self._llama().detokenize))
        self.pending.append(seq)
        return []

    def cancel(self, request_id: str) -> list[Event]:
        cur = self.current
        if cur is not None and cur.rid == request_id:
            self.current = None
            return cur.finish("cancelled", emit_held=False)
        for seq in list(self.pending):
            if seq.rid == request_id:
                self.pending.remove(seq)
                return [seq.done("cancelled")]
        return []

    def step(self) -> list[Event]:
        if self.current is None:
            if not self.pending:
                return []
            self.current = self.pending.popleft()
            self._start(self.current)
        seq = self.current
        try:
            return self._fill(seq) if seq.n_predict <= 0 else self._step(seq)
        except Exception as exc:
            self.current = None
            self._llama().reset()
            return [Failed(seq.rid, 500, f"generation failed: {exc}")]

    def sleep(self) -> None:  # the GGUF stays mapped; nothing worth freeing
        return None

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.close()
            except Exception:
                pass
            self.llm = None

    def _warmup(self) -> None:
        """A short generation so the first real request does not pay first-call costs."""
        from llmproxy.backend.protocol import SamplingParams

        sub = Submit(
            "warmup",
            0,
            Prompt(kind="completion", text="Hello"),
            SamplingParams(n_predict=2, seed=0),
        )
        events = self.admit(sub)
        while self.active() and not events:
            events = [e for e in self.step() if not isinstance(e, Token)]
        self._llama().reset()

    # --- internals ---------------------------------------------------------------------

    def _llama(self) -> Llama:
        assert self.llm is not None, "the model is not loaded"
        return self.llm

    def _start(self, seq: LlamaSeq) -> None:
        llm = self._llama()
        seq.t_start = time.perf_counter()
        # Prompt-cache reuse; generate() finds this same prefix again and evaluates the rest.
        # _input_ids is an ndarray, which Llama's own generate() passes here too
        cached = cast("Sequence[int]", llm._input_ids)
        lcp = llm.longest_token_prefix(cached, seq.tokens[:-1])
        if lcp > 0 and not llm._ctx.kv_cache_seq_rm(-1, lcp, -1):
            lcp = 0
        if lcp == 0:
            llm.reset()
        else:
            llm.n_tokens = lcp
        seq.pos = seq.n_cached = lcp

    def _fill(self, seq: LlamaSeq) -> list[Event]:
        """A warm-up (``n_predict: 0``): evaluate the prompt into the cache, one chunk a step.

        Editors send these to fill the prompt cache (llama.vim's context chunks), so the
        next real request finds its prefix already evaluated; nothing is sampled."""
        end = min(len(seq.tokens), seq.pos + self.n_batch)
        if seq.pos < end:
            self._llama().eval(seq.tokens[seq.pos : end])
            seq.pos = end
        if seq.pos < len(seq.tokens):
            return []
        self.current = None
        return seq.finish("limit")

    def _step(self, seq: LlamaSeq) -> list[Event]:
        llm = self._llama()
        if seq.gen is None:
            remaining = len(seq.tokens) - seq.pos
            if remaining > self.n_batch:  # one prompt chunk per step
                llm.eval(seq.tokens[seq.pos : seq.pos + self.n_batch])
                seq.pos += self.n_batch
                return []
            p = seq.submit.params
            llm.set_seed(p.seed if p.seed is not None and p.seed >= 0 else random.getrandbits(31))
            seq.gen = llm.generate(
                seq.tokens,
                top_k=p.top_k if p.top_k > 0 else 0,
                top_p=p.top_p,
                min_p=p.min_p,
                temp=max(0.0, p.temperature),
                repeat_penalty=1.0,
                reset=True,
            )
        try:
            tok = next(seq.gen)
        except StopIteration:
            self.current = None
            return seq.finish("eos")
        assert self.prompts is not None
        out, finished = seq.accept(tok, self.prompts.eog(tok), llm.n_tokens, self.n_ctx)
        if finished:
            self.current = None
        return out
