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
- ``Transcript`` reads the event stream as it is relayed (SSE ``data:`` events, whole ones
  only) and keeps the text and the count of tokens so far; an event it cannot continue
  (a tool call, reasoning text) makes it inexact, and such a stream is not preempted.
- ``continuation(path, parsed, transcript)``: the body for the rest, with the limit
  (``n_predict``, ``max_tokens``, ``max_completion_tokens``) reduced by the tokens
  already produced.
- ``Framed``: the writer a resumable stream is relayed through: it passes whole events
  only (a cut stream never leaves half an event with the client), and once the response
  has started a continuation's head is not written again.

Pure bookkeeping and one writer wrapper; event loop thread only.
"""

from __future__ import annotations

import json
from typing import Any

from multidict import CIMultiDict

from llmproxy.proxy.routes import paths
from llmproxy.proxy.upstream.assemble import strip_echo
from llmproxy.proxy.upstream.responder import Responder

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


def resumable(kind: str, path: str, parsed: Any) -> bool:
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
    """What a resumable stream produced so far (see the module's docstring): fed whole
    events by ``Framed``."""

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
    """The request for the rest of a resumable generation (see the module's docstring)."""
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


_MAX_EVENT = 64 * 1024  # bytes held back waiting for an event's end, at most


class Framed:
    """The writer of a resumable stream (see the module's docstring). ``observe`` gets each
    piece of the upstream's stream before it is written: it passes whole events on, to
    the ``Transcript`` and to the next ``piece``/``end`` write, with the prefill that
    llama-server's chat continuation repeats first (``expect_echo``) taken out."""

    __slots__ = ("out", "transcript", "_pending", "_ready", "_echo")

    def __init__(self, out: Responder, transcript: Transcript) -> None:
        self.out, self.transcript = out, transcript
        self._pending = b""  # the start of an event not complete yet
        self._ready = b""  # whole events for the next write
        self._echo = ""  # what the continuation's first content repeats, still to drop

    @property
    def started(self) -> bool:
        return self.out.started

    def cut(self) -> None:
        """The segment was cut: the unfinished event is dropped (the continuation sends
        its text again)."""
        self._pending = self._ready = b""

    def expect_echo(self, text: str) -> None:
        """The continuation about to start repeats ``text`` (its chat prefill) first."""
        self._echo = text

    def observe(self, data: bytes) -> None:
        data = self._pending + data
        end = data.rfind(b"\n\n")
        self._pending = data[end + 2 :] if end >= 0 else data
        self._ready = b""  # unless relayed (an answer assembled whole), nobody writes it
        for event in data[: end + 2].split(b"\n\n")[:-1] if end >= 0 else ():
            self._ready += self._event(event + b"\n\n")
        if len(self._pending) > _MAX_EVENT:  # no event ends (other framing): pass it on as
            # it came, and never preempt this stream (its text so far is unknown)
            self._ready += self._pending
            self._pending = b""
            self.transcript.exact = False

    def _event(self, raw: bytes) -> bytes:
        """One whole event: recorded, and as it goes on to the client."""
        payload = b"".join(
            line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            return raw
        try:
            obj = json.loads(payload)
        except ValueError:
            self.transcript.event(None)
            return raw
        if self._echo and isinstance(obj, dict):
            delta = _delta(obj)
            content = delta.get("content")
            if isinstance(content, str) and content:
                delta["content"], self._echo = strip_echo(content, self._echo)
                if delta["content"] != content:
                    raw = b"data: " + _dumps(obj) + b"\n\n"
        self.transcript.event(obj)
        return raw

    async def head(
        self, status: int, headers: CIMultiDict[str], content_length: int | None
    ) -> None:
        if not self.out.started:
            await self.out.head(status, headers, content_length)

    async def piece(self, data: bytes) -> None:
        ready, self._ready = self._ready, b""
        if ready:
            await self.out.piece(ready)

    async def end(self, last: bytes = b"") -> None:
        ready, self._ready, self._pending = self._ready + self._pending, b"", b""
        await self.out.end(ready)

    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        await self.out.whole(status, headers, body)


def _dumps(obj: Any) -> bytes:
    """Compact JSON with UTF-8 as it is, as llama-server writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
