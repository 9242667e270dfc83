"""``llmproxy bench overhead``: the proxy's added latency and throughput cost, side by side.

Starts the fake upstream (``python -m llmproxy.proxy.bench.fake_upstream``) and the proxy
(``python -m llmproxy.proxy serve --upstream URL``) as child processes, so neither shares
the load generator's event loop, then runs the same closed-loop load (see loadgen.py)
directly against the fake and through the proxy, for non-streaming and streaming requests
at each concurrency. Prints one table row per case with p50/p99 latency, the latency the
proxy adds, throughput, the CPU time per request of the proxy and of the fake (from
/proc, over the measured phase) and the goals: added p50 <= 1 ms, added p99 <= 3 ms,
proxied throughput >= 50% of direct.

The same load also goes through a featureless aiohttp forwarder (``forwarder.py``; off with
``--no-floor``): the "floor" columns show what one extra hop through an aiohttp server and
client costs on this machine before any of the proxy's work, so a goal the floor itself
misses is visible as such. Closed-loop workers start staggered (see loadgen.py).

Upstream profiles (``--token-delay-ms``, one pair of children per value):

* paced (default 5 ms per token, 16 tokens: an 80 ms generation, faster than any local
  completion model): the load the proxy exists for. The goals are judged on these rows.
* instant (0 ms): the fake answers as fast as Python can. This is a CPU stress that shows
  the proxy's cost per request; its goal marks are printed but not judged, because with
  a zero-work upstream they measure the machine, not the proxy: at c=1 "throughput >= 50%"
  would need the proxy to add less time than the whole direct round trip (~0.5 ms), and at
  c=32 three Python processes share 2 cores, so the added p50 is about 32 x the proxy's
  CPU per request divided by the cores it gets.

Concurrency contract: children are owned by ``child.child`` (an async context manager) which
terminates them (then kills after 10 s) on exit, including on error or Ctrl-C. Each worker
of the load generator sends its own ``X-LLMProxy-Session`` so that the proxy's supersede
rule never cancels one worker's request on behalf of another.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.proxy.bench.child import child, cpu_seconds
from llmproxy.proxy.bench.loadgen import LoadResult, run_load
from llmproxy.proxy.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.proxy.logs import configure_logging

GOAL_ADDED_P50_MS = 1.0
GOAL_ADDED_P99_MS = 3.0
GOAL_THROUGHPUT_RATIO = 0.5


class OverheadSettings(LayeredSettings):
    """Options of ``llmproxy bench overhead`` (env ``LLMPROXY_BENCH_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_BENCH_", frozen=True, extra="forbid")

    requests: int = Field(2000, ge=1, description="Measured requests per case and target")
    warmup: int = Field(200, ge=0, description="Unmeasured warm-up requests per case and target")
    concurrency: list[int] = Field([1, 32], description="Concurrency levels (closed-loop workers)")
    duration: float = Field(60.0, gt=0, description="Time cap in seconds per phase (warm-up, measured) and target")
    modes: list[str] = Field(["nonstream", "stream"], description="Request modes: nonstream, stream")
    route: str = Field("/completion", description="Upstream route to load (llama-server shape)")
    tokens: int = Field(16, ge=0, description="Tokens the fake upstream generates per request")
    token_delay_ms: list[float] = Field(
        [5.0, 0.0], description="Fake upstream delay per token, one profile per value (0: instant, not judged)"
    )
    slots: int = Field(64, ge=1, description="Fake upstream slots (and proxy capacity)")
    max_queue: int = Field(1000, ge=0, description="Proxy --max-queue")
    proxy: bool = Field(True, description="Also measure through the proxy (--no-proxy: direct only)")
    floor: bool = Field(
        True, description="Also measure a featureless aiohttp forwarder (forwarder.py): the stack's own cost"
    )
    startup_timeout_s: float = Field(60.0, gt=0, description="Longest wait for a child to write its port file")
    log_level: str = Field("warning", description="Log level (this process and its children)")


@dataclass(frozen=True)
class Case:
    mode: str
    concurrency: int
    direct: LoadResult
    proxied: LoadResult | None
    token_delay_ms: float = 0.0
    floor: LoadResult | None = None  # the featureless aiohttp forwarder, same load

    @property
    def judged(self) -> bool:
        """Goals apply to paced upstreams; the instant profile is a CPU stress (see module doc)."""
        return self.token_delay_ms > 0

    @property
    def name(self) -> str:
        pace = f"{self.token_delay_ms:g}ms/tok" if self.token_delay_ms > 0 else "instant"
        return f"{pace} {self.mode} c={self.concurrency}"


def _body(settings: OverheadSettings, stream: bool) -> bytes:
    obj = {"prompt": "def fib(n):", "n_predict": settings.tokens, "stream": stream, "cache_prompt": True}
    return json.dumps(obj, separators=(",", ":")).encode()


async def _load(
    url: str, settings: OverheadSettings, stream: bool, concurrency: int, pids: tuple[int, ...]
) -> LoadResult:
    return await run_load(
        url + settings.route, _body(settings, stream), requests=settings.requests, warmup=settings.warmup,
        concurrency=concurrency, duration_s=settings.duration, stream=stream,
        headers=lambda w: {"X-LLMProxy-Session": f"bench-{w}"},
        probe=lambda: tuple(cpu_seconds(pid) for pid in pids),
    )


def proxy_command(settings: OverheadSettings, upstream_url: str) -> list[str]:
    """The proxy child's command line (``--port-file`` is appended by ``child``)."""
    return [
        sys.executable, "-m", "llmproxy.proxy", "serve", "--port", "0", "--upstream", upstream_url,
        "--capacity", str(settings.slots), "--max-queue", str(settings.max_queue), "--log-level", settings.log_level,
    ]


async def _profile(settings: OverheadSettings, delay_ms: float, workdir: Path) -> list[Case]:
    """All modes x concurrencies against one fake (and one proxy) paced at ``delay_ms``."""
    fake_argv = [
        sys.executable, "-m", "llmproxy.proxy.bench.fake_upstream", "--port", "0", "--kind", "llamacpp",
        "--slots", str(settings.slots), "--tokens", str(settings.tokens),
        "--token-delay-ms", str(delay_ms), "--log-level", settings.log_level,
    ]
    cases: list[Case] = []
    async with contextlib.AsyncExitStack() as stack:
        fake_pid, fake_url = await stack.enter_async_context(child("fake_upstream", fake_argv, workdir, settings.startup_timeout_s))
        proxy_url, proxy_pid, floor_url, floor_pid = None, 0, None, 0
        if settings.proxy:
            proxy_argv = proxy_command(settings, fake_url)
            proxy_pid, proxy_url = await stack.enter_async_context(child("proxy", proxy_argv, workdir, settings.startup_timeout_s))
        if settings.proxy and settings.floor:
            floor_argv = [sys.executable, "-m", "llmproxy.proxy.bench.forwarder", "--upstream", fake_url]
            floor_pid, floor_url = await stack.enter_async_context(child("forwarder", floor_argv, workdir, settings.startup_timeout_s))
        for mode in settings.modes:
            stream = mode == "stream"
            for c in settings.concurrency:
                direct = await _load(fake_url, settings, stream, c, (fake_pid,))
                floor = await _load(floor_url, settings, stream, c, (fake_pid, floor_pid)) if floor_url else None
                proxied = await _load(proxy_url, settings, stream, c, (fake_pid, proxy_pid)) if proxy_url else None
                cases.append(Case(mode, c, direct, proxied, delay_ms, floor))
    return cases


async def _bench(settings: OverheadSettings) -> list[Case]:
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="llmproxy-bench-") as tmp:
        for i, delay_ms in enumerate(settings.token_delay_ms):
            workdir = Path(tmp) / f"profile-{i}"  # fresh port files for each pair of children
            workdir.mkdir()
            cases += await _profile(settings, delay_ms, workdir)
    return cases


def _goals(case: Case) -> tuple[float, float, float, list[str]]:
    d, p = case.direct, case.proxied
    if p is None:
        return float("nan"), float("nan"), float("nan"), ["n/a"]
    add50 = p.percentile_ms(50) - d.percentile_ms(50)
    add99 = p.percentile_ms(99) - d.percentile_ms(99)
    ratio = p.rps / d.rps if d.rps else float("nan")
    marks = [
        f"p50 {'PASS' if add50 <= GOAL_ADDED_P50_MS else 'FAIL'}",
        f"p99 {'PASS' if add99 <= GOAL_ADDED_P99_MS else 'FAIL'}",
        f"thr {'PASS' if ratio >= GOAL_THROUGHPUT_RATIO else 'FAIL'}",
    ]
    if d.errors or p.errors:
        marks.append(f"ERRORS {d.errors}/{p.errors}")
    return add50, add99, ratio, marks


def format_table(cases: list[Case]) -> str:
    """The result table (one row per case) followed by the goals and an overall verdict."""
    head = (
        f"{'case':<26}{'n':>6}{'direct p50':>11}{'p99':>8}{'proxied p50':>12}{'p99':>8}"
        f"{'added p50':>10}{'p99':>8}{'rps direct':>11}{'proxied':>9}{'ratio':>7}"
        f"{'CPU us/req proxy':>17}{'fake':>6}{'floor +p50':>11}{'+p99':>7}{'CPU':>6}  goals"
    )
    lines = [head, "-" * len(head)]
    all_pass = True
    for case in cases:
        add50, add99, ratio, marks = _goals(case)
        if case.judged:
            all_pass = all_pass and all(m.endswith("PASS") for m in marks)
        else:
            marks = [*marks, "(not judged)"]
        d, p = case.direct, case.proxied
        n = f"{d.ok}" + ("*" if d.capped or (p is not None and p.capped) else "")
        proxy_cpu = p.cpu_us_per_request(1) if p else float("nan")
        f = case.floor
        floor50 = f.percentile_ms(50) - d.percentile_ms(50) if f else float("nan")
        floor99 = f.percentile_ms(99) - d.percentile_ms(99) if f else float("nan")
        floor_cpu = f.cpu_us_per_request(1) if f else float("nan")
        lines.append(
            f"{case.name:<26}{n:>6}"
            f"{d.percentile_ms(50):>11.2f}{d.percentile_ms(99):>8.2f}"
            f"{(p.percentile_ms(50) if p else float('nan')):>12.2f}{(p.percentile_ms(99) if p else float('nan')):>8.2f}"
            f"{add50:>10.2f}{add99:>8.2f}{d.rps:>11.0f}{(p.rps if p else float('nan')):>9.0f}{ratio:>7.2f}"
            f"{proxy_cpu:>17.0f}{d.cpu_us_per_request(0):>6.0f}{floor50:>11.2f}{floor99:>7.2f}{floor_cpu:>6.0f}  "
            + ", ".join(marks)
        )
    lines.append("")
    lines.append(
        f"latencies in ms; goals: added p50 <= {GOAL_ADDED_P50_MS} ms, added p99 <= {GOAL_ADDED_P99_MS} ms, "
        f"proxied throughput >= {GOAL_THROUGHPUT_RATIO:.0%} of direct; * = stopped by the duration cap"
    )
    lines.append(
        "CPU us/req: user+system CPU per request of the proxy (proxied run) and of the fake (direct run); "
        "instant-upstream rows are a CPU stress, not judged (see `llmproxy bench overhead --help`)"
    )
    lines.append(
        "floor: the same load through a featureless aiohttp forwarder (bench/forwarder.py): the latency it adds "
        "over direct and its CPU us/req, i.e. what the aiohttp server + client hop costs here before any proxy logic"
    )
    judged = [c for c in cases if c.judged and c.proxied is not None]
    verdict = ("PASS" if all_pass else "FAIL") if judged else "n/a (no paced rows measured through the proxy)"
    lines.append(f"overall (paced upstream rows): {verdict}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(OverheadSettings, args)
    configure_logging(settings.log_level)
    unknown = set(settings.modes) - {"nonstream", "stream"}
    if unknown:
        raise SystemExit(f"llmproxy bench overhead: unknown mode(s): {', '.join(sorted(unknown))}")
    gc.freeze()  # the load generator too: no full-collection pauses inside the measurements
    cases = asyncio.run(_bench(settings))
    sys.stdout.write(format_table(cases))
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
