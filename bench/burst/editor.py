"""One simulated editor of ``llmproxy bench burst``: its client and its keystroke bursts.

``Client`` is one editor's HTTP client (its own connection pool and identity headers);
``send`` posts the completion for one keystroke and records what came back in a ``Req``.
``run_burst`` types one burst: with an ``abort`` profile every new request cancels the
previous one's task (which closes its connection); with ``serial`` the next request, for
the text as it is then, goes out only when the previous one has finished. The burst's
latency is from its last keystroke to the end of the final completion.

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
        self.headers = {"Content-Type": "application/json", "User-Agent": profile.user_agent}
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
        req.t_sent = time.perf_counter()
        try:
            async with self.http.post(
                self.url + self.profile.route, data=body, headers=self.headers
            ) as resp:
                try:
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
        return bytes(data) if req.outcome == "ok" else b""


def send_times(settings: BurstSettings, start: float) -> list[tuple[int, float]]:
    """(keystroke, when its request goes out) after client-side debounce."""
    iv, db, n = settings.interval_ms / 1000, settings.debounce_ms / 1000, settings.keystrokes
    return [(k, start + k * iv + db) for k in range(n) if k == n - 1 or db < iv]


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
