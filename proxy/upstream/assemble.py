"""A non-streaming answer rendered from the upstream's stream (llama-server's completion and
chat routes).

llama-server notices a dropped client of a streaming request at its next token, but a
dropped client of a non-streaming one only when another completion request arrives: a
cancelled non-streaming generation would run to its end while the proxy holds its permit.
So on its completion and chat routes the proxy asks for a stream (``stream: true``) and answers a
client that did not ask for one with the JSON body llama-server would have sent for the
same request, assembled from the stream's events:

- native routes (``/completion``, ``/completions``, ``/infill``): the final event (the one
  that is not ``"stop": false``) is the non-streaming body with an empty ``content``; it
  gets the text of the partial events, and ``generation_settings.stream`` says ``false``.
  ``response_fields`` is honoured because llama-server applies it to that final event
  itself (flat keys such as ``"timings/prompt_n"``). Several completions (``n_cmpl``) give
  a JSON array in ``index`` order, one object for one.
- chat routes (``/v1/chat/completions``, ``/chat/completions``; not with tools or
  log-probabilities): the ``chat.completion`` body from the chunks' ``delta`` content and
  ``reasoning_content``, the final chunk's ``finish_reason``, and ``usage`` and ``timings``
  from the chunk that carries them (the stream is asked for ``include_usage``). A
  continuation after a preemption repeats its prefill first: it is taken out
  (``expect_echo``).
- ``/v1/completions``: the final chunk (``finish_reason`` set) is the body with an empty
  ``choices[0].text``; several completions are merged into the first one's ``choices``. A
  stream that ends with ``[DONE]`` but gave no ``finish_reason`` (some OpenAI-compatible
  servers) takes each completion's last chunk as its final one.
- An error event (``data: {"error": {...}}``) becomes the status its ``code`` names with
  ``{"error": {...}}``, as llama-server answers a failed non-streaming request.

Written compactly (``"content":"``: llama.vim matches that text). Requests whose streamed
form carries different data are not converted (``assembles``): per-token probabilities
(``n_probs``, ``logprobs``), ``return_tokens`` (a stream leaves out the tokens of a held-back
stop word), ``verbose``, and ``n_cmpl`` > 1 together with ``response_fields`` (the final
events may then lack the ``index`` that orders them).
"""

from __future__ import annotations

import json
from typing import Any

from llmproxy.proxy.errors import UpstreamFailed
from llmproxy.proxy.routes import paths

NATIVE_ROUTES = paths(assembled=True, answer="native")
OAI_ROUTES = paths(assembled=True, answer="oai")
CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
ROUTES = NATIVE_ROUTES | OAI_ROUTES | CHAT_ROUTES
#: chat requests whose streamed answer carries more than text (tool calls' pieces), or
#: per-token data: sent as the client asked
_CHAT_APART = ("tools", "functions", "logprobs", "top_logprobs")
CONTENT_TYPE = "application/json; charset=utf-8"  # llama-server's for a JSON body


def _number(body: dict[str, Any], key: str) -> float:
    value = body.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def assembles(path: str, body: Any) -> bool:
    """Would llama-server answer ``body`` on ``path`` without streaming, and can that answer be
    rendered exactly from its stream? (``stream`` is on only when it is exactly ``true``, as
    llama-server reads it.)"""
    if path not in ROUTES or not isinstance(body, dict) or body.get("stream") is True:
        return False
    if (
        _number(body, "n_probs") > 0
        or body.get("return_tokens") is True
        or body.get("verbose") is True
    ):
        return False
    if path in OAI_ROUTES and body.get("logprobs") not in (None, False, 0):
        return False
    if path in CHAT_ROUTES and any(body.get(k) not in (None, False, 0, []) for k in _CHAT_APART):
        return False
    several = _number(body, "n_cmpl") > 1 or _number(body, "n") > 1
    return not (several and body.get("response_fields"))


class Assembler:
    """Reads one upstream SSE stream (``feed``) and renders the non-streaming body (``render``).

    Also keeps the text generated so far per completion (``text``). An event counts once its
    blank line came (``cut`` drops one that was cut before it: a preempted stream's, whose
    continuation sends it again). Pure bookkeeping: no I/O."""

    __slots__ = (
        "oai",
        "_pending",
        "_data",
        "_texts",
        "_finals",
        "_lasts",
        "_done",
        "_last_index",
        "error",
        "chat",
        "_reasoning",
        "_extra",
        "_echo",
    )

    def __init__(self, path: str) -> None:
        self.oai = path in OAI_ROUTES
        self.chat = path in CHAT_ROUTES
        self._reasoning: dict[int, list[str]] = {}  # chat: reasoning_content pieces
        self._extra: dict[str, Any] = {}  # chat: usage and timings, from whichever chunk
        self._echo = ""  # chat: the prefill a continuation repeats first, still to drop
        self._pending = b""  # an unfinished line
        self._data: list[bytes] = []  # the ``data:`` lines of an event not ended yet
        self._texts: dict[int, list[str]] = {}
        self._finals: list[tuple[int, dict[str, Any]]] = []
        self._lasts: dict[int, dict[str, Any]] = {}  # OpenAI: each completion's last chunk
        self._done = False  # OpenAI: [DONE] came
        self._last_index = 0
        self.error: dict[str, Any] | None = None

    def text(self, index: int = 0) -> str:
        return "".join(self._texts.get(index, ()))

    def expect_echo(self, text: str) -> None:
        """The chat continuation about to start repeats ``text`` (its prefill) first."""
        self._echo = text

    @property
    def complete(self) -> bool:
        done = (self.oai or self.chat) and self._done and bool(self._lasts)
        return bool(self._finals) or done or self.error is not None

    def feed(self, data: bytes) -> None:
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._data.append(line[5:].strip())
            elif not line.strip():
                self._flush()

    def _flush(self) -> None:
        events, self._data = self._data, []
        for payload in events:
            self._event(payload)

    def cut(self) -> None:
        """The stream was cut: an event not ended yet is dropped."""
        self._pending, self._data = b"", []

    def _event(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self._done = True
        if not payload or payload == b"[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise UpstreamFailed("upstream sent a malformed stream event") from None
        if not isinstance(obj, dict):
            raise UpstreamFailed("upstream sent a stream event that is not a JSON object")
        if isinstance(obj.get("error"), dict):
            self.error = obj["error"]
        elif self.chat:
            self._chat_event(obj)
        elif self.oai:
            self._oai_event(obj)
        else:
            self._native_event(obj)

    def _native_event(self, obj: dict[str, Any]) -> None:
        index = obj.get("index", self._last_index)
        index = index if isinstance(index, int) else 0
        if obj.get("stop") is False:  # a partial: one piece of text (or a progress report)
            self._last_index = index
            piece = obj.get("content")
            if isinstance(piece, str) and piece:
                self._texts.setdefault(index, []).append(piece)
        else:
            self._finals.append((index, obj))

    def _oai_event(self, obj: dict[str, Any]) -> None:
        choices = obj.get("choices")
        choice = (
            choices[0]
            if isinstance(choices, list) and choices and isinstance(choices[0], dict)
            else None
        )
        if choice is None:
            return
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else 0
        piece = choice.get("text")
        if isinstance(piece, str) and piece:
            self._texts.setdefault(index, []).append(piece)
        self._lasts[index] = obj
        if choice.get("finish_reason") is not None:
            self._finals.append((index, obj))

    def _chat_event(self, obj: dict[str, Any]) -> None:
        for key in ("usage", "timings"):
            if isinstance(obj.get(key), dict):
                self._extra[key] = obj[key]
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return  # the usage chunk (``include_usage``): no choice
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else 0
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        piece = delta.get("content")
        if isinstance(piece, str) and piece:
            if self._echo:
                piece, self._echo = strip_echo(piece, self._echo)
            self._texts.setdefault(index, []).append(piece)
        thought = delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            self._reasoning.setdefault(index, []).append(thought)
        self._lasts[index] = obj
        if choice.get("finish_reason") is not None:
            self._finals.append((index, obj))

    def render(self) -> tuple[int, bytes]:
        """(status, body) of the non-streaming answer; UpstreamFailed if the stream ended
        with neither a final event nor an error."""
        if self._pending.startswith(b"data:"):  # a last line without its newline
            self._data.append(self._pending[5:].strip())
        self._pending = b""
        self._flush()  # a last event without its blank line
        if self.error is not None:
            code = self.error.get("code")
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return status, _dumps({"error": self.error})
        finals = self._finals
        if not finals and (self.oai or self.chat) and self._done:
            finals = list(self._lasts.items())
        if not finals:
            raise UpstreamFailed("upstream stream ended before its final event")
        finals = sorted(finals, key=lambda item: item[0])
        if self.chat:
            return 200, _dumps(self._chat_body(finals))
        if self.oai:
            return 200, _dumps(self._oai_body(finals))
        bodies = [self._native_body(index, obj) for index, obj in finals]
        return 200, _dumps(bodies[0] if len(bodies) == 1 else bodies)

    def _native_body(self, index: int, obj: dict[str, Any]) -> dict[str, Any]:
        if "content" in obj:
            obj["content"] = self.text(index)
        settings = obj.get("generation_settings")
        if isinstance(settings, dict) and "stream" in settings:
            settings["stream"] = False
        if "generation_settings/stream" in obj:
            obj["generation_settings/stream"] = False
        return obj

    def _oai_body(self, finals: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        choices = []
        for index, obj in finals:
            choice = obj["choices"][0]
            choice["text"] = self.text(index)
            choices.append(choice)
        body = finals[0][1]
        body["choices"] = choices
        return body

    def _chat_body(self, finals: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        """llama-server's ``chat.completion`` body, its keys in its order."""
        choices = []
        for index, obj in finals:
            message: dict[str, Any] = {"role": "assistant", "content": self.text(index)}
            if index in self._reasoning:
                message["reasoning_content"] = "".join(self._reasoning[index])
            reason = obj["choices"][0].get("finish_reason")
            choices.append({"finish_reason": reason, "index": index, "message": message})
        first = finals[0][1]
        body: dict[str, Any] = {"choices": choices}
        for key in ("created", "model", "system_fingerprint"):
            if key in first:
                body[key] = first[key]
        body["object"] = "chat.completion"
        if "usage" in self._extra:
            body["usage"] = self._extra["usage"]
        if "id" in first:
            body["id"] = first["id"]
        if "timings" in self._extra:
            body["timings"] = self._extra["timings"]
        return body


def strip_echo(content: str, echo: str) -> tuple[str, str]:
    """A chat continuation's content piece with the prefill it repeats (``echo``) taken out:
    (the piece left, the echo still to come)."""
    if content.startswith(echo):
        return content[len(echo) :], ""
    if echo.startswith(content):
        return "", echo[len(content) :]
    return content, ""  # no echo after all


def _dumps(obj: Any) -> bytes:
    """Compact JSON with UTF-8 as it is, as llama-server writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
