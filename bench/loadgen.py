"""Closed-loop HTTP load generator for benchmarks (aiohttp client).

``run_load`` starts ``concurrency`` workers sharing one ClientSession (keep-alive pool of
``concurrency`` connections). Each worker sends one request, reads the whole response
(streamed responses chunk by chunk, as an editor does) and sends the next, until the
shared request budget is spent or the time cap passes. A warm-up phase of the same shape
runs first and is not measured.

Arrivals are staggered: in the measured phase worker ``w`` sends its first request
``w / concurrency`` of a warm-up median latency after the phase starts. Started together,
closed-loop workers against a fixed-time upstream stay in lockstep for the whole run (all
``concurrency`` requests arrive and complete in the same millisecond, every round): a
harness artefact, not the traffic of independent editors, and it turns every tail
percentile into "the time to drain a burst of ``concurrency``". ``stagger=False`` keeps the
lockstep start (a burst stress).

Concurrency contract: everything runs in the caller's event loop inside one TaskGroup;
``run_load`` returns only after every worker has finished (or the group was cancelled by
the caller, which closes the session). Latency is wall time from sending a request to the
last byte of its response, measured with ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class LoadResult:
    """Outcome of the measured phase of one load run."""

    latencies_s: list[float]  # successful requests only, sorted
    errors: int
    elapsed_s: float
    capped: bool  # the duration cap ended the run before the request budget was spent
    cpu_s: tuple[float, ...] = ()  # the ``probe`` readings' change over the measured phase

    def cpu_us_per_request(self, index: int) -> float:
        """CPU microseconds per successful request of probed process ``index``; NaN if not
        probed."""
        if index >= len(self.cpu_s) or not self.ok:
            return math.nan
        return self.cpu_s[index] * 1e6 / self.ok

    @classmethod
    def merged(cls, parts: list[LoadResult]) -> LoadResult:
        """One result from several measured blocks of the same load (latencies pooled)."""
        cpu = tuple(map(sum, zip(*(p.cpu_s for p in parts), strict=True)))
        return cls(
            sorted(t for p in parts for t in p.latencies_s),
            sum(p.errors for p in parts),
            sum(p.elapsed_s for p in parts),
            any(p.capped for p in parts),
            cpu,
        )

    @property
    def ok(self) -> int:
        return len(self.latencies_s)

    @property
    def rps(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile (``q`` in 0..100) in milliseconds; NaN with no samples."""
        if not self.latencies_s:
            return math.nan
        rank = max(1, math.ceil(q / 100 * len(self.latencies_s)))
        return self.latencies_s[rank - 1] * 1000


@dataclass
class _Phase:
    budget: int
    deadline: float
    counter: itertools.count[int]
    latencies: list[float]
    errors: int = 0


async def _worker(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    phase: _Phase,
    start_delay_s: float,
) -> None:
    if start_delay_s > 0:
        await asyncio.sleep(start_delay_s)  # pacing of the load, not synchronisation
    while next(phase.counter) < phase.budget and time.perf_counter() < phase.deadline:
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if stream:
                    async for _chunk in resp.content.iter_any():
                        pass
                else:
                    await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            phase.latencies.append(time.perf_counter() - t0)
        else:
            phase.errors += 1


async def _run_phase(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    requests: int,
    concurrency: int,
    duration_s: float,
    stream: bool,
    headers: Callable[[int], dict[str, str]],
    spread_s: float = 0.0,
) -> tuple[_Phase, float]:
    start = time.perf_counter()
    phase = _Phase(requests, start + duration_s, itertools.count(), [])
    async with asyncio.TaskGroup() as tg:
        for w in range(concurrency):
            tg.create_task(
                _worker(session, url, body, headers(w), stream, phase, spread_s * w / concurrency)
            )
    return phase, time.perf_counter() - start


async def run_load(
    url: str,
    body: bytes,
    *,
    requests: int,
    warmup: int,
    concurrency: int,
    duration_s: float,
    stream: bool,
    headers: Callable[[int], dict[str, str]] = lambda _w: {},
    probe: Callable[[], tuple[float, ...]] | None = None,
    stagger: bool = True,
) -> LoadResult:
    """Send ``warmup`` then ``requests`` POSTs of ``body`` to ``url`` with ``concurrency`` workers.

    ``headers(worker_index)`` gives each worker its own headers (e.g. a session id).
    ``duration_s`` caps each phase. ``probe()`` (e.g. CPU seconds of the server processes)
    is read right before and after the measured phase; the result carries the difference.
    ``stagger`` spreads the measured phase's first requests over the warm-up's median
    latency (see the module docstring); it needs ``warmup > 0``.
    """
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
    base = {"Content-Type": "application/json"}

    def all_headers(w: int) -> dict[str, str]:
        return {**base, **headers(w)}

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        spread_s = 0.0
        if warmup:
            warm, _ = await _run_phase(
                session,
                url,
                body,
                requests=warmup,
                concurrency=concurrency,
                duration_s=duration_s,
                stream=stream,
                headers=all_headers,
            )
            if stagger and warm.latencies:
                spread_s = statistics.median(warm.latencies)
        before = probe() if probe is not None else ()
        phase, elapsed = await _run_phase(
            session,
            url,
            body,
            requests=requests,
            concurrency=concurrency,
            duration_s=duration_s,
            stream=stream,
            headers=all_headers,
            spread_s=spread_s,
        )
        after = probe() if probe is not None else ()
    done = len(phase.latencies) + phase.errors
    cpu = tuple(b - a for a, b in zip(before, after, strict=True))
    return LoadResult(
        sorted(phase.latencies), phase.errors, elapsed, capped=done < requests, cpu_s=cpu
    )
