"""A generation that later requests of its session may be answered from (type-through).

A ``Generation`` is the record of one upstream event stream: its events as they arrived
(``events``), the text of its first completion so far (``text``), and how it ended. The
upstream job that owns the request feeds it (``feed``, then ``end``); requests that
continue it read it (``follow``), each from its own offset, and wait for more with
``changed``.

Turns: each reader that joins supersedes the readers before it, as a newer request of the
session supersedes an older one: the request that started the generation is told through
``on_superseded`` (set by its job), a follower learns it from ``readers`` (its turn is the
count when it joined). Superseded readers end their answers; the generation runs on.

Liveness: a generation runs for its readers, the request that started it and those that
follow it (``join``), and for requests waiting to learn whether they follow it (``keep``).
When the last one leaves (``leave``), ``on_orphaned`` (set by the job that owns it) runs
after ``grace_s`` unless a new reader came meanwhile: the job then applies its disconnect
policy. The grace lets an editor that closes its previous request just before sending the
next keystroke's continue the generation instead of cancelling it.

Concurrency contract: used on the event loop's thread only. ``feed``, ``end``, ``join``,
``keep`` and ``leave`` never block; ``changed()`` blocks until the next ``feed`` or ``end``
and is cancelled by its caller (a reader whose client left). A generation holds no permit
and no task: the job that feeds it owns both, and ends it (``end``) on every path, so no
reader waits forever. Its one timer is a loop handle, cancelled by ``keep`` (``join``) and
``end``.

Events are the upstream's SSE events (``data: {...}``), llama-server's native form (a
piece is ``content`` of an event with ``"stop": false``) or OpenAI's (``choices[0].text``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.relay.sse import Framer, SseEvent


class Event:
    """One SSE event: its bytes as the upstream sent them, and the text piece it carries."""

    __slots__ = ("raw", "obj", "piece")

    def __init__(self, raw: bytes, obj: dict[str, Any] | None, piece: str) -> None:
        self.raw, self.obj, self.piece = raw, obj, piece


def _piece(obj: dict[str, Any], oai: bool) -> str:
    """The text an event adds to the first completion ("" for any other event)."""
    if oai:
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            if choice.get("index", 0) == 0 and isinstance(choice.get("text"), str):
                return str(choice["text"])
        return ""
    if obj.get("stop") is False and obj.get("index", 0) == 0:
        content = obj.get("content")
        return content if isinstance(content, str) else ""
    return ""


class Generation:
    """One upstream generation of ``route`` for ``body`` (the client's parsed body)."""

    def __init__(
        self,
        route: str,
        body: dict[str, Any],
        *,
        oai: bool,
        stream: bool,
        grace_s: float = 0.0,
        on_orphaned: Callable[[], None] | None = None,
        on_superseded: Callable[[], None] | None = None,
        on_joined: Callable[[str | None], None] | None = None,
    ) -> None:
        self.route, self.body, self.oai, self.stream = route, body, oai, stream
        self.grace_s, self.on_orphaned, self.on_superseded = grace_s, on_orphaned, on_superseded
        # told the twin key of each reader that joins: the request it now answers, whose
        # twins must not supersede the generation under it (the job re-keys its ticket)
        self.on_joined = on_joined
        self.live = 1  # readers still there: the request that started it, and followers
        self._timer: asyncio.TimerHandle | None = None
        self.events: list[Event] = []
        self.text = ""
        self.done = False
        self.error: ProxyError | None = None  # the upstream failed, or the generation was cut
        self.ended_at: float | None = None
        self.readers = 0  # followers joined so far: the turn of the newest
        # twin keys of the requests that followed it or waited on it (registry.py)
        self.followers: set[str] = set()
        self.reused_tokens = 0
        self._framer = Framer()  # for ``feed``
        self._changed = asyncio.Event()

    @property
    def ok(self) -> bool:
        """Ended complete: every reader can be given its whole answer."""
        return self.done and self.error is None

    @property
    def said_all(self) -> bool:
        """Ended complete and by itself (end of text, a stop word): its final event says so.
        False when it stopped at its token limit, or its final event does not tell (its
        ``response_fields`` left the reason out): a new request may write more."""
        if not self.ok:
            return False
        for event in reversed(self.events):
            obj = event.obj
            if obj is None:
                continue
            if self.oai:
                choices = obj.get("choices")
                if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                    reason = choices[0].get("finish_reason")
                    if reason is not None:
                        return bool(reason == "stop")
            elif obj.get("stop") is not False:  # the final event
                return obj.get("stop_type") in ("eos", "word")
        return False

    def feed(self, data: bytes) -> None:
        """Bytes of the upstream's event stream, as they arrive."""
        self.take(self._framer.feed(data))

    def take(self, events: Iterable[SseEvent]) -> None:
        """Whole events of the upstream's stream, as they arrive (shared: never changed)."""
        for e in events:
            obj = e.fields
            piece = _piece(obj, self.oai) if obj is not None else ""
            self.events.append(Event(e.raw, obj, piece))
            self.text += piece
        self._wake()

    def end(self, error: ProxyError | None = None) -> None:
        """The upstream's body ended (``error`` None), or the generation failed or was cut."""
        if self.done:
            return
        self.take(self._framer.flush())  # fed as bytes: a last event without its blank line
        self.done, self.error = True, error
        self.ended_at = time.monotonic()
        self.on_superseded = None  # the starting request's answer is complete, or failed
        self._cancel_timer()
        self._wake()

    def join(self, key: str | None = None) -> int:
        """One more reader, which supersedes the ones before it (see Turns); its turn.
        ``key``: the reader's twin key (proxy/twins.py), passed on to ``on_joined``."""
        self.keep()
        self.readers += 1
        if self.on_joined is not None:
            self.on_joined(key)
        starter, self.on_superseded = self.on_superseded, None
        if starter is not None and not self.done:
            starter()
        self._wake()  # followers waiting for more learn they were superseded
        return self.readers

    def keep(self) -> None:
        """Run on for one more request (a reader, or one waiting to learn whether it is
        one) until its ``leave``."""
        self.live += 1
        self._cancel_timer()

    def leave(self) -> None:
        """A reader is gone (its client left, or it read its answer to the end)."""
        self.live -= 1
        if self.live <= 0 and not self.done and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.grace_s, self._orphaned)

    def _orphaned(self) -> None:
        self._timer = None
        if self.live <= 0 and not self.done and self.on_orphaned is not None:
            self.on_orphaned()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        """Wait for the next ``feed`` or ``end`` (returns at once once ended)."""
        if not self.done:
            await self._changed.wait()

    def expired(self, ttl_s: float, now: float) -> bool:
        return self.ended_at is not None and now - self.ended_at > ttl_s

    def stream_from(self, start: int, skip: int) -> tuple[bytes, int]:
        """Events ``start`` onwards as bytes for a stream reader whose first ``skip``
        characters of text were typed already; returns them and the next event index.

        Events whose whole piece lies within the typed text are left out; the event the
        typed text ends in is written again with the rest of its piece (compact JSON, as
        the upstream writes it); every other event goes out as it came."""
        out = []
        pos = sum(len(e.piece) for e in self.events[:start])
        for event in self.events[start:]:
            end = pos + len(event.piece)
            if not event.piece or pos >= skip:
                out.append(event.raw)
            elif end > skip:
                out.append(self._trimmed(event, skip - pos))
            pos = end
        return b"".join(out), len(self.events)

    def _trimmed(self, event: Event, cut: int) -> bytes:
        assert event.obj is not None
        obj = json.loads(json.dumps(event.obj))  # a copy: the event stays as it came
        if self.oai:
            obj["choices"][0]["text"] = event.piece[cut:]
        else:
            obj["content"] = event.piece[cut:]
        return b"data: " + _dumps(obj) + b"\n\n"

    def tokens_after(self, skip: int) -> int:
        """Pieces (about one token each) of the text after its first ``skip`` characters."""
        pos, count = 0, 0
        for event in self.events:
            if event.piece:
                if pos + len(event.piece) > skip:
                    count += 1
                pos += len(event.piece)
        return count


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
