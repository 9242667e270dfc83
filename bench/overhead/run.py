"""``llmproxy bench overhead``: the proxy's added latency and throughput cost, side by side.

Starts the fake upstream (``python -m llmproxy.bench.fake.upstream``) and the proxy
(``python -m llmproxy.proxy serve --upstream URL``) as child processes, so neither shares
the load generator's event loop, then runs the same closed-loop load (see loadgen.py)
directly against the fake and through the proxy, for non-streaming and streaming requests
at each concurrency. Prints one table row per case with p50/p99 latency, the latency the
proxy adds, throughput, the CPU time per request of the proxy and of the fake (from
/proc, over the measured phase) and the goals: added p50 <= 1 ms, added p99 <= 3 ms,
proxied throughput >= 50% of direct.

The same load also goes through a featureless aiohttp forwarder (``forwarder.py``; off with
``--no-floor``): the "floor" columns show what one extra hop through the proxy's own HTTP
stack (an aiohttp server and proxy/upstream/client.py) costs on this machine before any of
the proxy's work, so a goal the floor itself misses is visible as such. The "raw" columns
(off with ``--no-raw``) run it through a TCP byte relay (``splice.py``): the loopback hop
with no HTTP stack at all, the least any Python proxy on this loop could add. Closed-loop
workers start staggered (see loadgen.py), and each target is measured in ``--rounds``
blocks taken in turn, so machine drift hits all alike.

Upstream profiles (``--token-delay-ms``, one set of children per value):

* paced (default 5 ms per token, 16 tokens: an 80 ms generation, faster than any local
  completion model): the load the proxy exists for. The goals are judged on these rows.
* instant (0 ms): the fake answers as fast as Python can. This is a CPU stress that shows
  the proxy's cost per request; its goal marks are printed but not judged, because with
  a zero-work upstream they measure the machine, not the proxy: at c=1 "throughput >= 50%"
  would need the proxy to add less time than the whole direct round trip, and at c=32
  three Python processes share the machine's cores, so the added p50 is about 32 x the
  proxy's CPU per request divided by the cores it gets.

Concurrency contract: children are owned by ``child.child`` (an async context manager) which
terminates them (then kills after 10 s) on exit, including on error or Ctrl-C. Each worker
of the load generator sends its own ``X-LLMProxy-Session`` so that the proxy's supersede
rule never cancels one worker's request on behalf of another. ``--page`` keeps the live
page's event stream (``/llmproxy/events``) open on the proxy throughout, read by a task the
profile's exit stack owns and cancels: what an open ``/llmproxy/`` costs the proxy.
Progress (the step running and the time left) goes to stderr (bench/progress.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.bench.child import child, cpu_seconds
from llmproxy.bench.loadgen import LoadResult, run_load
from llmproxy.bench.overhead.cpu import format_split
from llmproxy.bench.overhead.table import Case, format_table
from llmproxy.bench.progress import Steps
from llmproxy.common import loops
from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


class OverheadSettings(LayeredSettings):
    """Options of ``llmproxy bench overhead`` (env ``LLMPROXY_BENCH_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_BENCH_", frozen=True, extra="forbid")

    requests: int = Field(2000, ge=1, description="Measured requests per case and target")
    warmup: int = Field(200, ge=0, description="Unmeasured warm-up requests per case and target")
    concurrency: list[int] = Field([1, 32], description="Concurrency levels (closed-loop workers)")
    duration: float = Field(
        60.0, gt=0, description="Time cap in seconds per phase (warm-up, measured) and target"
    )
    rounds: int = Field(
        3,
        ge=1,
        description="Measured blocks per target, run in turn "
        "(direct, raw, floor, proxied, direct, ...)",
    )
    modes: list[str] = Field(
        ["nonstream", "stream"], description="Request modes: nonstream, stream"
    )
    route: str = Field("/completion", description="Upstream route to load (llama-server shape)")
    tokens: int = Field(16, ge=0, description="Tokens the fake upstream generates per request")
    token_delay_ms: list[float] = Field(
        [5.0, 0.0],
        description="Fake upstream delay per token, one profile per value (0: instant, not judged)",
    )
    slots: int = Field(64, ge=1, description="Fake upstream slots (and proxy capacity)")
    max_queue: int = Field(1000, ge=0, description="Proxy --max-queue")
    proxy: bool = Field(
        True, description="Also measure through the proxy (--no-proxy: direct only)"
    )
    floor: bool = Field(
        True,
        description="Also measure a featureless aiohttp forwarder (forwarder.py): "
        "the stack's own cost",
    )
    raw: bool = Field(
        True, description="Also measure a TCP byte relay (splice.py): the loopback hop without HTTP"
    )
    startup_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for a child to write its port file"
    )
    log_level: str = Field("warning", description="Log level of this process and the fake upstream")
    loop: loops.LoopChoice = Field(
        "auto", description="Event loop of the proxy and the two reference children (their --loop)"
    )
    page: bool = Field(
        False,
        description="Keep the live page's event stream (/llmproxy/events) open on the proxy "
        "while measuring",
    )
    proxy_log_level: str = Field(
        "info",
        description="The proxy child's log level; info, its own default, "
        "measures its canonical line per request",
    )
    cprofile: Path | None = Field(
        None,
        description="Run the proxy under cProfile, write its statistics to this file and "
        "print where its CPU per request goes (cpu.py; one --token-delay-ms value)",
    )


def _body(settings: OverheadSettings, stream: bool) -> bytes:
    obj = {
        "prompt": "def fib(n):",
        "n_predict": settings.tokens,
        "stream": stream,
        "cache_prompt": True,
    }
    return json.dumps(obj, separators=(",", ":")).encode()


async def _load(
    url: str, settings: OverheadSettings, stream: bool, concurrency: int, pids: tuple[int, ...]
) -> LoadResult:
    return await run_load(
        url + settings.route,
        _body(settings, stream),
        requests=settings.requests,
        warmup=settings.warmup,
        concurrency=concurrency,
        duration_s=settings.duration,
        stream=stream,
        headers=lambda w: {"X-LLMProxy-Session": f"bench-{w}"},
        probe=lambda: tuple(cpu_seconds(pid) for pid in pids),
    )


_TARGETS = ("direct", "raw", "floor", "proxied")


async def _in_turn(
    targets: list[tuple[str | None, tuple[int, ...]]],
    settings: OverheadSettings,
    stream: bool,
    concurrency: int,
    steps: Steps,
    case: str,
) -> list[LoadResult | None]:
    """Measure the targets (None: skipped) in ``settings.rounds`` alternating blocks each.

    The machine drifts (other load, timer and cache state) on a scale of seconds; blocks
    taken in turn spread that drift over every target instead of charging it to whichever
    ran last. Each block has its own warm-up (a share of ``warmup``) and time cap (a share
    of ``duration``); the blocks of a target are pooled.
    """
    rounds = min(settings.rounds, settings.requests)
    parts: list[list[LoadResult]] = [[] for _ in targets]
    for r in range(rounds):
        share = settings.model_copy(
            update={  # this block's share; the shares add up to the totals
                "requests": settings.requests // rounds + (r < settings.requests % rounds),
                "warmup": settings.warmup // rounds + (r < settings.warmup % rounds),
                "duration": settings.duration / rounds,
            }
        )
        for i, (url, pids) in enumerate(targets):
            if url is not None:
                steps.step(f"{case} round {r + 1}/{rounds} {_TARGETS[i]}")
                parts[i].append(await _load(url, share, stream, concurrency, pids))
    return [LoadResult.merged(p) if p else None for p in parts]


def proxy_command(settings: OverheadSettings, upstream_url: str) -> list[str]:
    """The proxy child's command line (``--port-file`` is appended by ``child``); under
    cProfile with ``--cprofile``."""
    out = settings.cprofile
    profiler = ["-m", "cProfile", "-o", str(out.resolve())] if out is not None else []
    return [
        sys.executable,
        *profiler,
        "-m",
        "llmproxy.proxy",
        "serve",
        "--port",
        "0",
        "--upstream",
        upstream_url,
        "--capacity",
        str(settings.slots),
        "--max-queue",
        str(settings.max_queue),
        "--log-level",
        settings.proxy_log_level,
        "--loop",
        settings.loop,
    ]


@contextlib.asynccontextmanager
async def _page_open(url: str) -> AsyncIterator[None]:
    """A page watching ``url`` meanwhile: its event stream, open once its first picture came,
    read (and dropped) by a task that this context cancels and awaits on exit."""

    async def drain(resp: aiohttp.ClientResponse) -> None:
        async for _chunk in resp.content.iter_any():
            pass

    async with aiohttp.ClientSession() as http, http.get(url + "/llmproxy/events") as resp:
        resp.raise_for_status()
        await resp.content.readuntil(b"\n\n")
        task = asyncio.create_task(drain(resp))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _steps_total(settings: OverheadSettings) -> int:
    targets = 1 + settings.proxy * (1 + settings.floor + settings.raw)
    per_case = min(settings.rounds, settings.requests) * targets
    cases = len(settings.token_delay_ms) * len(settings.modes) * len(settings.concurrency)
    return cases * per_case


async def _profile(
    settings: OverheadSettings, delay_ms: float, workdir: Path, steps: Steps
) -> list[Case]:
    """All modes x concurrencies against one fake (and one proxy) paced at ``delay_ms``."""
    fake_argv = [
        sys.executable,
        "-m",
        "llmproxy.bench.fake.upstream",
        "--port",
        "0",
        "--kind",
        "llamacpp",
        "--slots",
        str(settings.slots),
        "--tokens",
        str(settings.tokens),
        "--token-delay-ms",
        str(delay_ms),
        "--log-level",
        settings.log_level,
    ]
    cases: list[Case] = []
    async with contextlib.AsyncExitStack() as stack:

        async def start(name: str, argv: list[str], wanted: bool) -> tuple[str | None, int]:
            """(URL, pid) of a child that runs for this profile; (None, 0) when not measured."""
            if not wanted:
                return None, 0
            pid, url = await stack.enter_async_context(
                child(name, argv, workdir, settings.startup_timeout_s)
            )
            return url, pid

        fake_url, fake_pid = await start("fake_upstream", fake_argv, True)
        assert fake_url is not None
        proxy_url, proxy_pid = await start(
            "proxy", proxy_command(settings, fake_url), settings.proxy
        )
        if settings.page and proxy_url is not None:
            await stack.enter_async_context(_page_open(proxy_url))

        def reference(module: str) -> list[str]:
            """The command line of a reference relay (forwarder.py, splice.py: same options)."""
            return [
                sys.executable,
                "-m",
                f"llmproxy.bench.overhead.{module}",
                "--upstream",
                fake_url,
                "--loop",
                settings.loop,
            ]

        floor_url, floor_pid = await start(
            "forwarder", reference("forwarder"), settings.proxy and settings.floor
        )
        raw_url, raw_pid = await start(
            "splice", reference("splice"), settings.proxy and settings.raw
        )
        for mode in settings.modes:
            stream = mode == "stream"
            for c in settings.concurrency:
                targets = [
                    (fake_url, (fake_pid,)),
                    (raw_url, (fake_pid, raw_pid)),
                    (floor_url, (fake_pid, floor_pid)),
                    (proxy_url, (fake_pid, proxy_pid)),
                ]
                case = f"{delay_ms:g} ms/token {mode} c={c}"
                direct, raw, floor, proxied = await _in_turn(
                    targets, settings, stream, c, steps, case
                )
                assert direct is not None
                cases.append(Case(mode, c, direct, proxied, delay_ms, floor, raw))
    return cases


async def _bench(settings: OverheadSettings) -> list[Case]:
    cases: list[Case] = []
    with (
        tempfile.TemporaryDirectory(prefix="llmproxy-bench-") as tmp,
        Steps(_steps_total(settings), "bench overhead") as steps,
    ):
        for i, delay_ms in enumerate(settings.token_delay_ms):
            workdir = Path(tmp) / f"profile-{i}"  # fresh port files for each pair of children
            workdir.mkdir()
            cases += await _profile(settings, delay_ms, workdir, steps)
    return cases


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(OverheadSettings, args)
    configure_logging(settings.log_level)
    unknown = set(settings.modes) - {"nonstream", "stream"}
    if unknown:
        raise SystemExit(f"llmproxy bench overhead: unknown mode(s): {', '.join(sorted(unknown))}")
    if settings.cprofile is not None and (len(settings.token_delay_ms) != 1 or not settings.proxy):
        raise SystemExit(
            "llmproxy bench overhead: --cprofile profiles one proxy: give one --token-delay-ms"
        )
    # as the children will choose (same environment)
    loop_name = loops.choose(settings.loop, "llmproxy bench overhead")[0]
    gc.freeze()  # the load generator too: no full-collection pauses inside the measurements
    cases = asyncio.run(_bench(settings))
    sys.stdout.write(format_table(cases, loop=loop_name))
    if settings.cprofile is not None:
        sys.stdout.write("\n" + format_split(settings.cprofile.resolve()))
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "overhead",
        help="Latency and throughput the proxy adds over a fake upstream (direct vs proxied)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, OverheadSettings)
    parser.set_defaults(func=run)
