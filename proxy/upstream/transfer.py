"""The part of an upstream job (job.py) that runs one exchange with the upstream: the
request sent, its events read (the job's state, type-through's record, a resumable
stream's transcript) and relayed to the client (relay/writer.py), in a cancel scope.

Concurrency contract (the job's task runs all of it; see job.py for the whole job's):
- The job's upstream transfer runs inside the job task, in a cancel scope (the pattern of
  ``asyncio.timeout``): ``stop(reason)`` (supersede, or the client left, under policy
  ``cancel``; under any policy while the request was not sent yet: one that never left
  is stopped for free, so it never reaches the upstream) cancels the job task only while
  it is in that scope; the scope absorbs that one cancellation (``Task.uncancel``) after
  the upstream connection was closed, and the job then waits for the adapter to confirm
  the stop (or, for adapters that cannot, holds the permit ``unconfirmed_cancel_hold_s``;
  confirm.py). A request that failed after it was sent (a read timeout, a body cut short)
  had its connection closed the same way, and is treated as such a stop: confirmed where
  the adapter can, else held ``unconfirmed_cancel_hold_s``. Any other cancellation
  (shutdown) leaves ``uncancel()`` above zero and propagates. No child task: one task per
  request.
- The job writes the upstream's response to the client itself, through the request's
  ``Responder`` (relay/responder.py), as it arrives: no hand-over to the handler per piece. What a
  slower client has not taken waits in its connection's buffer (``client_buffer_bytes``),
  so the job reads the upstream to its end, and releases the permit, without waiting for
  the client; only a fuller buffer holds the job back (backpressure), and a client that
  takes no byte for ``client_write_timeout_s`` is dropped: its handler then applies
  ``on_disconnect`` as for any client that left. Once the client is gone every write is a
  no-op, so a job that drains a generation never blocks on a dead reader. Errors go to the
  handler through ``Responder.fail``; the handler writes or answers them.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import structlog
from multidict import CIMultiDict

from llmproxy.proxy.errors import ProxyError, UpstreamFailed
from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.relay.assemble import Assembler
from llmproxy.proxy.relay.events import End, Failed, Head, Piece, Timing
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.relay.sse import Framer
from llmproxy.proxy.relay.writer import Relay
from llmproxy.proxy.request import Body, GatedRequest
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.dialects.base import Dialect
from llmproxy.proxy.upstream.forward import timing_to
from llmproxy.proxy.upstream.health import upstream_failed
from llmproxy.proxy.upstream.listener import Listener
from llmproxy.proxy.upstream.resume import MAX_EVENT, Echo, Transcript
from llmproxy.proxy.upstream.settle import settle
from llmproxy.proxy.upstream.stream import exchange_events

log = structlog.get_logger("llmproxy.job")


class Transfer:
    """One exchange of an ``UpstreamJob`` (its base: the job owns every attribute below)."""

    gate: Gate
    ticket: Ticket
    adapter: Adapter
    dialect: Dialect
    assembled: bool  # sent as a stream and answered whole (the dialect's ``assembles``)
    request: GatedRequest
    headers: CIMultiDict[str]
    out: Responder
    record: RequestRecord
    breaker: CircuitBreaker
    breaker_probe: bool
    slot: int
    generation: Listener | None
    sent: bool  # the job's own state: the record is written from it, for telemetry
    status: int | None
    error: ProxyError | None
    preempted: int
    _task: asyncio.Task[object] | None
    _stop_cancelled: bool
    _crashed: bool
    _stop_reason: str | None
    _finished: bool
    _success_reported: bool
    _cancel_on_head: bool
    _body: bytes
    _parsed: Body
    _transcript: Transcript | None
    _echo: Echo | None
    _assembler: Assembler | None

    def _release(self) -> None:
        raise NotImplementedError  # the job's

    def _preempted(self) -> None:
        raise NotImplementedError  # the job's

    def _read(self, event: Piece | End) -> Piece | End:
        """The events of a piece of the upstream's event stream, before they are relayed: a
        chat continuation's echo out, then type-through's record and a resumable stream's
        transcript fed (preemptible from its first event)."""
        events = event.events
        if self._echo is not None:
            events = self._echo.strip(events)
            event = replace(event, events=events)
        if self.generation is not None:
            self.generation.take(events)
        t = self._transcript
        if t is None:
            return event
        t.take(events)
        if not t.exact:
            self.ticket.on_preempt, self.ticket.may_offer = None, False
        elif t.pieces and self.ticket.may_offer and self.ticket.on_preempt is None:
            self.ticket.on_preempt = self._preempted
        return event

    def _sent(self) -> None:
        """The exchange hands the request's bytes to the upstream connection."""
        self.sent = True
        self.record.mark_sent()

    def _on_head(self, head: Head) -> None:
        """The upstream answered. A good status is a success for the breaker now (a probe
        must not keep the breaker half-open for its whole body). A stop that waited for the
        head (``_cancel_on_head``) cuts now, in the job's own task, before anything goes to
        the client (the transfer scope takes the CancelledError as its stop's)."""
        status = self.status = self.record.upstream_status = head.status
        if not upstream_failed(status):
            self.breaker.success(self.breaker_probe)
            self._success_reported = True
        if status != 200 and self.preempted and self.out.started:
            # a continuation's error cannot join the stream the client is reading
            raise UpstreamFailed(f"the preempted generation's continuation failed ({status})")
        if self._stop_reason is not None and not self._stop_cancelled:
            self._stop_cancelled = True
            raise asyncio.CancelledError

    def _upstream_ended(self) -> None:
        """The upstream's body was read to its end: nothing left to stop, permit back."""
        self._finished = True
        self.ticket.on_preempt, self.ticket.may_offer = None, False
        self._release()
        if self.generation is not None:
            answered = self.status == 200 and self.generation.events
            self.generation.end(None if answered else UpstreamFailed("no event stream"))

    async def _transfer_scope(self) -> None:
        """Run the transfer where ``stop()`` may cancel it (see the module's contract)."""
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        try:
            await self._transfer_body()
        except asyncio.CancelledError:
            if self._stop_cancelled and task.uncancel() == 0:
                return  # our own stop: the upstream connection is closed, go on to confirmation
            raise
        except Exception as exc:
            self._crashed = True  # confirmed like an upstream error: the request may still run
            log.error("upstream job crashed", error=repr(exc), request_id=self.record.request_id)
            self.out.fail(ProxyError("internal proxy error"))
        finally:
            self._task = None
        if self._stop_cancelled and task.cancelling() > 0:
            # the stop's CancelledError was turned into another exception inside the transfer:
            # drop its count so that it cannot cancel the confirmation that follows
            task.uncancel()

    def _needs_confirmation(self) -> bool:
        """A stop must be confirmed if the request was sent and did not end by itself."""
        if not self.sent:
            return False
        failed = self.error is not None or self._crashed
        return self._stop_reason is not None or (failed and not self._finished)

    async def _transfer_body(self) -> None:
        """One exchange with the upstream: its events read here (job state, type-through,
        the transcript) and then relayed to the client (relay/writer.py)."""
        rec, req = self.record, self.request
        await settle(self.gate, self.ticket, self.adapter)  # n_cmpl, embeddings: llamacpp's
        body = self.dialect.prepare_body(req.route, self._body, self._parsed, self.slot)
        assembled = self.assembled
        if assembled:
            rec.assembled = True
            self._assembler = self._assembler or Assembler(req.route)  # one over segments
        resumable = self._transcript is not None
        framer = None
        if assembled or resumable or self.generation is not None:
            framer = Framer(MAX_EVENT if resumable and not assembled else None)
        relay = Relay(
            self.out, assembler=self._assembler if assembled else None, whole_events=resumable
        )
        timing = Timing()
        events = exchange_events(
            self.adapter,
            req.method,
            req.raw_path,
            self.headers,
            body,
            on_send=self._sent,
            framer=framer,
            timing=timing,
        )
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Failed):
                        raise event.error
                    if isinstance(event, Head):
                        self._on_head(event)  # may cut the exchange here
                    else:
                        if event.events:
                            event = self._read(event)
                        if isinstance(event, End):
                            timing_to(rec, timing)
                            self._upstream_ended()  # permit back before the last write
                    await relay.write(event)
        except ProxyError as exc:
            self.error = rec.upstream_error = exc
            log.warning("upstream request failed", error=exc.message, request_id=rec.request_id)
            self.out.fail(exc)
        finally:
            timing_to(rec, timing)
