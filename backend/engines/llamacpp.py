"""The llama-cpp-python engine: one sequence (slot) per instance, token-by-token steps.

Each ``step`` does one bounded unit: evaluate one prompt chunk of ``n_batch`` tokens, or
decode and sample one token (through ``Llama.generate``, advanced one ``next()`` per
step). The worker loop checks its inbound queue between steps, so a Cancel stops the
generation between two tokens (or two prompt chunks).

Prompt caching: the KV cache of the previous request stays in the context; a new prompt
re-uses its longest common prefix (llama-server's ``cache_prompt``), which is what makes
editor autocomplete cheap. A warm-up (``n_predict: 0``) only evaluates its prompt into
that cache and answers with no tokens.

Prompts:
* completion: the text (special tokens parsed) or the given token ids.
* infill: with FIM tokens in the vocab (``llama_vocab_fim_pre/suf/mid``):
  ``[BOS] [extra: FIM_REP "myproject\\n" (FIM_SEP filename "\\n" text)*] FIM_PRE prefix+prompt
  FIM_SUF suffix FIM_MID`` (llama-server's layout), the prefix truncated on the left and
  the suffix on the right to fit the context. **Fallback** for vocabularies without FIM
  tokens: plain continuation of ``extra texts + prefix + prompt`` (the suffix is
  ignored), so the model still completes the current line.
* chat: the GGUF's ``tokenizer.chat_template`` (Jinja2), else ChatML.

Stop words are matched on the generated text; text that could be the start of a stop
word is held back until it is known not to be one, so a stop word never leaks into a
stream. The prompt, admission and stop-word rules live in ``prompts`` and ``stops``
(shared with the torch engine).
"""

from __future__ import annotations

import codecs
import random
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmproxy.backend.engines.base import Engine
from llmproxy.backend.engines.prompts import (
    CHATML,
    admit_tokens,
    chat_messages,
    given_tokens,
    infill_tokens,
)
from llmproxy.backend.engines.sequence import Sequence
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
    from llmproxy.backend.settings import BackendSettings


class Utf8Stream:
    """Token ids to text through ``Llama.detokenize`` (bytes), one token at a time; an
    incremental UTF-8 decoder keeps a split character back until it is complete."""

    def __init__(self, detokenize: Callable[[list[int]], bytes]) -> None:
        self._detokenize = detokenize
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._detokenize([token]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


@dataclass(eq=False)
class LlamaSeq(Sequence):
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
        self.llm: Any = None
        self.model_path = resolve_model(settings.model)
        self.alias = settings.model_alias or self.model_path.stem
        self.n_ctx = int(settings.n_ctx)
        self.n_batch = int(settings.n_batch)
        self.current: LlamaSeq | None = None
        self.pending: deque[LlamaSeq] = deque()
        self._fim: tuple[int, int, int] | None = None
        self._fim_rep = -1
        self._fim_sep = -1
        self._chat: Any = None
        self._eog: Callable[[int], bool] = lambda t: False

    # --- Engine protocol -------------------------------------------------------------

    def load(self, progress: Callable[[float], None]) -> EngineInfo:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

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
        llm = self.llm
        model = llm._model
        vocab = model.vocab
        self._eog = lambda t: bool(llama_cpp.llama_vocab_is_eog(vocab, t))
        pre, suf, mid = model.token_prefix(), model.token_suffix(), model.token_middle()
        if min(pre, suf, mid) >= 0:
            self._fim = (pre, suf, mid)
            self._fim_rep = llama_cpp.llama_vocab_fim_rep(vocab)
            self._fim_sep = llama_cpp.llama_vocab_fim_sep(vocab)
        meta = llm.metadata or {}
        template = meta.get("tokenizer.chat_template") or CHATML
        bos_id, eos_id = model.token_bos(), model.token_eos()
        bos = (
            llm.detokenize([bos_id], special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
        )
        eos = (
            llm.detokenize([eos_id], special=True).decode("utf-8", "replace") if eos_id >= 0 else ""
        )
        self._chat = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        self._bos_text = bos
        if self.settings.warmup:
            self._warmup()
        progress(1.0)
        return EngineInfo(
            model_path=str(self.model_path),
            model_alias=self.alias,
            n_ctx=self.n_ctx,
            has_fim=self._fim is not None,
            n_slots=1,
            extra=(
                ("engine", "llama-cpp"),
                ("n_threads", str(self.settings.threads_per_worker())),
                ("n_batch", str(self.n_batch)),
                ("chat_template", template),
                ("infill", "fim" if self._fim else "prefix-only fallback"),
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
        n_predict = submit.params.n_predict
        admitted = admit_tokens(
            submit.request_id,
            lambda: self._tokens(submit.prompt, n_predict),
            n_predict,
            self.n_ctx,
            int(self.settings.n_predict_max),
        )
        if isinstance(admitted, Failed):
            return [admitted]
        tokens, cap = admitted
        seq = LlamaSeq(submit, tokens, cap, Utf8Stream(self.llm.detokenize))
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
            self.llm.reset()
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
        self.llm.reset()

    # --- internals ---------------------------------------------------------------------

    def _start(self, seq: LlamaSeq) -> None:
        llm = self.llm
        seq.t_start = time.perf_counter()
        # Prompt-cache reuse; generate() finds this same prefix again and evaluates the rest.
        lcp = llm.longest_token_prefix(llm._input_ids, seq.tokens[:-1])
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
            self.llm.eval(seq.tokens[seq.pos : end])
            seq.pos = end
        if seq.pos < len(seq.tokens):
            return []
        self.current = None
        return seq.finish("limit")

    def _step(self, seq: LlamaSeq) -> list[Event]:
        llm = self.llm
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
        out, finished = seq.accept(tok, self._eog(tok), llm.n_tokens, self.n_ctx)
        if finished:
            self.current = None
        return out

    # --- prompts -----------------------------------------------------------------------

    def _tok(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        if not text:
            return []
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def _add_bos(self) -> list[int]:
        model = self.llm._model
        return [model.token_bos()] if model.add_bos_token() and model.token_bos() >= 0 else []

    def _tokens(self, prompt: Prompt, n_predict: int) -> list[int]:
        if prompt.kind == "completion":
            if prompt.tokens is not None:
                return given_tokens(prompt.tokens, self.llm.n_vocab())
            return self._add_bos() + self._tok(prompt.text)
        if prompt.kind == "chat":
            text = self._chat(messages=chat_messages(prompt)).prompt
            bos = [] if (self._bos_text and text.startswith(self._bos_text)) else self._add_bos()
            return bos + self._tok(text)
        return self._infill_tokens(prompt, n_predict)

    def _infill_tokens(self, prompt: Prompt, n_predict: int) -> list[int]:
        return infill_tokens(
            prompt,
            lambda text: self._tok(text, special=False),
            self._add_bos(),
            self._fim,
            self._fim_rep,
            self._fim_sep,
            self.n_ctx,
            n_predict,
            int(self.settings.n_predict_max),
        )
