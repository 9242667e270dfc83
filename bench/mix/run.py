"""``llmproxy bench mix``: editors typing while agents send long chat answers, on one server.

A fake llama-server (``--slots``) serves chat answers of ``--agent-tokens`` tokens and
completions of ``--n-predict``, a token every ``--token-delay-ms``. ``--agents`` agents
send chat streams back to back (``/v1/chat/completions``, each its own caller session)
while ``--editors`` editors type ``--bursts`` bursts with ``bench burst``'s client profiles.
Targets, one after another, each on a fresh fake: ``direct`` (the fake itself), ``fifo``
(``llmproxy serve --classes off``: one FIFO queue) and ``classes`` (the proxy's defaults:
completions before chats, a reserve of one slot for completions). The table (report.py)
shows the editors' last completion of each burst over ``T`` (one completion on the idle
target), and the agents' tokens per second over the bursts.

Concurrency contract: one target at a time. The fake, the proxy (a child process) and the
agents (one TaskGroup, cancelled once the editors' bursts end, closing their connections)
are owned by ``run_target``; nothing outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.bench.burst.editor import Client, run_burst
from llmproxy.bench.burst.profiles import PROFILES, typed_text
from llmproxy.bench.burst.report import TargetResult
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.child import ChildFailed, child
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.mix.report import format_table, goals
from llmproxy.bench.mix.settings import MixSettings, Target
from llmproxy.bench.progress import Steps
from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


@dataclass
class Agents:
    tokens: int = 0
    answers: int = 0
    errors: int = 0


def proxy_argv(url: str, target: Target) -> list[str]:
    argv = [sys.executable, "-m", "llmproxy.proxy", "serve", "--port", "0", "--upstream", url]
    return argv + (["--classes", "off"] if target == "fifo" else []) + ["--log-level", "warning"]


def fake_for(s: MixSettings) -> FakeUpstream:
    delay = s.token_delay_ms / 1000

    def script(path: str, _body: dict[str, Any]) -> Script:
        tokens = s.agent_tokens if "chat" in path else s.n_predict
        return Script(tokens=tokens, token_delay_s=delay)

    return FakeUpstream(slots=s.slots, script=script, abort_linger_s=0.01)


async def agent(http: aiohttp.ClientSession, url: str, k: int, s: MixSettings, out: Agents) -> None:
    """Chat streams back to back until cancelled; counts the tokens it reads."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"agent {k}: write a long answer"}],
        "stream": True,
        "max_tokens": s.agent_tokens,
    }
    headers = {"X-LLMProxy-Session": f"agent-{k}"}
    while True:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                out.errors += 1
                await r.read()
                await asyncio.sleep(0.05)
                continue
            async for line in r.content:
                if line.startswith(b"data: {"):
                    out.tokens += 1
            out.answers += 1


async def baseline(client: Client) -> float:
    """One completion on the idle target: T."""
    body = client.profile.encode(typed_text(0), client.settings.n_predict, "default")
    start = time.perf_counter()
    async with client.http.post(
        client.url + client.profile.route, data=body, headers=client.headers
    ) as r:
        await r.read()
    return time.perf_counter() - start


async def run_target(target: Target, s: MixSettings, workdir: Path) -> dict[str, Any]:
    burst = BurstSettings(
        profile=s.profile,
        keystrokes=s.keystrokes,
        interval_ms=s.interval_ms,
        bursts=s.bursts,
        editors=s.editors,
        n_predict=s.n_predict,
        model="default",
        request_timeout_s=s.request_timeout_s,
    )
    async with fake_for(s) as fake:
        if target == "direct":
            return await _drive(target, fake.url, s, burst, fake)
        argv = proxy_argv(fake.url, target)
        async with child(f"proxy-{target}", argv, workdir, s.start_timeout_s) as (_pid, url):
            return await _drive(target, url, s, burst, fake)


async def _drive(
    target: Target, url: str, s: MixSettings, burst: BurstSettings, fake: FakeUpstream
) -> dict[str, Any]:
    clients = [Client(url, PROFILES[s.profile], burst, e) for e in range(s.editors)]
    agents = Agents()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=s.request_timeout_s)
    try:
        t = await baseline(clients[0])
        result = TargetResult(url, s.profile, t, time.perf_counter())
        async with aiohttp.ClientSession(timeout=timeout) as http:
            tasks = [asyncio.create_task(agent(http, url, k, s, agents)) for k in range(s.agents)]
            try:
                if s.agents:  # the agents are at work (the reserve may hold one back)
                    await fake.wait_for(lambda f: f.concurrent >= 1, 10)
                start, before = time.perf_counter(), agents.tokens
                for b in range(s.bursts):
                    async with asyncio.TaskGroup() as editors:
                        for c in clients:
                            editors.create_task(run_burst(c, result, b))
                    await asyncio.sleep(s.pause_ms / 1000)
                elapsed, tokens = time.perf_counter() - start, agents.tokens - before
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for c in clients:
            await c.http.close()
    summary = result.summary()
    return {
        "target": target,
        "T_ms": t * 1000,
        "last_p50_ms": summary["last_p50_ms"],
        "last_p95_ms": summary["last_p95_ms"],
        "editor_errors": summary["errors"],
        "agent_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "agent_answers": agents.answers,
        "agent_errors": agents.errors,
        "deferred_at_server": len(fake.deferred),
    }


async def run_all(s: MixSettings, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    with Steps(len(s.targets), "bench mix") as steps:
        for target in s.targets:
            steps.step(target)
            rows.append(await run_target(target, s, workdir))
    return rows


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(MixSettings, args)
    configure_logging(settings.log_level)
    try:
        with tempfile.TemporaryDirectory(prefix="llmproxy-bench-mix-") as tmp:
            rows = asyncio.run(run_all(settings, Path(tmp)))
    except ChildFailed as exc:
        raise SystemExit(f"llmproxy bench mix: {exc}") from None
    sys.stdout.write(format_table(rows, settings))
    verdicts = goals(rows)
    if settings.json_out is not None:
        data = {
            "settings": settings.model_dump(mode="json"),
            "targets": rows,
            "goals": [{"goal": g, "value": v, "pass": ok} for g, v, ok in verdicts],
        }
        settings.json_out.write_text(json.dumps(data, indent=1))
    return 1 if any(ok is False for _g, _v, ok in verdicts) else 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "mix",
        help="Editors typing while agents send long chat answers: direct, FIFO, classes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, MixSettings)
    parser.set_defaults(func=run)
