"""``llmproxy bench burst``: emulate editors typing against any URL, show what the user waits.

Each simulated editor types ``keystrokes`` characters ``interval_ms`` apart (one *burst*)
and asks for a completion per keystroke with the wire behaviour of a real client (see
profiles.py; one editor's client and bursts: editor.py). The number that matters is the
latency of the completion the user actually waited for: from the burst's last keystroke to
the end of the response for the final text. It is compared with one uncontended generation
of the same prompt (measured first, on an idle target). A background poller reads
``GET /slots`` (llama-server, the embedded backend, also through the proxy) to count the
generations the backend really ran, how many ran at once and how many tokens it decoded,
and which of those tokens went to a generation whose response nobody read (see slots.py).
Where the backend serves ``GET /metrics`` (counters.py), the prompt tokens it evaluated and
the tokens it generated are counted exactly instead.
``--compare URL2,URL3`` runs the same script against more targets and prints them side by
side; ``--typist follow`` types the suggestion that came back instead (type-through);
``--plot FILE.png`` draws latency over time (needs matplotlib, the ``plot`` extra).

Concurrency contract: one target at a time. Editors run in one TaskGroup; an editor's
requests are tasks in its own TaskGroup, and "abandoning" a request cancels its task,
which closes its connection. The /slots poller runs in the same group as the editors and
is stopped (via an Event) after the backend has been seen idle; nothing outlives
``run_target``. Between bursts the bench waits for the backend to be idle (or ``gap_ms``
when /slots is unavailable), so bursts do not bleed into each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict

import aiohttp

from llmproxy.bench.burst import counters
from llmproxy.bench.burst.editor import Client, run_burst, run_follow, run_triggers
from llmproxy.bench.burst.profiles import PROFILES, Profile
from llmproxy.bench.burst.report import Req, TargetResult, format_table
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.burst.slots import SlotsPoller
from llmproxy.bench.progress import Steps
from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


async def _settle(poller: SlotsPoller, settings: BurstSettings) -> None:
    if poller.available:
        await poller.wait_idle(settings.idle_timeout_s)
    await asyncio.sleep(settings.gap_ms / 1000)


async def _baseline(
    url: str, profile: Profile, settings: BurstSettings, poller: SlotsPoller
) -> float:
    """Median time of one uncontended completion for the final text.

    Each run first asks (untimed) for the text one keystroke earlier, so the backend's
    prompt cache is as warm as it is at the end of a burst: what a perfect proxy achieves.
    """
    client = Client(url, profile, settings, editor=0)
    last = settings.keystrokes - 1
    times = []
    try:
        for i in range(settings.baseline_runs + 1):  # the first one is a warm-up
            took = 0.0
            for k in (max(0, last - 1), last):
                await _settle(poller, settings)
                req = Req(0, -1, k, 0.0)
                await client.send(req, k)
                if req.outcome != "ok" or req.t_done is None:
                    answer = req.status or "no response"
                    raise SystemExit(
                        f"llmproxy bench burst: {url}{profile.route} answered {answer}"
                    )
                took = req.t_done - req.t_sent  # the final text's
            if i:
                times.append(took)
    finally:
        await client.http.close()
    return statistics.median(times)


async def _model_name(http: aiohttp.ClientSession, url: str) -> str:
    """The target's first model id (``/v1/models``, else Ollama's ``/api/tags``), or "default"."""
    for path, key, name in (("/v1/models", "data", "id"), ("/api/tags", "models", "name")):
        try:
            async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                models = (
                    (await resp.json(content_type=None)).get(key) if resp.status == 200 else None
                )
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            models = None
        if models and isinstance(models[0], dict) and models[0].get(name):
            return str(models[0][name])
    return "default"


async def run_target(url: str, settings: BurstSettings, steps: Steps | None = None) -> TargetResult:
    """Baseline, then ``bursts`` bursts per editor against ``url``; see the module docstring.
    ``steps``: the progress shown on stderr (bench/progress.py)."""
    url = url.rstrip("/")
    profile = PROFILES[settings.profile]
    async with aiohttp.ClientSession() as http:
        if not settings.model:
            settings = settings.model_copy(update={"model": await _model_name(http, url)})
        poller = SlotsPoller(http, url, settings.slots_poll_ms / 1000)
        if settings.poll_slots:
            await poller.probe()
        clients = [Client(url, profile, settings, e) for e in range(settings.editors)]
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                if poller.available:  # polling from the start: the baseline pays its cost too
                    tg.create_task(poller.run(stop))
                if steps is not None:
                    steps.step(f"{url} baseline")
                baseline = await _baseline(url, profile, settings, poller)
                await _settle(poller, settings)
                poller.reset()  # count the bursts only
                before = await counters.read(http, url)
                result = TargetResult(url, profile.name, baseline, time.perf_counter())
                for b in range(settings.bursts):
                    if steps is not None:
                        steps.step(f"{url} burst {b + 1}/{settings.bursts}")
                    await _settle(poller, settings)
                    typist = run_follow if settings.typist == "follow" else run_burst
                    if typist is run_burst and profile.abandon == "trigger":
                        typist = run_triggers
                    async with asyncio.TaskGroup() as editors:
                        for c in clients:
                            editors.create_task(typist(c, result, b))
                await _settle(poller, settings)
                result.counters = counters.spent(before, await counters.read(http, url))
                stop.set()
        finally:
            for c in clients:
                await c.http.close()
        done = [r.t_done for r in result.reqs if r.outcome == "ok" and r.t_done is not None]
        result.slots = poller.summary(done) if poller.available else None
    return result


async def _main(url: str, settings: BurstSettings) -> list[TargetResult]:
    targets = (url, *settings.compare)
    with Steps(len(targets) * (1 + settings.bursts), "bench burst") as steps:
        return [await run_target(target, settings, steps) for target in targets]


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(BurstSettings, args)
    configure_logging(settings.log_level)
    results = asyncio.run(_main(args.url, settings))
    sys.stdout.write(format_table(results, follow=settings.typist == "follow"))
    if settings.json_out is not None:
        data = [{**r.summary(), "bursts": [asdict(b) for b in r.bursts]} for r in results]
        settings.json_out.write_text(json.dumps(data, indent=1))
    if settings.plot is not None:
        from llmproxy.bench.plot import plot_latency

        plot_latency(results, settings.plot)
        sys.stdout.write(f"plot written to {settings.plot}\n")
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "burst",
        help="Emulate editors typing (llm-ls, Continue, llama.vim, twinny, minuet) against a "
        "URL; "
        "--compare two",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", help="Target base URL (the proxy, or a backend directly)")
    add_settings_arguments(parser, BurstSettings)
    parser.set_defaults(func=run)
