"""A non-streaming answer rendered from the upstream's stream (llama-server's completion and
chat routes; upstream/assemble.py says which requests are sent as a stream for it).

The client that did not ask for a stream is answered with the JSON body llama-server
would have sent for the same request, assembled from the stream's events:

- native routes (``/completion``, ``/completions``, ``/infill``): the final event (the one
  that is not ``"stop": false``) is the non-streaming body with an empty ``content``; it
  gets the text of the partial events, and ``generation_settings.stream`` says ``false``.
  ``response_fields`` is honoured because llama-server applies it to that final event
  itself (flat keys such as ``"timings/prompt_n"``). Several completions (``n_cmpl``) give
  a JSON array in ``index`` order, one object for one.
- chat routes (``/v1/chat/completions``, ``/chat/completions``; not with tools or
  log-probabilities): the ``chat.completion`` body from the chunks' ``delta`` content and
  ``reasoning_content``, the final chunk's ``finish_reason``, and ``usage`` and ``timings``
  from the chunk that carries them (the stream is asked for ``include_usage``).
- ``/v1/completions``: the final chunk (``finish_reason`` set) is the body with an empty
  ``choices[0].text``; several completions are merged into the first one's ``choices``. A
  stream that ends with ``[DONE]`` but gave no ``finish_reason`` (some OpenAI-compatible
  servers) takes each completion's last chunk as its final one.
- An error event (``data: {"error": {...}}``) becomes the status its ``code`` names with
  ``{"error": {...}}``, as llama-server answers a failed non-streaming request.

Written compactly (``"content":"``: llama.vim matches that text). The events are shared
with the stream's other readers (relay/sse.py): the rendering copies what it changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from llmproxy.proxy.errors import UpstreamFailed
from llmproxy.proxy.relay.sse import Framer, SseEvent
from llmproxy.proxy.routes import paths

NATIVE_ROUTES = paths(assembled=True, answer="native")
OAI_ROUTES = paths(assembled=True, answer="oai")
CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
CONTENT_TYPE = "application/json; charset=utf-8"  # llama-server's for a JSON body


class Assembler:
    """Reads one upstream SSE stream (``take`` its events, or ``feed`` its bytes) and renders
    the non-streaming body (``render``).

    Also keeps the text generated so far per completion (``text``). An event counts once its
    blank line came. Pure bookkeeping: no I/O."""

    __slots__ = (
        "oai",
        "_framer",
        "_texts",
        "_finals",
        "_lasts",
        "_done",
        "_last_index",
        "error",
        "chat",
        "_reasoning",
        "_extra",
    )

    def __init__(self, path: str) -> None:
        self.oai = path in OAI_ROUTES
        self.chat = path in CHAT_ROUTES
        self._reasoning: dict[int, list[str]] = {}  # chat: reasoning_content pieces
        self._extra: dict[str, Any] = {}  # chat: usage and timings, from whichever chunk
        self._framer = Framer()  # for ``feed``
        self._texts: dict[int, list[str]] = {}
        self._finals: list[tuple[int, dict[str, Any]]] = []
        self._lasts: dict[int, dict[str, Any]] = {}  # OpenAI: each completion's last chunk
        self._done = False  # OpenAI: [DONE] came
        self._last_index = 0
        self.error: dict[str, Any] | None = None

    def text(self, index: int = 0) -> str:
        return "".join(self._texts.get(index, ()))

    @property
    def complete(self) -> bool:
        done = (self.oai or self.chat) and self._done and bool(self._lasts)
        return bool(self._finals) or done or self.error is not None

    def feed(self, data: bytes) -> None:
        """Bytes of the stream, as they came."""
        self.take(self._framer.feed(data))

    def cut(self) -> None:
        """The stream fed as bytes was cut: an event not ended yet is dropped."""
        self._framer.cut()

    def take(self, events: Iterable[SseEvent]) -> None:
        """Whole events of the stream, in order."""
        for event in events:
            self._event(event)

    def _event(self, event: SseEvent) -> None:
        if event.done:
            self._done = True
            return
        if not event.data:
            return
        if event.bad:
            raise UpstreamFailed("upstream sent a malformed stream event")
        obj = event.obj
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
        self.take(self._framer.flush())  # fed as bytes: a last event without its blank line
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
        obj = dict(obj)  # shared with the stream's other readers
        if "content" in obj:
            obj["content"] = self.text(index)
        settings = obj.get("generation_settings")
        if isinstance(settings, dict) and "stream" in settings:
            obj["generation_settings"] = {**settings, "stream": False}
        if "generation_settings/stream" in obj:
            obj["generation_settings/stream"] = False
        return obj

    def _oai_body(self, finals: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        choices = []
        for index, obj in finals:
            choices.append({**obj["choices"][0], "text": self.text(index)})
        body = {**finals[0][1], "choices": choices}
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


def _dumps(obj: Any) -> bytes:
    """Compact JSON with UTF-8 as it is, as llama-server writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
