"""Server-sent events, framed and parsed once per upstream stream.

An upstream's event stream (llama-server's ``data: {...}`` lines, OpenAI's chunks) is read
by up to three parties: the stream assembler (upstream/assemble.py), type-through's record
of the generation (proxy/reuse/), and a resumable stream's transcript (upstream/resume.py).
The exchange frames the stream once (``Framer``) and gives each of them the same
``SseEvent``s, each event's JSON parsed once (common/fastjson.py).

An event is the bytes up to and including a blank line (``\\n\\n``, CRLF allowed), as the
upstream sent them (``raw``: relayed byte for byte); its payload is its ``data:`` lines'
values joined by a newline. The objects are shared by every reader: nobody mutates them.

Pure bookkeeping, no I/O; one reader task per framer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmproxy.common.fastjson import loads

_BOUNDARY = re.compile(rb"\r?\n\r?\n")
DONE = b"[DONE]"


class SseEvent:
    """One whole event: ``raw`` as it came, ``data`` its payload, ``obj`` the payload's JSON
    (None: no payload, ``[DONE]``, or not JSON: ``bad``)."""

    __slots__ = ("raw", "data", "obj", "bad")

    def __init__(self, raw: bytes, *, unframed: bool = False) -> None:
        """``unframed``: bytes given up on before their event ended (``Framer``'s limit)."""
        self.raw = raw
        if raw.startswith(b"data:") and raw.endswith(b"\n\n") and raw.find(b"\n") == len(raw) - 2:
            data = raw[5:].strip()
        else:
            parts = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            data = parts[0] if len(parts) == 1 else b"\n".join(parts)
        self.data = data
        self.obj: Any = None
        self.bad = unframed
        if data and data != DONE and not unframed:
            try:
                self.obj = loads(data)
            except (ValueError, RecursionError):
                self.bad = True

    @classmethod
    def of(cls, obj: dict[str, Any]) -> SseEvent:
        """The event ``data: OBJ``, written compactly as llama-server writes it."""
        event = cls.__new__(cls)
        event.data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        event.raw, event.obj, event.bad = b"data: " + event.data + b"\n\n", obj, False
        return event

    @property
    def done(self) -> bool:
        """OpenAI's end of stream (``data: [DONE]``)."""
        return self.data == DONE

    @property
    def fields(self) -> dict[str, Any] | None:
        """The payload when it is a JSON object."""
        return self.obj if isinstance(self.obj, dict) else None


class Framer:
    """Bytes of one event stream in, whole ``SseEvent``s out (see the module's docstring)."""

    __slots__ = ("_pending", "_limit")

    def __init__(self, limit: int | None = None) -> None:
        """``limit``: the most bytes held for an event not whole yet; past it they are given
        up on, as one ``bad`` event (other framing: no event ends)."""
        self._pending = b""  # the start of an event whose blank line has not come yet
        self._limit = limit

    @property
    def pending(self) -> int:
        """Bytes held for an event not whole yet."""
        return len(self._pending)

    def feed(self, data: bytes) -> list[SseEvent]:
        """The events ``data`` completes, in order."""
        if (
            not self._pending
            and data.endswith(b"\n\n")
            and data.find(b"\n\n") == len(data) - 2
            and b"\r" not in data
        ):
            return [SseEvent(data)]  # one whole event, as a server paced by tokens sends it
        buf = self._pending + data if self._pending else data
        events = []
        start = 0
        for match in _BOUNDARY.finditer(buf):
            events.append(SseEvent(buf[start : match.end()]))
            start = match.end()
        self._pending = buf[start:]
        if self._limit is not None and len(self._pending) > self._limit:
            events.append(SseEvent(self._pending, unframed=True))
            self._pending = b""
        return events

    def flush(self) -> list[SseEvent]:
        """At the stream's end: a last event that came without its blank line."""
        pending, self._pending = self._pending, b""
        return [SseEvent(pending)] if pending.strip() else []

    def cut(self) -> None:
        """The stream was cut: the event not whole yet is dropped."""
        self._pending = b""
