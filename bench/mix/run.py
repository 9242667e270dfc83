"""``llmproxy bench mix``: editors typing while agents send long chat answers, on one server.

The server (``--server``) is a fake llama-server (``--slots``, a token every
``--token-delay-ms``) or a real llama-server (``-np --slots``, ``-t --threads``; every
generation runs to its length, end tokens ignored). ``--agents`` agents send chat streams
of ``--agent-tokens`` tokens back to back (``/v1/chat/completions``, each its own caller
session) while ``--editors`` editors type ``--bursts`` bursts with ``bench burst``'s client
profiles, completions of ``--n-predict`` tokens. Targets, one after another, each on a
fresh server: ``direct`` (the server itself) and the proxy (``llmproxy serve``, a child
process) with each target's arguments (settings.py ``PROXY_ARGS``): ``fifo``
(``--classes off``: one FIFO queue), ``classes`` (the proxy's defaults: completions before
chats, a reserve of one slot for completions), ``noreserve`` (classes, ``--reserve 0``).
The table (report.py) shows the editors' last completion of each burst over ``T`` (the
same editors' last completions on the idle target: ``--idle-bursts`` bursts typed before
the agents start), and the agents' tokens per second over the bursts.
By default an editor types its next burst ``--pause-ms`` after the last one was answered,
so a target that answers sooner gets more bursts in the same time; ``--burst-every-s``
starts one on a fixed schedule instead, the same demand on every target.

``--callers 8,1`` runs the fairness scenario instead: no editors; each caller has that
many agents and a client key of its own (``[[keys]]`` in the proxy's config file, which
the bench writes), for ``--duration-s``; the table shows each caller's share of the
generations finished meanwhile (fair shares between callers come with classes on).

Concurrency contract: one target at a time. The server (the fake in this process, or a
child), the proxy (a child) and the agents (tasks cancelled once the editors' bursts or
the duration end, closing their connections) are owned by ``run_target``; nothing
outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.backend.model_path import resolve_model
from llmproxy.bench.burst.editor import Client, run_burst
from llmproxy.bench.burst.profiles import PROFILES, typed_text
from llmproxy.bench.burst.report import TargetResult
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.child import ChildFailed, child
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.mix.agents import Agents, Caller, agent
from llmproxy.bench.mix.report import format_table, goals
from llmproxy.bench.mix.settings import DIRECT, PROXY_ARGS, MixSettings
from llmproxy.bench.progress import Steps
from llmproxy.bench.servers import model_server
from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging

#: llama-server: every generation runs to its length (no end token, no stop strings)
FULL_LENGTH = {"ignore_eos": True, "stop": []}


def proxy_argv(url: str, target: str, config: Path | None, log_level: str) -> list[str]:
    argv = [sys.executable, "-m", "llmproxy.proxy", "serve", "--port", "0", "--upstream", url]
    argv += ["--config", str(config)] if config is not None else []
    return argv + list(PROXY_ARGS[target]) + ["--log-level", log_level]


def callers_of(s: MixSettings) -> list[Caller]:
    """The agents' callers: ``--callers``' (A, B, ...; a key each), else one without a key."""
    if not s.callers:
        return [Caller("agents", s.agents)]
    return [
        Caller(chr(ord("A") + i), n, f"bench-mix-{secrets.token_hex(8)}")
        for i, n in enumerate(s.callers)
    ]


def keys_config(callers: list[Caller], path: Path) -> Path | None:
    """The proxy's config file naming the callers' keys (None: no caller has one)."""
    keyed = [c for c in callers if c.key is not None]
    if not keyed:
        return None
    path.write_text("".join(f'[[keys]]\nname = "{c.name}"\nkey = "{c.key}"\n\n' for c in keyed))
    return path


def fake_for(s: MixSettings) -> FakeUpstream:
    delay = s.token_delay_ms / 1000

    def script(path: str, _body: dict[str, Any]) -> Script:
        tokens = s.agent_tokens if "chat" in path else s.n_predict
        return Script(tokens=tokens, token_delay_s=delay)

    # continues: a preempted chat's continuation goes on where it stopped, as a model's
    return FakeUpstream(slots=s.slots, script=script, abort_linger_s=0.01, continues=True)


@contextlib.asynccontextmanager
async def server(
    s: MixSettings, target: str, workdir: Path
) -> AsyncIterator[tuple[str, FakeUpstream | None]]:
    """A fresh server for one target: (its URL, the fake or None)."""
    if s.server == "fake":
        async with fake_for(s) as fake:
            yield fake.url, fake
        return
    model = resolve_model(s.model)
    log = workdir / f"llama-server-{target}.log"
    async with model_server("llama-server", s.llama_server, model, s.slots, s.threads, log) as url:
        yield url, None


async def idle_bursts(clients: list[Client], bursts: int, pause_s: float) -> float:
    """T: the median of the editors' last completions over ``bursts`` bursts on the idle
    target, typed as the measured ones are (each keystroke's prompt new to the server's
    cache, the superseded ones' stops), each ``pause_s`` after the last one's answer."""
    result = TargetResult(clients[0].url, clients[0].profile.name, 0.0, time.perf_counter())
    for b in range(bursts):
        async with asyncio.TaskGroup() as editors:
            for c in clients:
                editors.create_task(run_burst(c, result, -1 - b))
        await asyncio.sleep(pause_s)
    t_ms = float(result.summary()["last_p50_ms"])
    if math.isnan(t_ms):
        raise SystemExit(f"llmproxy bench mix: no burst on the idle {clients[0].url} answered")
    return t_ms / 1000


async def baseline(client: Client, runs: int) -> float:
    """The median of ``runs`` times one completion on the idle target (the 'one request'
    column). Each on a connection of its own (llama-server may close a kept-alive one as
    the next request goes out)."""
    body = client.profile.encode(typed_text(0), client.settings.n_predict, "default", client.extra)
    times = []
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(runs):
            start = time.perf_counter()
            async with http.post(
                client.url + client.profile.route, data=body, headers=client.headers
            ) as r:
                await r.read()
                if r.status != 200:
                    raise SystemExit(f"llmproxy bench mix: {client.url} answered {r.status}")
            times.append(time.perf_counter() - start)
    return statistics.median(times)


async def run_target(target: str, s: MixSettings, workdir: Path) -> dict[str, Any]:
    callers = callers_of(s)
    async with server(s, target, workdir) as (upstream, fake):
        if target == DIRECT:
            row = await _drive(upstream, s, callers)
        else:
            config = keys_config(callers, workdir / f"keys-{target}.toml")
            argv = proxy_argv(upstream, target, config, s.proxy_log_level)
            async with child(f"proxy-{target}", argv, workdir, s.start_timeout_s) as (_pid, url):
                row = await _drive(url, s, callers)
                row.update(await preemptions(url, next((c.key for c in callers if c.key), None)))
        deferred = len(fake.deferred) if fake is not None else None
    return {"target": target, **row, "deferred_at_server": deferred}


async def preemptions(url: str, key: str | None) -> dict[str, float]:
    """The generations the proxy stopped for a completion (its status page: those still
    running count too) and the prompt tokens its resumes evaluated again (its metrics, of
    the requests that ended); read with a caller's key where the proxy has keys."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = {"preemptions": math.nan, "resume_prompt_tokens": math.nan}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(url + "/llmproxy/status") as r:
            if r.status == 200:
                out["preemptions"] = float((await r.json())["preemptions"])
        async with http.get(url + "/llmproxy/metrics") as r:
            text = await r.text() if r.status == 200 else ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "llmproxy_resume_prompt_tokens_total":
            out["resume_prompt_tokens"] = float(value)
    return out


def burst_settings(s: MixSettings, extra: dict[str, Any]) -> BurstSettings:
    return BurstSettings(
        profile=s.profile,
        keystrokes=s.keystrokes,
        interval_ms=s.interval_ms,
        bursts=s.bursts,
        editors=s.editors,
        n_predict=s.n_predict,
        model="default",
        request_timeout_s=s.request_timeout_s,
        extra_body=json.dumps(extra) if extra else "",
    )


async def _drive(url: str, s: MixSettings, callers: list[Caller]) -> dict[str, Any]:
    """T on the idle target first (editors only), then the agents, then the scenario."""
    extra: dict[str, Any] = dict(FULL_LENGTH) if s.server == "llama-server" else {}
    burst = burst_settings(s, extra)
    clients = (
        [] if s.callers else [Client(url, PROFILES[s.profile], burst, e) for e in range(s.editors)]
    )
    agents = Agents()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=s.request_timeout_s)
    try:
        one = await baseline(clients[0], s.baseline_runs) if clients else 0.0
        t = await idle_bursts(clients, s.idle_bursts, s.pause_ms / 1000) if clients else 0.0
        connector = aiohttp.TCPConnector(force_close=True)  # see baseline()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            tasks: list[asyncio.Task[None]] = []
            for caller in callers:
                for _ in range(caller.agents):
                    k = len(tasks)
                    body = agent(http, url, k, caller, s.agent_tokens, extra, agents)
                    tasks.append(asyncio.create_task(body))
            try:
                if s.callers:
                    return await _callers(s, agents, callers)
                return {"one_request_ms": one * 1000, **await _editors(clients, t, s, agents)}
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for c in clients:
            await c.http.close()


async def _editors(
    clients: list[Client], t: float, s: MixSettings, agents: Agents
) -> dict[str, Any]:
    """The editors' bursts while the agents work."""
    result = TargetResult(clients[0].url, s.profile, t, time.perf_counter())
    if s.agents:  # the agents are at work (the reserve may hold one back)
        await asyncio.wait_for(agents.working.wait(), s.request_timeout_s)
    start, before = time.perf_counter(), agents.tokens
    for b in range(s.bursts):
        if s.burst_every_s:  # on the schedule (later if the last burst is still waiting)
            await asyncio.sleep(max(0.0, start + b * s.burst_every_s - time.perf_counter()))
        async with asyncio.TaskGroup() as editors:
            for c in clients:
                editors.create_task(run_burst(c, result, b))
        if not s.burst_every_s:
            await asyncio.sleep(s.pause_ms / 1000)
    if s.burst_every_s:  # the agents measured over the whole schedule
        await asyncio.sleep(max(0.0, start + s.bursts * s.burst_every_s - time.perf_counter()))
    elapsed, tokens = time.perf_counter() - start, agents.tokens - before
    summary = result.summary()
    return {
        "T_ms": t * 1000,
        "last_p50_ms": summary["last_p50_ms"],
        "last_p95_ms": summary["last_p95_ms"],
        "editor_errors": summary["errors"],
        "agent_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "measured_s": elapsed,
        "agent_answers": sum(agents.answers.values()),
        "agent_errors": agents.errors,
        "agent_failures": agents.failures,
    }


async def _callers(s: MixSettings, agents: Agents, callers: list[Caller]) -> dict[str, Any]:
    """The fairness scenario: what each caller got over ``duration_s`` of agents at work."""
    await asyncio.wait_for(agents.working.wait(), s.request_timeout_s)
    start = time.perf_counter()
    tokens0, answers0, by0 = agents.snapshot()
    await asyncio.sleep(s.duration_s)
    elapsed = time.perf_counter() - start
    tokens1, answers1, by1 = agents.snapshot()
    answers = {c.name: answers1.get(c.name, 0) - answers0.get(c.name, 0) for c in callers}
    total = sum(answers.values())
    return {
        "agent_tokens_per_s": (tokens1 - tokens0) / elapsed,
        "agent_answers": total,
        "agent_errors": agents.errors,
        "agent_failures": agents.failures,
        "callers": [
            {
                "caller": c.name,
                "agents": c.agents,
                "generations": answers[c.name],
                "share": answers[c.name] / total if total else 0.0,
                "tokens_per_s": (by1.get(c.name, 0) - by0.get(c.name, 0)) / elapsed,
            }
            for c in callers
        ],
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
            workdir = settings.logs_dir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            rows = asyncio.run(run_all(settings, workdir))
    except ChildFailed as exc:
        raise SystemExit(f"llmproxy bench mix: {exc}") from None
    sys.stdout.write(format_table(rows, settings))
    verdicts = goals(rows, settings)
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
        help="Editors typing while agents send long chat answers (or callers' agents "
        "sharing a server): direct, FIFO, classes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, MixSettings)
    parser.set_defaults(func=run)
