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
    """What a resumable stream produced so far (see the module's docstring)."""

    __slots__ = ("chat", "_pending", "_data", "pieces", "tokens", "exact", "last_prompt_n")

    def __init__(self, path: str) -> None:
        self.chat = path in CHAT_ROUTES
        self._pending = b""  # an unfinished line
        self._data: list[bytes] = []  # the ``data:`` lines of an event not ended yet
        self.pieces: list[str] = []
        self.tokens = 0  # generated so far, over every segment
        self.exact = True
        self.last_prompt_n: int | None = None  # prompt tokens the latest segment evaluated

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, data: bytes) -> None:
        """A piece of the stream; an event counts once its blank line came (as ``Framed``
        passes it on)."""
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._data.append(line[5:].strip())
            elif not line.strip():
                events, self._data = self._data, []
                for payload in events:
                    self._event(payload)

    def _event(self, payload: bytes) -> None:
        if not payload or payload == b"[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.exact = False
            return
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
                delta = choice.get("delta")
                delta = delta if isinstance(delta, dict) else {}
                if delta.get("tool_calls") or delta.get("reasoning_content"):
                    self.exact = False
                self._piece(delta.get("content"))
            else:
                self._piece(choice.get("text"))
        elif obj.get("stop") is False:
            self._piece(obj.get("content"))

    def _piece(self, text: Any) -> None:
        if isinstance(text, str) and text:
            self.pieces.append(text)
            self.tokens += 1


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


class Framed:
    """The writer of a resumable stream: whole events only, one head (see the module's
    docstring). Delegates to the request's ``Responder``."""

    __slots__ = ("out", "_pending")

    def __init__(self, out: Responder) -> None:
        self.out = out
        self._pending = b""  # the start of an event not complete yet

    @property
    def started(self) -> bool:
        return self.out.started

    def cut(self) -> None:
        """The segment was cut: the unfinished event is dropped (the continuation sends
        its text again)."""
        self._pending = b""

    async def head(
        self, status: int, headers: CIMultiDict[str], content_length: int | None
    ) -> None:
        if not self.out.started:
            await self.out.head(status, headers, content_length)

    async def piece(self, data: bytes) -> None:
        data = self._pending + data
        end = data.rfind(b"\n\n")
        self._pending = data[end + 2 :] if end >= 0 else data
        if end >= 0:
            await self.out.piece(data[: end + 2])

    async def end(self, last: bytes = b"") -> None:
        last, self._pending = self._pending + last, b""
        await self.out.end(last)

    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        await self.out.whole(status, headers, body)
