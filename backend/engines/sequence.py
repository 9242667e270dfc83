"""Per-request state of a running generation, shared by the llama-cpp and torch engines.

A ``Seq`` holds one admitted request: its prompt tokens, the effective ``n_predict``
cap, the text decoded so far but held back (``stops.hold_scan``), token counts and the
``perf_counter`` stamps its final ``Done`` reports. ``accept`` applies the end-of-generation
rules to each sampled token in the order both engines share: end-of-generation token
(unless ``ignore_eos``), stop word or under-indented line (``stops.hold_scan``),
``n_predict`` or a full context (stop type "limit"), then ``t_max_predict_ms``
(``stops.time_up``). ``finish`` emits the held text and the ``Done``.

Engines subclass it with their own fields (the llama-cpp generator, the torch sampler
and KV slot). Owned by one engine and used only on that engine's thread.
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal, Protocol

from llmproxy.backend.engines.stop_matcher import StopMatcher
from llmproxy.backend.engines.stops import hold_scan, time_up
from llmproxy.backend.protocol import Done, Event, StopReason, Submit, Token


class TextStream(Protocol):
    """Token ids to text, one token at a time, never splitting a UTF-8 character."""

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        ...

    def flush(self) -> str:
        """Whatever is still held back (possibly an incomplete character) at the end."""
        ...


@dataclass(eq=False)
class Seq:
    submit: Submit
    tokens: list[int]  # the prompt
    n_predict: int  # effective cap (``prompts.admit_tokens``)
    text: TextStream
    _: KW_ONLY
    pos: int = 0  # prompt tokens already evaluated into the KV cache
    n_decoded: int = 0
    n_cached: int = 0  # prompt tokens reused from a previous request's KV cache
    held: str = ""  # decoded text not emitted yet (could start a stop word, or cut a line)
    has_new_line: bool = False
    t_admit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0  # prompt evaluation started
    t_first: float = 0.0  # first token sampled
    stops: StopMatcher = field(init=False)  # fed every decoded piece once

    def __post_init__(self) -> None:
        self.stops = StopMatcher(self.submit.params.stop)

    @property
    def rid(self) -> str:
        return self.submit.request_id

    def accept(self, token: int, eog: bool, n_past: int, n_ctx: int) -> tuple[list[Event], bool]:
        """Take one sampled ``token`` (``eog``: an end-of-generation token; ``n_past``: tokens
        in the context before it). Returns the events to send and whether the sequence is
        finished (its ``Done`` is then the last event)."""
        now = time.perf_counter()
        if self.n_decoded == 0 and not self.t_first:
            self.t_first = now
            self.pos = len(self.tokens)  # sampling means the whole prompt was evaluated
        p = self.submit.params
        if eog and not p.ignore_eos:
            return self.finish("eos"), True
        self.n_decoded += 1
        piece = self.text.push(token)
        out, stop, word = self._take(piece)
        if stop is not None:  # a stop word, or a line indented less than n_indent (cut there)
            return out + self.finish(stop, emit_held=False, stopping_word=word), True
        reason: StopReason | None = None
        if self.n_decoded >= self.n_predict or n_past + 1 >= n_ctx:
            reason = "limit"
        elif time_up(piece, self.t_first, now, p.t_max_predict_ms):
            reason = "time"  # only on a token with a newline: the answer ends on a line boundary
        if reason is None:
            return out, False
        return out + self.finish(reason), True

    def _take(self, piece: str) -> tuple[list[Event], Literal["word", "limit"] | None, str]:
        """Hold ``piece`` back as ``stops.hold_back`` says and emit what is decided. Returns
        (events, "word" / "limit" when a stop word / an under-indented line ends the
        generation else None, the stop word)."""
        p = self.submit.params
        hold = hold_scan(self.held, piece, self.stops, p.n_indent)
        self.held = hold.held
        out: list[Event] = []
        if hold.emit:
            self.has_new_line = self.has_new_line or "\n" in hold.emit
            out.append(Token(self.rid, hold.emit, self.n_decoded))
        if hold.word is not None:
            return out, "word", hold.word
        return out, ("limit" if hold.indent_stop else None), ""

    def finish(
        self, reason: StopReason, emit_held: bool = True, stopping_word: str = ""
    ) -> list[Event]:
        """The last events: the held text (``emit_held``; not after a stop word, a cut line
        or a cancel) and the ``Done``."""
        out: list[Event] = []
        if emit_held:
            tail = self.held + self.text.flush()
            if tail:
                out.append(Token(self.rid, tail, self.n_decoded))
        out.append(self.done(reason, stopping_word))
        return out

    def done(self, reason: StopReason, stopping_word: str = "") -> Done:
        """The ``Done`` of this sequence; stamps not set yet (0.0) count as now."""
        now = time.perf_counter()
        t_first = self.t_first or now
        t_start = self.t_start or now
        return Done(
            request_id=self.rid,
            stop_reason=reason,
            n_prompt_tokens=len(self.tokens),
            n_predicted=self.n_decoded,
            prompt_ms=(t_first - t_start) * 1000.0,
            predicted_ms=(now - t_first) * 1000.0,
            stopping_word=stopping_word,
            n_cached=self.n_cached,
            n_evaluated=max(0, self.pos - self.n_cached),
        )
