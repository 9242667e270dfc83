"""JobRegistry (registry.py): what a graceful stop waits for, and what it cuts (no sockets)."""

from __future__ import annotations

import asyncio

import structlog

from llmproxy.proxy.gating.registry import JobRegistry


async def test_drain_waits_for_handlers_and_for_jobs_spawned_meanwhile() -> None:
    reg = JobRegistry()
    release = asyncio.Event()
    handler_done = asyncio.Event()
    job_ran = asyncio.Event()

    async def job() -> None:
        job_ran.set()

    async def handler() -> None:  # e.g. a response still being written to a slow reader
        reg.track_current()
        await release.wait()
        reg.spawn(job())  # spawned after drain took its first look
        handler_done.set()

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)  # the handler registers itself
    assert len(reg) == 0  # handlers are not counted as jobs
    drain = asyncio.create_task(reg.drain(30))
    await asyncio.sleep(0)
    assert not drain.done()
    release.set()
    await asyncio.wait_for(drain, 5)
    assert handler_done.is_set() and job_ran.is_set() and not task.cancelled()


async def test_drain_cuts_what_is_left_at_the_deadline() -> None:
    reg = JobRegistry()
    started = asyncio.Event()

    async def stuck_handler() -> None:
        reg.track_current()
        started.set()
        await asyncio.Event().wait()

    async def stuck_job() -> None:
        await asyncio.Event().wait()

    handler = asyncio.create_task(stuck_handler())
    job = reg.spawn(stuck_job())
    await started.wait()
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(reg.drain(0.05, grace=0.05), 5)
    assert handler.cancelled() and job.cancelled() and len(reg) == 0
    assert [(e["jobs"], e["handlers"]) for e in logs if "shutdown deadline" in e["event"]] == [
        (1, 1)
    ]


async def test_handlers_relay_their_cut_jobs_end_before_being_cut() -> None:
    """At the deadline the jobs go first; a handler that only waited for its job's last
    event (the shutting-down error it relays) then ends by itself, uncancelled."""
    reg = JobRegistry()
    relayed: list[str] = []

    async def stuck_job(final: asyncio.Future[str]) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            final.set_result("shutting_down")  # what UpstreamJob hands its Responder when cut

    async def handler() -> None:
        reg.track_current()
        final: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        reg.spawn(stuck_job(final))
        relayed.append(await final)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    await asyncio.wait_for(reg.drain(0.05, grace=5), 5)
    assert relayed == ["shutting_down"] and not task.cancelled()
