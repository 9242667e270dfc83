"""Resuming a preempted generation: what it produced so far, and the request for the rest.

The scheduler may stop a chat or bulk generation for a completion that waits (preemption:
pool/preempt.py). Its job then sends the *continuation*, and the client sees one answer:

- ``resumable(kind, path, parsed)``: only requests with an exact continuation: a text
  prompt on ``/completion``, ``/completions`` (llama-server) and ``/v1/completions``
  (llama-server or an OpenAI-compatible server), where the continuation is the prompt
  plus the text generated so far; and llama-server's chat routes, where it is the
  messages plus the assistant message so far, which llama-server continues as a prefill.
  One completion (``n``/``n_cmpl`` 1), no grammar, JSON schema or tools (their state
  would restart), no per-token probabilities, ``echo`` off, and a string prompt.
- ``Transcript`` reads the event stream as it is relayed (whole events, relay/sse.py) and
  keeps the text and the count of tokens so far; an event it cannot continue (a tool
  call, reasoning text, bytes that frame no event) makes it inexact, and such a stream is
  not preempted.
- ``continuation(path, parsed, transcript)``: the body for the rest, with the limit
  (``n_predict``, ``max_tokens``, ``max_completion_tokens``) reduced by the tokens
  already produced.
- ``Echo``: llama-server's chat continuation repeats its prefill in its first content:
  taken out of the events before anyone reads them.
- A resumable stream is relayed whole events only (relay/writer.py), so a cut stream never
  leaves half an event with the client; ``MAX_EVENT`` bounds what is held for one.

Pure bookkeeping; event loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from llmproxy.proxy.relay.sse import SseEvent
from llmproxy.proxy.request import Body
from llmproxy.proxy.routes import paths

#: bytes held back waiting for an event's end, at most: past it the stream is passed on as
#: it came and never preempted (its text so far is unknown)
MAX_EVENT = 64 * 1024
TEXT_ROUTES = paths(prompt="text", answer="native") | paths(prompt="text", answer="oai")
NATIVE_ROUTES = paths(prompt="text", answer="native")
CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
_LIMITS = ("n_predict", "max_tokens", "max_completion_tokens")
_STATEFUL = (
    "grammar",
    "json_schema",
    "response_format",
    "tools",
    "functions",
    "n_probs",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "return_tokens",
    "post_sampling_probs",
)


def resumable(kind: str, path: str, parsed: Body) -> bool:
    """Can a generation of ``parsed`` on ``path``, on an upstream of ``kind``, be stopped
    and continued exactly (see the module's docstring)?"""
    if not isinstance(parsed, dict):
        return False
    if path in NATIVE_ROUTES:
        if kind != "llamacpp":
            return False
    elif path in TEXT_ROUTES:
        if kind not in ("llamacpp", "openai"):
            return False
    elif path in CHAT_ROUTES:
        if kind != "llamacpp" or not _chat_messages(parsed):
            return False
    else:
        return False
    if path not in CHAT_ROUTES and not isinstance(parsed.get("prompt"), str):
        return False
    if any(parsed.get(k) not in (None, False, 0, "", [], {}) for k in _STATEFUL):
        return False
    if any(parsed.get(k) not in (None, 1) for k in ("n", "n_cmpl")):
        return False
    return all(
        parsed.get(k) is None or (type(parsed.get(k)) is int and parsed[k] >= 0) for k in _LIMITS
    )


def _chat_messages(parsed: dict[str, Any]) -> bool:
    """Messages of plain text whose last one is not the assistant's (a prefill of its own)."""
    messages = parsed.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return False
    return bool(messages[-1].get("role") != "assistant")


class Transcript:
    """What a resumable stream produced so far (see the module's docstring): fed its whole
    events by its job."""

    __slots__ = ("chat", "pieces", "tokens", "exact", "last_prompt_n")

    def __init__(self, path: str) -> None:
        self.chat = path in CHAT_ROUTES
        self.pieces: list[str] = []
        self.tokens = 0  # generated so far, over every segment
        self.exact = True
        self.last_prompt_n: int | None = None  # prompt tokens the latest segment evaluated

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def take(self, events: Iterable[SseEvent]) -> None:
        for e in events:
            if e.bad:
                self.event(None)
            elif e.data and not e.done:
                self.event(e.obj)

    def event(self, obj: Any) -> None:
        """One event's JSON (None: not JSON)."""
        if not isinstance(obj, dict):
            self.exact = False
            return
        timings = obj.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
            self.last_prompt_n = timings["prompt_n"]
        choices = obj.get("choices")
        if isinstance(choices, list):
            choice = choices[0] if choices and isinstance(choices[0], dict) else {}
            if self.chat:
                delta = _delta(obj)
                if delta.get("tool_calls") or delta.get("reasoning_content"):
                    self.exact = False
                self._piece(delta.get("content"), None)
            else:
                self._piece(choice.get("text"), None)
        elif obj.get("stop") is False:
            self._piece(obj.get("content"), obj.get("tokens"))

    def _piece(self, text: Any, tokens: Any) -> None:
        if isinstance(text, str) and text:
            self.pieces.append(text)
            # llama-server's native events name their tokens (a held-back stop word's come
            # together); else one event is one token
            self.tokens += len(tokens) if isinstance(tokens, list) and tokens else 1


def _delta(obj: dict[str, Any]) -> dict[str, Any]:
    choices = obj.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return delta if isinstance(delta, dict) else {}


def continuation(path: str, parsed: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
    """The request for the rest of a resumable generation (see the module's docstring).
    ``parsed``: the request as its client sent it, never an earlier continuation (the
    transcript holds every segment's text and tokens)."""
    body = dict(parsed)
    text = transcript.text
    if path in CHAT_ROUTES:
        body["messages"] = [*parsed["messages"], {"role": "assistant", "content": text}]
    else:
        body["prompt"] = parsed["prompt"] + text
    for key in _LIMITS:
        limit = parsed.get(key)
        if type(limit) is int and limit >= 0:
            body[key] = max(limit - transcript.tokens, 0)
    return body


class Echo:
    """The prefill a chat continuation repeats first (``text``), taken out of its events."""

    __slots__ = ("_echo",)

    def __init__(self, text: str) -> None:
        self._echo = text

    def strip(self, events: Sequence[SseEvent]) -> Sequence[SseEvent]:
        """``events`` with the echo still to come taken out of their content (new events
        where that changed one: the others are shared)."""
        if not self._echo:
            return events
        out = []
        for e in events:
            obj = e.fields
            content = _delta(obj).get("content") if obj is not None else None
            if self._echo and isinstance(content, str) and content:
                rest, self._echo = strip_echo(content, self._echo)
                if rest != content:
                    e = SseEvent.of(_with_content(obj, rest))  # type: ignore[arg-type]
            out.append(e)
        return out


def strip_echo(content: str, echo: str) -> tuple[str, str]:
    """A chat continuation's content piece with the prefill it repeats (``echo``) taken out:
    (the piece left, the echo still to come)."""
    if content.startswith(echo):
        return content[len(echo) :], ""
    if echo.startswith(content):
        return "", echo[len(content) :]
    return content, ""  # no echo after all


def _with_content(obj: dict[str, Any], content: str) -> dict[str, Any]:
    """A copy of chunk ``obj`` whose first choice's ``delta.content`` is ``content``."""
    choice = obj["choices"][0]
    return {
        **obj,
        "choices": [{**choice, "delta": {**choice["delta"], "content": content}}]
        + obj["choices"][1:],
    }
