"""``llmproxy bench pool``: editors typing through the proxy into a pool of upstreams, per policy.

Each editor types in a file of its own (a long, distinct prefix; editors.py) and sends a
completion per keystroke as ``bench burst``'s client profiles do. The pool is 3 fake
llama-servers with the prompt-cache model (a request's first token waits for the prefill
of the prompt characters its slot had not cached), or with ``--real`` 2 ``llmproxy
backend`` processes (upstreams.py). The same script runs against one fresh ``llmproxy
serve`` child per ``--route`` policy, started with ``--upstream`` listing the pool, and
against one in front of the first upstream alone (``single``); the upstreams are started
afresh for every target, so each starts on cold caches. The table (report.py) shows the
last completion of each burst, the prompt evaluated vs cached, how many generations each
upstream ran at once and how the proxy routed, and judges the goals.

Concurrency contract: one target at a time. Its upstreams and proxy are owned by nested
``async with`` blocks (the proxy a child process that dies with this one), the editors by
one TaskGroup per burst (an editor's requests by its own TaskGroup, abandoning a request
cancels its task, closing its connection); between bursts the bench waits until no
upstream slot is busy. Nothing outlives ``run_target``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.backend.model_path import ModelNotFound
from llmproxy.bench.burst.editor import run_burst
from llmproxy.bench.burst.report import TargetResult
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.child import ChildFailed, child
from llmproxy.bench.pool.editors import PoolClient, editor_profile, file_text
from llmproxy.bench.pool.report import PoolTarget, format_table, goals
from llmproxy.bench.pool.settings import Policy, PoolSettings
from llmproxy.bench.pool.upstreams import Upstreams, fake_pool, real_pool
from llmproxy.bench.progress import Steps
from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging

DECISION = re.compile(r"^llmproxy_upstream_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.M)


def proxy_argv(urls: list[str], policy: Policy) -> list[str]:
    """``llmproxy serve`` in front of ``urls`` (``--port-file`` is appended by ``child``)."""
    return [sys.executable, "-m", "llmproxy.proxy", "serve", "--port", "0"] + [
        "--upstream", ",".join(urls), "--route", policy, "--log-level", "info", "--log-json",
    ]  # fmt: skip


def burst_settings(s: PoolSettings) -> BurstSettings:
    return BurstSettings(
        profile=s.profile,
        keystrokes=s.keystrokes,
        interval_ms=s.interval_ms,
        bursts=s.bursts,
        editors=s.editors,
        n_predict=s.n_predict,
        model="default",
        request_timeout_s=s.request_timeout_s,
    )


async def _proxy_view(url: str) -> tuple[list[int] | None, list[Any] | None, dict[str, int]]:
    """(routed per upstream, the proxy's hit estimate per upstream, route decisions)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url + "/llmproxy/status") as resp:
            status = await resp.json()
        async with http.get(url + "/llmproxy/metrics") as resp:
            metrics = await resp.text()
    members = status.get("upstreams")
    routed = [m["routed"] for m in members] if members else None
    hits = [m["cache_hit_estimate"] for m in members] if members else None
    decisions: Counter[str] = Counter()
    for labels, value in DECISION.findall(metrics):
        found = re.search(r'decision="([^"]*)"', labels)
        if found:
            decisions[found.group(1)] += int(float(value))
    return routed, hits, {k: v for k, v in decisions.items() if v}


async def run_target(
    name: str, policy: Policy, ups: Upstreams, settings: PoolSettings, workdir: Path
) -> PoolTarget:
    """The bursts of every editor through a fresh proxy in front of ``ups``."""
    burst = burst_settings(settings)
    argv = proxy_argv(ups.urls, policy)
    async with child(f"proxy-{name}", argv, workdir, settings.start_timeout_s) as (_pid, url):
        clients = [
            PoolClient(
                url, editor_profile(settings.profile, file_text(e, settings.prefix_chars)), burst, e
            )
            for e in range(settings.editors)
        ]
        result = TargetResult(url, settings.profile, 0.0, time.perf_counter())
        try:
            for b in range(settings.bursts):
                await ups.wait_idle(settings.idle_timeout_s)
                async with asyncio.TaskGroup() as editors:
                    for c in clients:
                        editors.create_task(run_burst(c, result, b))
            await ups.wait_idle(settings.idle_timeout_s)
        finally:
            for c in clients:
                await c.http.close()
        routed, hits, decisions = await _proxy_view(url)
    answers = {
        "evaluated": sum(c.evaluated for c in clients),
        "cached": sum(c.cached for c in clients),
        "answers": sum(c.answers for c in clients),
    }
    return PoolTarget(name, ups.slots, result, ups.counters(), answers, routed, hits, decisions)


@contextlib.asynccontextmanager
async def _upstreams(
    settings: PoolSettings, n: int, workdir: Path, tag: str
) -> AsyncIterator[Upstreams]:
    if settings.real:
        async with real_pool(settings, n, workdir, tag) as ups:
            yield ups
    else:
        async with fake_pool(settings, n) as ups:
            yield ups


async def run_all(settings: PoolSettings, workdir: Path) -> list[PoolTarget]:
    """Every ``--route`` policy in front of the pool, then ``single``; see the docstring."""
    size = settings.backends if settings.real else settings.fakes
    plan: list[tuple[str, Policy, int]] = [(p, p, size) for p in settings.routes]
    if settings.single:
        plan.append(("single", "cache", 1))
    targets = []
    with Steps(len(plan), "bench pool") as steps:  # on stderr: the target and the time left
        for name, policy, n in plan:
            steps.step(f"{name} ({n} upstream{'s' if n > 1 else ''})")
            async with _upstreams(settings, n, workdir, name) as ups:
                target = await run_target(name, policy, ups, settings, workdir)
            targets.append(target)
            s = target.summary()
            sys.stderr.write(
                f"bench pool: {name}: last p50 {s['last_p50_ms']:.0f} ms, "
                f"{s['prompt_evaluated']} {s['prompt_unit']} evaluated, {s['errors']} errors\n"
            )
    return targets


async def _main(settings: PoolSettings) -> list[PoolTarget]:
    if settings.log_dir is not None:
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        return await run_all(settings, settings.log_dir)
    with tempfile.TemporaryDirectory(prefix="llmproxy-bench-pool-") as tmp:
        return await run_all(settings, Path(tmp))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(PoolSettings, args)
    configure_logging(settings.log_level)
    try:
        targets = asyncio.run(_main(settings))
    except (ChildFailed, ModelNotFound) as exc:
        raise SystemExit(f"llmproxy bench pool: {exc}") from None
    sums = [t.summary() for t in targets]
    sys.stdout.write(format_table(sums))
    verdicts = goals(sums)
    if settings.json_out is not None:
        data = {
            "settings": settings.model_dump(mode="json"),
            "targets": [
                {**s, "bursts": [asdict(b) for b in t.result.bursts]}
                for s, t in zip(sums, targets, strict=True)
            ],
            "goals": [{"goal": g, "value": v, "pass": ok} for g, v, ok in verdicts],
        }
        settings.json_out.write_text(json.dumps(data, indent=1))
    return 1 if any(ok is False for _g, _v, ok in verdicts) else 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "pool",
        help="Editors typing through the proxy into several upstreams, per --route policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, PoolSettings)
    parser.set_defaults(func=run)
