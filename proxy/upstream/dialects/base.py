"""The dialect: what a kind of upstream needs of a gated request's wire form.

A dialect is a frozen value. It says which routes run on the upstream's slots, how many
slots a request takes, how its body is written for the permit it holds, whether it is sent
as a stream and answered whole (assemble.py), and whether the upstream's head comes only
once the request runs on its slot. It holds no connection and learns nothing: the adapter
(adapters/) builds a new one when detection (detect.py) or a later probe learns what
changes it, and a job keeps the dialect it was granted with until its exchange ends, so
nothing is swapped under a running request. What the upstream's slots are doing now (stop
confirmation, quarantine, the slot count) is the adapter's: its per-upstream slot view.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmproxy.proxy.gating.routes import GATED_ROUTES
from llmproxy.proxy.request import Body


class TooManySlots(Exception):
    """A request asks for more slots at once than the proxy has (``Dialect.permits``); the
    adapter, which knows why the count is what it is, turns it into the client's 400."""

    def __init__(self, field: str, wanted: int, capacity: int) -> None:
        super().__init__(
            f"'{field}' = {wanted} needs {wanted} slots at once, llmproxy has {capacity}"
        )
        self.field, self.wanted, self.capacity = field, wanted, capacity


@dataclass(frozen=True, slots=True)
class Dialect:
    """An upstream that speaks plainly (Ollama, and the base of the others; each adapter
    names its kind): bodies as sent, one slot per request, nothing assembled."""

    kind: str = "openai"
    #: POST routes that run on the upstream's slots: gated (the others pass through)
    gated_routes: frozenset[str] = GATED_ROUTES
    #: closing a streaming request's connection stops its generation at the next token, with
    #: nothing to confirm it by: policy auto cancels such a stream and holds the permit about
    #: one token's time (confirm.py), instead of letting it run to its end
    stops_streams: bool = False

    def prepare_body(self, path: str, raw: bytes, body: Body, slot: int) -> bytes:
        """The body to send upstream for a gated request holding permit ``slot``."""
        return raw

    def assembles(self, path: str, body: Body) -> bool:
        """Is this request sent as a stream and answered whole (assemble.py)?"""
        return False

    def answers_at_start(self, path: str, body: Body) -> bool:
        """Does the upstream send its response head only once the request runs on its slot,
        so that a confirmed stop may wait for the head before it cuts (job.py)?"""
        return False

    def permits(self, path: str, body: Body, capacity: int) -> int:
        """How many slots (1..``capacity``) a gated request on ``path`` occupies at once;
        ``TooManySlots`` if it cannot fit."""
        return 1
