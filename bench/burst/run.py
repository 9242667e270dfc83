"""``llmproxy bench burst``: emulate editors typing against any URL and show what the user waits.

Each simulated editor types ``keystrokes`` characters ``interval_ms`` apart (one *burst*)
and asks for a completion per keystroke with the wire behaviour of a real client (see
burst_profiles.py). The number that matters is the latency of the completion the user
actually waited for: from the burst's last keystroke to the end of the response for the
final text. It is compared with one uncontended generation of the same prompt (measured
first, on an idle target). A background poller reads ``GET /slots`` (llama-server, the
embedded backend, also through the proxy) to count the generations the backend really
ran, how many ran at once and how many tokens it decoded, and which of those tokens
went to a generation whose response nobody read (see burst_slots.py). ``--compare URL2`` runs the same
script against a second target and prints both side by side; ``--plot FILE.png`` draws
latency over time (needs matplotlib, the ``plot`` extra).

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
from pathlib import Path
from typing import Literal

import aiohttp
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from llmproxy.bench.burst.profiles import PROFILES, Profile, delivered_tokens, typed_text
from llmproxy.bench.burst.report import Burst, Req, TargetResult, format_table
from llmproxy.bench.burst.slots import SlotsPoller
from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


class BurstSettings(LayeredSettings):
    """Options of ``llmproxy bench burst`` (env ``LLMPROXY_BURST_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_BURST_", frozen=True, extra="forbid")

    profile: Literal["llm-ls", "continue", "llama-vim", "twinny"] = Field(
        "llm-ls", description="Client to emulate"
    )
    keystrokes: int = Field(20, ge=1, description="Keystrokes per burst")
    interval_ms: float = Field(50.0, ge=0, description="Time between keystrokes")
    debounce_ms: float = Field(
        0.0,
        ge=0,
        description="Client-side debounce (a request goes out only after this quiet time)",
    )
    bursts: int = Field(5, ge=1, description="Bursts per editor")
    editors: int = Field(
        1,
        ge=1,
        description="Editors typing at once (each sends its own X-LLMProxy-Session when > 1)",
    )
    n_predict: int = Field(32, ge=1, description="Tokens asked for per completion")
    model: str = Field(
        "",
        description="Model name for the request body (OpenAI/Ollama shapes); empty = ask /v1/models",
    )
    baseline_runs: int = Field(
        3, ge=1, description="Uncontended generations measured first (median = baseline)"
    )
    gap_ms: float = Field(200.0, ge=0, description="Pause between bursts once the backend is idle")
    slots_poll_ms: float = Field(20.0, gt=0, description="GET /slots poll interval")
    poll_slots: bool = Field(
        True,
        description="Count the backend's generations from GET /slots; off where polling disturbs it "
        "(llama-server checks for a dropped non-streaming client only when no result came for a second, and "
        "every /slots answer is a result)",
    )
    idle_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait for the backend to become idle"
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Read timeout per request")
    extra_body: str = Field(
        "",
        description='JSON object whose fields are set in every request body, e.g. \'{"stream": false, "ignore_eos": true}\'',
    )
    compare: str | None = Field(
        None, description="Second target URL: run the same script against it too"
    )
    plot: Path | None = Field(
        None, description="Write a latency-over-time PNG here (needs matplotlib)"
    )
    json_out: Path | None = Field(None, description="Write the results as JSON here")
    log_level: str = Field("warning", description="Log level")

    @field_validator("extra_body")
    @classmethod
    def _json_object(cls, text: str) -> str:
        if text:
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object")
        return text


class Client:
    """One editor's HTTP client: its own connection pool, its own identity headers."""

    def __init__(self, url: str, profile: Profile, settings: BurstSettings, editor: int) -> None:
        self.url, self.profile, self.settings, self.editor = url, profile, settings, editor
        self.headers = {"Content-Type": "application/json", "User-Agent": profile.user_agent}
        if settings.editors > 1:
            self.headers["X-LLMProxy-Session"] = f"burst-editor-{editor}"
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=5, sock_read=settings.request_timeout_s
        )
        self.http = aiohttp.ClientSession(timeout=timeout)
        self.extra = json.loads(settings.extra_body) if settings.extra_body else None

    async def send(self, req: Req, keystroke: int) -> None:
        """POST the completion for ``keystroke``; cancelling this closes the connection."""
        body = self.profile.encode(
            typed_text(keystroke), self.settings.n_predict, self.settings.model, self.extra
        )
        req.t_sent = time.perf_counter()
        try:
            async with self.http.post(
                self.url + self.profile.route, data=body, headers=self.headers
            ) as resp:
                try:
                    data = bytearray()
                    async for chunk in resp.content.iter_any():  # streams read as they arrive
                        data += chunk
                except asyncio.CancelledError:
                    resp.close()  # abandon: drop the connection, as the real client does
                    raise
                req.status = resp.status
            req.t_done = time.perf_counter()
            req.outcome = "ok" if resp.status == 200 else "error"
            req.tokens = delivered_tokens(bytes(data)) if resp.status == 200 else 0
        except asyncio.CancelledError:
            req.outcome = "aborted"
            raise
        except (aiohttp.ClientError, TimeoutError):
            req.t_done, req.outcome = time.perf_counter(), "error"


def send_times(settings: BurstSettings, start: float) -> list[tuple[int, float]]:
    """(keystroke, when its request goes out) after client-side debounce."""
    iv, db, n = settings.interval_ms / 1000, settings.debounce_ms / 1000, settings.keystrokes
    return [(k, start + k * iv + db) for k in range(n) if k == n - 1 or db < iv]


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.perf_counter()))


async def _burst(client: Client, result: TargetResult, burst: int) -> None:
    start = time.perf_counter()
    settings = client.settings
    out = Burst(
        client.editor, burst, start + (settings.keystrokes - 1) * settings.interval_ms / 1000
    )
    result.bursts.append(out)
    final: Req | None = None
    if client.profile.abandon == "abort":
        async with asyncio.TaskGroup() as tg:
            previous: asyncio.Task[None] | None = None
            for k, when in send_times(settings, start):
                await _sleep_until(when)
                if previous is not None:
                    previous.cancel()
                final = Req(client.editor, burst, k, 0.0)
                result.reqs.append(final)
                previous = tg.create_task(client.send(final, k))
    else:  # serial: one at a time, always for the latest text
        schedule = send_times(settings, start)
        sent = -1
        while sent < schedule[-1][0]:
            await _sleep_until(next(t for k, t in schedule if k > sent))
            now = time.perf_counter()
            sent = max(k for k, t in schedule if t <= now)
            final = Req(client.editor, burst, sent, 0.0)
            result.reqs.append(final)
            await client.send(final, sent)
    if final is not None and final.outcome == "ok" and final.t_done is not None:
        out.latency_s = final.t_done - out.t_last_key


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
            for k in (max(0, last - 1), last):
                await _settle(poller, settings)
                req = Req(0, -1, k, 0.0)
                await client.send(req, k)
                if req.outcome != "ok" or req.t_done is None:
                    raise SystemExit(
                        f"llmproxy bench burst: {url}{profile.route} answered {req.status or 'no response'}"
                    )
            if i:
                times.append(req.t_done - req.t_sent)
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


async def run_target(url: str, settings: BurstSettings) -> TargetResult:
    """Baseline, then ``bursts`` bursts per editor against ``url``; see the module docstring."""
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
                baseline = await _baseline(url, profile, settings, poller)
                await _settle(poller, settings)
                poller.reset()  # count the bursts only
                result = TargetResult(url, profile.name, baseline, time.perf_counter())
                for b in range(settings.bursts):
                    await _settle(poller, settings)
                    async with asyncio.TaskGroup() as editors:
                        for c in clients:
                            editors.create_task(_burst(c, result, b))
                await _settle(poller, settings)
                stop.set()
        finally:
            for c in clients:
                await c.http.close()
        done = [r.t_done for r in result.reqs if r.outcome == "ok" and r.t_done is not None]
        result.slots = poller.summary(done) if poller.available else None
    return result


async def _main(url: str, settings: BurstSettings) -> list[TargetResult]:
    results = [await run_target(url, settings)]
    if settings.compare:
        results.append(await run_target(settings.compare, settings))
    return results


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(BurstSettings, args)
    configure_logging(settings.log_level)
    results = asyncio.run(_main(args.url, settings))
    sys.stdout.write(format_table(results))
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
        help="Emulate editors typing (llm-ls, Continue, llama.vim, twinny) against a URL; --compare two",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", help="Target base URL (the proxy, or a backend directly)")
    add_settings_arguments(parser, BurstSettings)
    parser.set_defaults(func=run)
