"""``llmproxy bench soak --minutes M``: mixed editors against ``llmproxy serve`` for a while, then check invariants.

Starts ``llmproxy serve`` as a child (embedded backend by default, ``--upstream URL``
otherwise) with ``--capacity N``, and drives ``--editors`` simulated editors, each its own
session, doing at random: keystroke bursts on ``/infill`` (half of them abort the previous
request, like llm-ls; the others leave the superseding to the proxy, like Continue),
``n_predict: 0`` warm-ups, streamed chat completions and non-streamed completions.
Meanwhile ``GET /slots`` (through the proxy's passthrough) is polled to record how many
generations the backend ran at once. At the end, once the proxy is quiet, it reports
requests by outcome (from ``/llmproxy/metrics``), the maximum upstream concurrency
observed, the proxy's RSS after warm-up and at the end, and the free permits; it exits 1
when an invariant fails: max concurrency == N, free permits == N, RSS growth < 10 %, no
request with outcome ``error``, and every request a client sent (aborted ones included) counted
exactly once by the proxy.

Concurrency contract: editors and the /slots poller run in one TaskGroup until the
deadline; an editor's in-flight requests are tasks it owns and cancels (abort) or awaits
before returning. The proxy child is terminated (SIGTERM, then SIGKILL) when ``run_soak``
exits, whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.bench.burst.slots import SlotsPoller
from llmproxy.bench.child import child
from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


class SoakSettings(LayeredSettings):
    """Options of ``llmproxy bench soak`` (env ``LLMPROXY_SOAK_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_SOAK_", frozen=True, extra="forbid")

    minutes: float = Field(10.0, gt=0, description="How long to drive the editors")
    upstream: str | None = Field(
        None, description="Backend URL for the proxy; unset = embedded backend"
    )
    capacity: int = Field(1, ge=1, description="Permits N (and embedded backend slots)")
    editors: int = Field(4, ge=1, description="Simulated editors (one session each)")
    n_predict: int = Field(16, ge=1, description="Tokens asked per completion")
    poll_ms: float = Field(20.0, gt=0, description="GET /slots poll interval")
    seed: int = Field(1, description="Random seed for the editors' actions")
    start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the proxy (and its backend) to start"
    )
    log_level: str = Field("warning", description="Log level (also the proxy child's)")


@dataclass
class SoakResult:
    capacity: int
    seconds: float = 0.0
    client: Counter[str] = field(default_factory=Counter)  # client-side: status code or 'aborted'
    outcomes: dict[str, float] = field(default_factory=dict)  # proxy metrics: outcome -> count
    max_concurrency: int = 0
    rss_start_kb: int = 0
    rss_end_kb: int = 0
    permits_free: int = -1
    error_lines: list[str] = field(
        default_factory=list
    )  # the proxy's log lines about failed requests

    def failures(self) -> list[str]:
        bad = []
        if self.max_concurrency != self.capacity:
            bad.append(f"max upstream concurrency {self.max_concurrency} != N={self.capacity}")
        if self.permits_free != self.capacity:
            bad.append(f"permits free at the end {self.permits_free} != N={self.capacity}")
        if self.rss_end_kb >= self.rss_start_kb * 1.10:
            bad.append(f"proxy RSS grew {self.rss_start_kb} -> {self.rss_end_kb} kB (>= 10%)")
        sent, counted = sum(self.client.values()), sum(self.outcomes.values())
        if counted != sent:
            bad.append(
                f"proxy counted {counted:g} requests, clients sent {sent}: some were lost or double-counted"
            )
        if self.outcomes.get("error", 0):
            bad.append(f"{self.outcomes['error']:g} requests ended in error")
        return bad


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def outcomes_from_metrics(text: str) -> dict[str, float]:
    """Sum ``llmproxy_requests_total`` over routes, by outcome."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llmproxy_requests_total":
                outcome = sample.labels["outcome"]
                out[outcome] = out.get(outcome, 0) + sample.value
    return out


def proxy_argv(settings: SoakSettings) -> list[str]:
    """``llmproxy serve`` for the soak (``--port-file`` is appended by ``child``)."""
    argv = [
        sys.executable,
        "-m",
        "llmproxy.proxy",
        "serve",
        "--port",
        "0",
        "--capacity",
        str(settings.capacity),
        "--log-level",
        settings.log_level,
        "--log-json",
    ]
    return argv + (
        ["--upstream", settings.upstream]
        if settings.upstream
        else ["--parallel", str(settings.capacity)]
    )


class Editor:
    """One editor session doing random actions until ``deadline``."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, i: int, s: SoakSettings, result: SoakResult
    ) -> None:
        self.http, self.url, self.s, self.result = http, url, s, result
        self.rng = random.Random(s.seed * 1000 + i)
        self.headers = {"X-LLMProxy-Session": f"soak-editor-{i}", "User-Agent": f"soak/{i}"}

    async def request(self, path: str, body: dict[str, Any]) -> None:
        try:
            async with self.http.post(self.url + path, json=body, headers=self.headers) as r:
                await r.read()
                self.result.client[str(r.status)] += 1
        except asyncio.CancelledError:
            self.result.client["aborted"] += 1
            raise
        except aiohttp.ClientError as exc:
            self.result.client[type(exc).__name__] += 1

    async def burst(self, abort: bool) -> None:
        tasks: list[asyncio.Task[None]] = []
        text = "def f(x):\n    return "
        try:
            for _ in range(self.rng.randint(2, 8)):
                text += self.rng.choice("abcxyz+-*() ")
                if abort and tasks:
                    tasks[-1].cancel()
                body = {
                    "input_prefix": text,
                    "input_suffix": "\n",
                    "n_predict": self.s.n_predict,
                    "stream": abort,
                }
                tasks.append(asyncio.create_task(self.request("/infill", body)))
                await asyncio.sleep(self.rng.uniform(0.03, 0.08))
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def act(self) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            await self.burst(abort=roll < 0.25)
        elif roll < 0.65:
            await self.request("/completion", {"prompt": "import os\n", "n_predict": 0})  # warm-up
        elif roll < 0.85:
            await self.request(
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "Say hi"}],
                    "max_tokens": self.s.n_predict,
                    "stream": True,
                },
            )
        else:
            await self.request(
                "/completion", {"prompt": "def add(a, b):", "n_predict": self.s.n_predict}
            )

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await self.act()
            await asyncio.sleep(self.rng.uniform(0, 0.3))


async def _quiet(http: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any]:
    """Wait until no request is queued or in flight; returns /llmproxy/status."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(url + "/llmproxy/status") as r:
            status: dict[str, Any] = await r.json()
        if (
            status["queue"]["depth"] == 0 and not status["inflight"] and status["jobs"] == 0
        ) or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.05)


async def run_soak(settings: SoakSettings) -> SoakResult:
    result = SoakResult(capacity=settings.capacity)
    with tempfile.TemporaryDirectory(prefix="llmproxy-soak-") as tmp:
        async with (
            child("proxy", proxy_argv(settings), Path(tmp), settings.start_timeout_s, 30) as (
                pid,
                url,
            ),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
        ):
            deadline = time.monotonic() + settings.start_timeout_s
            while True:  # the port file comes before the embedded backend is ready
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/llmproxy/health") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError("proxy not healthy in time")
                await asyncio.sleep(0.1)
            editors = [Editor(http, url, i, settings, result) for i in range(settings.editors)]
            for e in editors:  # warm-up: every kind of request once, then the RSS baseline
                for path, body in (
                    ("/infill", {"input_prefix": "x", "n_predict": 2}),
                    (
                        "/v1/chat/completions",
                        {
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2,
                            "stream": True,
                        },
                    ),
                ):
                    await e.request(path, body)
            await _quiet(http, url, 30)
            result.rss_start_kb = rss_kb(pid)
            poller = SlotsPoller(http, url, settings.poll_ms / 1000)
            stop = asyncio.Event()
            t0 = time.monotonic()
            end = t0 + settings.minutes * 60
            async with asyncio.TaskGroup() as tg:
                tg.create_task(poller.run(stop))
                runs = [tg.create_task(e.run(end)) for e in editors]
                await asyncio.wait(runs)
                stop.set()
            result.seconds = time.monotonic() - t0
            result.max_concurrency = poller.max_busy
            status = await _quiet(http, url, 60)
            result.permits_free = status["permits"]["free"]
            async with http.get(url + "/llmproxy/metrics") as r:
                result.outcomes = outcomes_from_metrics(await r.text())
            result.rss_end_kb = rss_kb(pid)
        result.error_lines = error_lines(Path(tmp) / "proxy.log")
    return result


def error_lines(log_path: Path, most: int = 10) -> list[str]:
    """The proxy child's warning/error log lines and canonical lines with outcome error."""
    keep = [
        ln
        for ln in log_path.read_text(errors="replace").splitlines()
        if '"outcome": "error"' in ln or '"level": "error"' in ln or '"level": "warning"' in ln
    ]
    return keep[:most]


def format_table(r: SoakResult) -> str:
    rows = [("duration (s)", f"{r.seconds:.1f}"), ("N (capacity)", str(r.capacity))]
    rows += [(f"proxy outcome {k}", f"{v:g}") for k, v in sorted(r.outcomes.items())]
    rows.append(("proxy requests counted", f"{sum(r.outcomes.values()):g}"))
    rows.append(("client requests sent", str(sum(r.client.values()))))
    rows += [(f"client saw {k}", str(v)) for k, v in sorted(r.client.items())]
    rows += [
        ("max upstream concurrency", str(r.max_concurrency)),
        ("permits free at end", str(r.permits_free)),
        ("proxy RSS start (kB)", str(r.rss_start_kb)),
        ("proxy RSS end (kB)", str(r.rss_end_kb)),
        (
            "proxy RSS growth",
            f"{(r.rss_end_kb / r.rss_start_kb - 1) * 100:+.1f}%" if r.rss_start_kb else "n/a",
        ),
    ]
    lines = [f"{k:<32}{v:>14}" for k, v in rows]
    bad = r.failures()
    lines.append("")
    lines += [f"FAIL: {b}" for b in bad] or ["all invariants hold"]
    if r.error_lines:
        lines += ["", "proxy log (warnings and errors, first 10):", *r.error_lines]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(SoakSettings, args)
    configure_logging(settings.log_level)
    result = asyncio.run(run_soak(settings))
    sys.stdout.write(format_table(result))
    return 1 if result.failures() else 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "soak",
        help="Mixed editors against llmproxy serve for M minutes; check nothing leaks or overruns",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, SoakSettings)
    parser.set_defaults(func=run)
