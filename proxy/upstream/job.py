"""Upstream jobs: the task that owns a permit, talks to the upstream, and releases it.

Concurrency contract:
- A job is spawned in the app's ``JobRegistry`` (tracked; never a bare fire-and-forget
  task) as soon as its handler has a permit, and is independent of that handler: client
  disconnects cancel the handler, never the job.
- The job's upstream transfer runs in a cancel scope where ``stop(reason)`` may cut it,
  and then waits for the stop's confirmation (transfer.py).
- The permit is released once the upstream is idle for this request: as soon as its body
  was read to its end (``_upstream_ended``, before the last bytes go to the client, so a
  slow reader never holds it after that), else in the job's ``finally`` once the stop was
  confirmed. A confirmation that timed out quarantines the request's slots instead
  (gate.py): the request is over (logged, counted), and the job, still tracked by the
  registry, watches them (``Adapter.watch_idle``) and gives each back once it shows idle,
  or stops watching when the gate closes. Only app shutdown cancels the job itself
  (``JobRegistry.drain``), and then the permit is released as the job unwinds.
- The job writes the upstream's response to the client itself, as it arrives, through
  the request's ``Responder`` (transfer.py; relay/responder.py).
- Type-through (``generations``, a ``Recorder``: listener.py): the job records its event
  stream in a ``Listener`` that later keystrokes of its session may be answered from
  (proxy/reuse/, which the upstream side never imports). While such readers remain, its
  own client leaving stops nothing; the disconnect policy applies once the last reader
  left (after the generation's grace). A stop ends the generation for every reader.
- Preemption (``resume``, given for a request that may be preempted; resume.py): once a
  resumable stream's first event came, its ticket offers ``on_preempt``; the scheduler's
  call stops it as any stop (cut, confirmed); the job then gives its permits back, waits
  in ``resume()`` (the scheduler's ``Pool.again``: its queue again) for new ones, and
  sends the continuation, written to the same client as one answer. Nothing is written
  for the cut segment, and a failed resume ends the client's answer with its error. A
  stop while it waits there (its client left) cancels that wait, which gives its place
  in the queue up.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog
from multidict import CIMultiDict

from llmproxy.proxy.errors import (
    SUPERSEDED,
    ProxyError,
    ShuttingDown,
    Superseded,
    UpstreamFailed,
)
from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.relay.assemble import Assembler
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.request import Body, GatedRequest
from llmproxy.proxy.telemetry.metrics import Metrics
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.confirm import confirm_stop
from llmproxy.proxy.upstream.health import report_health, stopped_error
from llmproxy.proxy.upstream.listener import Listener, Recorder
from llmproxy.proxy.upstream.resume import (
    Echo,
    Transcript,
    continuation,
    resumable,
)
from llmproxy.proxy.upstream.transfer import Transfer

log = structlog.get_logger("llmproxy.job")


class Grant(Protocol):
    """Permits granted anew to a preempted request by the scheduler (pool/entry.py
    ``Placement``): where its continuation runs."""

    @property
    def gate(self) -> Gate: ...
    @property
    def ticket(self) -> Ticket: ...
    @property
    def adapter(self) -> Adapter: ...
    @property
    def breaker(self) -> CircuitBreaker: ...
    @property
    def probe(self) -> bool: ...
    @property
    def upstream(self) -> str: ...  # its name, for the record


#: the scheduler's wait for a preempted request's new permits (``Pool.again``; ProxyError:
#: none; see the module's contract), given the ticket it was stopped on (what it waited)
Resume = Callable[[Ticket], Awaitable[Grant]]


class UpstreamJob(Transfer):
    def __init__(
        self,
        *,
        gate: Gate,
        ticket: Ticket,
        adapter: Adapter,
        request: GatedRequest,
        headers: CIMultiDict[str],
        out: Responder,
        record: RequestRecord,
        metrics: Metrics,
        breaker: CircuitBreaker,
        breaker_probe: bool,
        supersede_policy: str,
        disconnect_policy: str,
        unconfirmed_hold_s: float,
        generations: Recorder | None = None,
        resume: Resume | None = None,
    ) -> None:
        self.gate, self.ticket, self.adapter = gate, ticket, adapter
        # the dialect of its grant, kept for the exchange (probing makes a new one, never
        # changes this): how its body is written, and whether it is sent as a stream
        self.dialect = adapter.dialect
        self.assembled = self.dialect.assembles(request.route, request.body)
        self.request, self.headers, self.out = request, headers, out
        self.record, self.metrics = record, metrics
        self.breaker, self.breaker_probe = breaker, breaker_probe
        self.supersede_policy, self.disconnect_policy = supersede_policy, disconnect_policy
        self.unconfirmed_hold_s = unconfirmed_hold_s
        self.generation: Listener | None = None
        self._left_generation = False
        self.slot = gate.take(ticket, on_supersede=self._superseded)  # or Superseded
        if generations is not None:
            # type-through: the record later keystrokes of the session may be answered from
            self.generation = generations.start(
                request.session,
                request.route,
                request.body,
                streamed=self.assembled,
                on_orphaned=self._orphaned,
                on_superseded=self._continued,
                on_joined=self._joined,
            )
        # the job's own state (the record is written from it, for telemetry)
        self.sent = False  # its bytes were handed to the upstream connection: it may run
        self.status: int | None = None  # the upstream's answer's status, once its head came
        self.error: ProxyError | None = None  # the exchange failed
        self.preempted = 0  # times stopped for a completion and resumed
        self._task: asyncio.Task[object] | None = None  # set while in the transfer scope
        self._stop_cancelled = False  # stop() cancelled the task in the transfer scope
        self._crashed = False  # our own code failed during the transfer
        self._stop_reason: str | None = None
        self._finished = False  # upstream body read to its end
        self._success_reported = False  # the breaker heard of this request's answer at its head
        self._quarantine = False  # the stop was not confirmed in time: the slots may still be busy
        self._released = False  # the permit went back (``_release``)
        # A stop after the request was sent waits for the upstream's head before it closes
        # the connection, where the stop is confirmed and the dialect says the head comes once
        # the request runs (Dialect.answers_at_start): a stop confirmed before that could
        # miss a task that was still on its way to the slot.
        self._cancel_on_head = self._waits_for_head(request.body)
        self._body, self._parsed = request.raw, request.body  # a continuation's later
        self.resume: Resume | None = None
        self._transcript: Transcript | None = None
        self._echo: Echo | None = None  # a chat continuation's repeated prefill, to take out
        self._resuming: asyncio.Task[object] | None = None  # the job's task, in ``resume()``
        self._assembler: Assembler | None = None
        if resume is not None and self.generation is None:
            if resumable(self.dialect.kind, request.route, request.body):
                self.resume, self._transcript = resume, Transcript(request.route)
                ticket.may_offer = True

    # -- control (called from the handler / the gate) ------------------------------
    def _superseded(self) -> None:
        self.record.superseded_inflight = True
        if self.supersede_policy == "cancel" or not self.sent:
            self.stop("superseded")

    def client_gone(self) -> None:
        self.out.detach()
        if self.generation is not None and not self.generation.done and not self.out.stalled:
            # a typist's next keystroke may continue it: the policy applies once the last
            # reader left and the grace passed (_orphaned); a client dropped for taking
            # nothing is no typist
            self._leave_generation()
            return
        self._orphaned()

    def _continued(self) -> None:
        """A later keystroke of the session continues this generation (type-through): it
        supersedes this request, whose client gets 499 (or the stream's error event), while
        the generation runs on for the keystroke, on this job's permit."""
        if self.out.ended:
            return
        self.record.outcome = "superseded"
        self.out.fail(Superseded(SUPERSEDED))
        self._leave_generation()

    def _joined(self, key: str | None) -> None:
        """A keystroke with twin key ``key`` now reads this generation: its twins (which go
        through the gate for samples of their own) must not supersede it, a newer keystroke
        still does. The ticket takes the reader's key."""
        self.ticket.twin = key

    def _leave_generation(self) -> None:
        """This request's client reads the generation no more (once)."""
        if self.generation is not None and not self._left_generation:
            self._left_generation = True
            self.generation.leave()

    def _orphaned(self) -> None:
        """No client reads this generation any more: the disconnect policy applies."""
        if self.disconnect_policy == "cancel" or not self.sent:
            self.stop("client_disconnect")

    def _preempted(self) -> None:
        self.ticket.on_preempt = None
        self.stop("preempted")

    def stop(self, reason: str) -> None:
        if self._resuming is not None:  # preempted, waiting for permits: it goes no further
            self._resuming.cancel()
            self._resuming = None
            return
        if self._stop_reason is not None or self._finished:
            return
        self._stop_reason = reason
        self.ticket.may_offer = False
        self.gate.mark_stopping(self.ticket)
        if self.generation is not None:
            self.generation.end(stopped_error(reason))
        if self._task is not None and not self._stop_cancelled:
            if self._cancel_on_head and self.sent and self.status is None:
                return  # sent, not answered yet: cut when the head arrives (_on_head)
            self._stop_cancelled = True
            self._task.cancel()

    # -- the job ----------------------------------------------------------------------
    async def run(self) -> None:
        """Own the permit until the upstream is idle for this request, then release it."""
        rec = self.record
        try:
            while True:
                if self._stop_reason is None:  # stopped before its first step: never sent
                    await self._transfer_scope()
                if self._stop_reason == "superseded":
                    rec.outcome = "superseded"
                    self.out.fail(Superseded(SUPERSEDED))
                if self._needs_confirmation():
                    self._quarantine = not await confirm_stop(
                        self.adapter,
                        self.request.route,
                        self.ticket.slots,
                        rec,
                        self.metrics,
                        stopped=self._stop_reason is not None,
                        hold_s=self.unconfirmed_hold_s,
                    )
                if self._stop_reason != "preempted" or not await self._resume():
                    break
        finally:
            task = asyncio.current_task()
            ended = self._finished or self._crashed or self.error is not None
            if task is not None and task.cancelling() and not ended:  # cut at the shutdown deadline
                rec.outcome = rec.outcome or "cancelled_inflight"
                self.out.fail(ShuttingDown("llmproxy shut down before the upstream finished"))
            report_health(self.breaker, self.breaker_probe, rec, self._success_reported)
            if not self.out.ended:
                self.out.fail(ProxyError("upstream job ended without a response"))
            # dropped mid-way (the handler applied on_disconnect) or after the end
            if self.out.stalled:
                rec.client_gone = True
                rec.error = rec.error or "client took nothing of its response in time: dropped"
            self._release()
            if self.generation is not None:  # ended here unless it ended above
                self.generation.end(self.error or ProxyError("upstream job ended"))
            if self.preempted and self._transcript is not None:
                rec.resume_prompt_n = self._transcript.last_prompt_n
            if rec.piece_gap_s is not None:
                self.adapter.note_piece_gap(rec.piece_gap_s)
            rec.end_ref()
        if self._quarantine:
            slots = self.ticket.slots
            log.warning(
                "slots quarantined until /slots shows them idle",
                slots=list(slots),
                request_id=rec.request_id,
            )
            await self.adapter.watch_idle(
                slots,
                self.gate.unquarantine,
                self.gate.closing,
                answered=self.status is not None,
            )

    async def _resume(self) -> bool:
        """A preempted request, its stop confirmed: permits back, new ones, continuation
        ready (False: it cannot go on; the client's answer ends here)."""
        rec, t = self.record, self._transcript
        assert self.resume is not None and t is not None
        report_health(self.breaker, self.breaker_probe, rec, self._success_reported)
        self._success_reported = True  # told: the job's last report must not count it again
        if self._quarantine or self.out.ended:
            if not self.out.ended:
                self.out.fail(UpstreamFailed("a preempted generation could not be resumed"))
            return False
        self._release()
        # llama-server's chat continuation repeats its prefill first
        self._echo = Echo(t.text) if t.chat else None
        self.preempted += 1
        rec.preempted = self.preempted
        task = asyncio.current_task()
        assert task is not None
        self._resuming = task  # stop() (the client left) cancels the wait
        try:
            grant = await self.resume(self.ticket)
        except ProxyError as exc:
            self.error = rec.upstream_error = exc
            self.out.fail(exc)
            return False
        except asyncio.CancelledError:
            if self._resuming is None and task.uncancel() == 0:
                return False  # stop()'s: its place in the queue was given up
            raise
        finally:
            self._resuming = None
        self.gate, self.ticket, self.adapter = grant.gate, grant.ticket, grant.adapter
        # its continuation offers to be stopped again where this upstream resumes it exactly
        self.ticket.may_offer = resumable(
            self.adapter.dialect.kind, self.request.route, self.request.body
        )
        self.breaker, self.breaker_probe = grant.breaker, grant.probe
        rec.upstream_name, rec.permits = grant.upstream, grant.ticket.permits
        try:
            self.slot = self.gate.take(self.ticket, on_supersede=self._superseded)
        except ProxyError as exc:  # superseded since the grant
            self.breaker.neutral(self.breaker_probe)
            self.out.fail(exc)
            return False
        if self.out.ended:  # the client left while it waited
            self.breaker.neutral(self.breaker_probe)
            self.gate.release(self.ticket)
            return False
        # from the request as sent: the transcript holds every segment's text and tokens
        parsed = continuation(self.request.route, self.request.body, t)
        self._parsed, self._body = parsed, json.dumps(parsed).encode()
        self.dialect = self.adapter.dialect  # the new grant's
        self.assembled = self.dialect.assembles(self.request.route, parsed)
        self._cancel_on_head = self._waits_for_head(parsed)
        self._stop_reason, self._stop_cancelled, self._finished = None, False, False
        self._success_reported = self._released = self._quarantine = False
        self.sent, self.status = False, None
        # the record's ``upstream_sent`` stays: its first segment reached the upstream
        rec.upstream_status, rec.slot = None, self.slot
        return True

    def _waits_for_head(self, body: Body) -> bool:
        """Does a stop after the request was sent wait for the upstream's head (above)?"""
        route = self.request.route
        return self.adapter.confirms(route) and self.dialect.answers_at_start(route, body)

    def _release(self) -> None:
        """Give the permit back (once; the upstream is idle for this request, or its slots
        are quarantined: ``_quarantine``)."""
        if not self._released:  # the job's own: a record may outlive a job (failover)
            self._released = True
            self.record.permit_hold_s = time.monotonic() - (
                self.ticket.granted_at or time.monotonic()
            )
            kept = self.ticket.slots if self._quarantine else ()
            self.gate.release(self.ticket, quarantine=kept)
