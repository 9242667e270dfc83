"""One simulated editor of ``llmproxy bench burst``: its client and its keystroke bursts.

``Client`` is one editor's HTTP client (its own connection pool and identity headers);
``send`` posts the completion for one keystroke and records what came back in a ``Req``.
``run_burst`` types one burst: with an ``abort`` profile every new request cancels the
previous one's task (which closes its connection); with ``serial`` the next request, for
the text as it is then, goes out only when the previous one has finished. The burst's
latency is from its last keystroke to the end of the final completion.

``run_triggers`` types a burst as minuet-ai.nvim sends it (profile ``trigger``): each
keystroke (re)starts the debounce timer unless the throttle runs; when the timer fires,
every request still running is killed (its connection closed) and ``twins`` identical
requests go out at once. The burst's latency is from its last keystroke to the first of the
last trigger's requests that gave a suggestion (minuet shows each as it arrives).

Every answer is read as the profile's client reads it (``Profile.reads``): the suggestion
it shows, cut or not, and whether it shows the user an error.

``run_follow`` (``--typist follow``) is a user who reads the suggestion and types it: it
asks for a completion, then types the text that came back, one character per keystroke,
each keystroke a request (abandoning the previous as ``run_burst`` does). Each burst
starts from a different text, so no burst can be answered from another's generation.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from llmproxy.bench.burst.profiles import Profile, delivered_text, delivered_tokens, typed_text
from llmproxy.bench.burst.report import Burst, Req, TargetResult
from llmproxy.bench.burst.settings import BurstSettings


class Client:
    """One editor's HTTP client: its own connection pool, its own identity headers."""

    def __init__(self, url: str, profile: Profile, settings: BurstSettings, editor: int) -> None:
        self.url, self.profile, self.settings, self.editor = url, profile, settings, editor
        self.headers = {
            "Content-Type": "application/json",
            "User-Agent": profile.user_agent,
            **dict(profile.headers),
        }
        if settings.editors > 1:
            self.headers["X-LLMProxy-Session"] = f"burst-editor-{editor}"
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=5, sock_read=settings.request_timeout_s
        )
        self.http = aiohttp.ClientSession(timeout=timeout)
        self.extra = json.loads(settings.extra_body) if settings.extra_body else None

    async def send(self, req: Req, keystroke: int, typed: str | None = None) -> bytes:
        """POST the completion for ``keystroke`` (or for the text ``typed``); returns the
        body read (empty unless 200). Cancelling this closes the connection."""
        text = typed_text(keystroke) if typed is None else typed
        body = self.profile.encode(text, self.settings.n_predict, self.settings.model, self.extra)
        data = bytearray()
        complete = False  # the body was read to its end (its terminator included)
        req.t_sent = time.perf_counter()
        try:
            async with self.http.post(
                self.url + self.profile.route, data=body, headers=self.headers
            ) as resp:
                req.status = resp.status
                try:
                    async for chunk in resp.content.iter_any():  # streams read as they arrive
                        data += chunk
                except asyncio.CancelledError:
                    resp.close()  # abandon: drop the connection, as the real client does
                    raise
                complete = True
            req.t_done = time.perf_counter()
            req.outcome = "ok" if resp.status == 200 else "error"
            req.tokens = delivered_tokens(bytes(data)) if resp.status == 200 else 0
        except asyncio.CancelledError:
            req.outcome = "aborted"
            raise
        except (aiohttp.ClientError, TimeoutError):
            req.t_done, req.outcome = time.perf_counter(), "error"
        seen = self.profile.reads(req.status, bytes(data), complete)
        req.shown, req.cut, req.error_shown = seen.text is not None, seen.cut, seen.error_shown
        return bytes(data) if req.outcome == "ok" else b""


def timers(settings: BurstSettings, profile: Profile) -> tuple[float, float, int]:
    """(debounce s, throttle s, requests per trigger): the settings', else the client's own."""
    debounce = profile.debounce_ms if settings.debounce_ms is None else settings.debounce_ms
    throttle = profile.throttle_ms if settings.throttle_ms is None else settings.throttle_ms
    return debounce / 1000, throttle / 1000, settings.twins or profile.twins


def send_times(settings: BurstSettings, start: float) -> list[tuple[int, float]]:
    """(keystroke, when its request goes out) after client-side debounce."""
    iv, n = settings.interval_ms / 1000, settings.keystrokes
    db = (settings.debounce_ms or 0.0) / 1000
    return [(k, start + k * iv + db) for k in range(n) if k == n - 1 or db < iv]


def trigger_times(
    keys: list[float], debounce_s: float, throttle_s: float
) -> list[tuple[int, float]]:
    """(keystroke, when its requests go out) for keystrokes at times ``keys``, as
    minuet-ai.nvim schedules them (virtualtext.lua): a keystroke while the throttle runs is
    ignored; any other restarts the debounce timer; the timer, firing, starts the throttle."""
    out: list[tuple[int, float]] = []
    throttled_until = float("-inf")
    timer: tuple[int, float] | None = None
    for k, t in enumerate(keys):
        if timer is not None and timer[1] <= t:  # it fired before this keystroke
            out.append(timer)
            throttled_until, timer = timer[1] + throttle_s, None
        if t >= throttled_until:
            timer = (k, t + debounce_s)
    if timer is not None:
        out.append(timer)
    return out


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.perf_counter()))


async def run_burst(client: Client, result: TargetResult, burst: int) -> None:
    """Type burst number ``burst`` of this editor; see the module docstring."""
    start = time.perf_counter()
    settings = client.settings
    out = Burst(
        client.editor, burst, start + (settings.keystrokes - 1) * settings.interval_ms / 1000
    )
    result.bursts.append(out)
    final: Req | None = None
    if client.profile.abandon == "abort":
        async with asyncio.TaskGroup() as tg:
            previous: asyncio.Task[bytes] | None = None
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


async def run_triggers(client: Client, result: TargetResult, burst: int) -> None:
    """Type burst number ``burst`` as minuet-ai.nvim; see the module docstring."""
    settings = client.settings
    start, iv = time.perf_counter(), settings.interval_ms / 1000
    debounce, throttle, twins = timers(settings, client.profile)
    keys = [start + k * iv for k in range(settings.keystrokes)]
    out = Burst(client.editor, burst, keys[-1])
    result.bursts.append(out)
    last: list[Req] = []
    async with asyncio.TaskGroup() as tg:
        running: list[asyncio.Task[bytes]] = []
        for k, when in trigger_times(keys, debounce, throttle):
            await _sleep_until(when)
            for task in running:  # the previous trigger's curl jobs, killed
                task.cancel()
            last = [Req(client.editor, burst, k, 0.0) for _ in range(twins)]
            result.reqs.extend(last)
            running = [tg.create_task(client.send(r, k)) for r in last]
    done = [r.t_done for r in last if r.shown and r.t_done is not None]
    if done:
        out.latency_s = min(done) - out.t_last_key


async def run_follow(client: Client, result: TargetResult, burst: int) -> None:
    """One suggestion, then the user types it; see the module docstring."""
    settings = client.settings
    base = typed_text(burst)  # a text of its own per burst
    first = Req(client.editor, burst, 0, 0.0)
    result.reqs.append(first)
    suggestion = delivered_text(await client.send(first, 0, base))
    keys = min(settings.keystrokes, len(suggestion))
    if not keys:  # nothing suggested (or the request failed): nothing to type
        result.empty_suggestions += 1
        return
    start = time.perf_counter()
    out = Burst(client.editor, burst, start + max(0, keys - 1) * settings.interval_ms / 1000)
    result.bursts.append(out)
    final: Req | None = None
    async with asyncio.TaskGroup() as tg:
        previous: asyncio.Task[bytes] | None = None
        for k in range(1, keys + 1):
            await _sleep_until(start + (k - 1) * settings.interval_ms / 1000)
            if previous is not None:
                if client.profile.abandon == "abort":
                    previous.cancel()
                else:
                    await asyncio.wait([previous])
            final = Req(client.editor, burst, k, 0.0)
            result.reqs.append(final)
            previous = tg.create_task(client.send(final, k, base + suggestion[:k]))
    if final is not None and final.outcome == "ok" and final.t_done is not None:
        out.latency_s = final.t_done - max(out.t_last_key, final.t_sent)
