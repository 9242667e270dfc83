"""A gated request as the proxy reads it: built once by the gated handler
(http/handlers.py, from http/bodies.py's parse) and passed down the request's path to the
scheduler and the upstream job, which read it and never change it.

``body`` is the client's JSON object, parsed once; ``raw`` the bytes it came as, forwarded
byte for byte unless the upstream's dialect writes a body of its own (``id_slot``, a
stream asked for; upstream/dialects/). No module here imports anything of the proxy's parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the gated request body: a JSON object
Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class GatedRequest:
    method: str
    route: str  # the path, as routes are matched
    raw_path: str  # as sent on, query included
    raw: bytes
    body: Body
    session: str  # gating/sessions.py
    klass: str  # complete, chat or bulk (gating/classes.py)
    caller: str  # the client key's name, else the client's address (pool/shares.py)
    continuable: bool  # later keystrokes may supersede or continue it (type-through)
    twin: str | None  # its twin key (twins.py): equal bodies of one session are twins

    @property
    def stream(self) -> bool:
        """Did the client ask for a stream (``stream`` exactly true, as llama-server reads it)?"""
        return self.body.get("stream") is True
