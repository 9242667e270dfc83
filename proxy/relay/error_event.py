"""The event that ends a started response stream with an error, in the stream's own format.

Once a response has started its status cannot change: ``Responder.outcome`` ends a stream
that fails after its start with this event, and a body that has no such format is cut
instead (the connection closed).

On completion routes (``cuts_after_error``) the event is followed by no terminator either:
the connection closes after it, mid-body. Editor clients there take what a stream that
ended cleanly carried for a suggestion, whatever its last event said (minuet-ai.nvim keeps
the text of any stream curl read to its end: see docs/clients.md), so a superseded or
failed stream would be inserted cut. A body cut before its terminator is a transfer error
to every HTTP client (curl exits 18, aiohttp raises ``ClientPayloadError``, fetch rejects),
so none takes it for a suggestion, and clients that read the event (Continue, Tabby) still
read it first. Chat routes keep the clean end: a chat client shows the partial answer with
its error.
"""

from __future__ import annotations

import json

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.routes import ROUTES

#: route families whose streams are cut after their error event (see the module docstring)
CUT_FAMILIES = frozenset({"completion", "infill"})


def cuts_after_error(path: str) -> bool:
    """Does a started stream of ``path`` that fails end without its terminator?"""
    route = ROUTES.get(path)
    return route is not None and route.family in CUT_FAMILIES


def stream_error_bytes(content_type: str, error: ProxyError, tail: bytes = b"") -> bytes | None:
    """The event that ends a started stream with ``error``, in the stream's own format.

    SSE (llama.cpp, OpenAI): a ``data:`` line holding the error envelope, the shape those
    servers use for their own in-stream errors. NDJSON (Ollama): Ollama's own error line,
    whose ``error`` is the message string (its clients raise ``Error(line.error)``: an object
    there reads "[object Object]"), with the envelope's other fields beside it. None for any
    other body: it has no error event.

    ``tail``: the last bytes relayed before. An upstream cut inside an event or line leaves
    it unfinished; it is ended first (line feeds), so the error event stands on its own and
    parses, instead of being glued onto the broken one.
    """
    if content_type.startswith("text/event-stream"):
        payload = json.dumps(error.envelope(), separators=(",", ":"))
        return _end_event(tail) + f"data: {payload}\n\n".encode()
    if content_type in ("application/x-ndjson", "application/jsonl", "application/json-seq"):
        fields = error.envelope()["error"]
        line = {"error": fields["message"]} | {k: v for k, v in fields.items() if k != "message"}
        rs = "\x1e" if content_type == "application/json-seq" else ""  # RFC 7464 record separator
        newline = b"" if not tail or tail.endswith(b"\n") else b"\n"
        return newline + (rs + json.dumps(line, separators=(",", ":")) + "\n").encode()
    return None


def _end_event(tail: bytes) -> bytes:
    """Line feeds that end an SSE event left open by ``tail`` (nothing at an event boundary)."""
    if not tail or tail.endswith((b"\n\n", b"\r\r", b"\r\n\r\n")):
        return b""
    return b"\n" if tail.endswith(b"\n") else b"\n\n"  # after a lone "\r", a "\n" would join it
