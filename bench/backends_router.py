"""``llmproxy bench backends --server llama-server-router``: llama-server in router mode.

The router (bench/servers.py) serves two models from one GGUF, ``fim`` and ``chat``, each
in a llama-server child of its own that it starts on the model's first request. Two things
are measured, direct and through ``llmproxy serve --upstream ROUTER``:

- editor bursts, as backends.py runs them against llama-server, every request body
  carrying ``"model": "fim"`` (``burst_extra``); ``load`` loads ``fim`` first, so T (one
  idle request) does not include the model's start. Goal: the burst's last completion
  through the proxy <= 1.1 x T. The router does not stop a non-streaming generation whose
  client left, so direct non-streaming bursts queue every abandoned generation.
- completion beside chat (``beside_cell``): a ``BESIDE_TOKENS``-token completion on ``fim``
  alone (idle), then the same completion while a long streaming chat
  (``/v1/chat/completions`` on ``chat``, end token ignored) is decoding. Per repetition
  the four are interleaved (direct idle, direct beside, proxied idle, proxied beside), so
  a drift in the machine's load hits all alike; the medians are compared with the direct
  idle median (the yardstick, as T is for the bursts). Goal: through the proxy <= 1.2 x
  idle. On a machine with fewer cores than the two children's threads they compete for
  CPU, so even direct the ratio is above 1.

Concurrency contract: backends.py owns the router and the proxy (child processes, one of
each at a time); the router owns its model children. Here, each repetition runs one chat
task beside the timed completion in this process's event loop; the chat is cancelled
(its connection closed, which stops a streaming generation) and both models are seen
idle on the router's ``/slots?model=NAME`` before the next request: nothing outlives
``beside_cell``.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from llmproxy.bench.burst.profiles import PROFILES, typed_text
from llmproxy.bench.progress import Steps
from llmproxy.bench.servers import ROUTER_MODELS

FIM, CHAT = ROUTER_MODELS
GOAL_BURST_X_T = 1.1
GOAL_BESIDE_X_IDLE = 1.2
BESIDE_TOKENS = 32
_TIMEOUT = aiohttp.ClientTimeout(total=300)


def burst_extra() -> dict[str, object]:
    """Fields set over Continue's body in the bursts against the router."""
    return {"model": FIM, "ignore_eos": True, "stop": []}


def completion_body(n_predict: int = BESIDE_TOKENS) -> bytes:
    """The completion of the beside-chat scenario: Continue's, non-streaming, on ``fim``."""
    extra = {**burst_extra(), "stream": False}
    return PROFILES["continue"].encode(typed_text(19), n_predict, FIM, extra)


def chat_body(tokens: int) -> bytes:
    """A streaming chat on ``chat`` that generates ``tokens`` tokens (end token ignored)."""
    return json.dumps(
        {
            "model": CHAT,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "stream": True,
            "max_tokens": tokens,
            "ignore_eos": True,
        }
    ).encode()


async def load(http: aiohttp.ClientSession, router: str, model: str) -> None:
    """Load ``model`` on the router with a one-token request (``SystemExit`` if it fails)."""
    body = {"model": model, "prompt": "Hello", "n_predict": 1}
    async with http.post(router + "/completion", json=body, timeout=_TIMEOUT) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise SystemExit(f"llmproxy bench backends: loading {model}: {resp.status} {text}")


async def wait_idle(http: aiohttp.ClientSession, router: str, timeout_s: float = 60) -> None:
    """Until no slot of either model is processing, read from the router's ``/slots``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for model in ROUTER_MODELS:
            async with http.get(f"{router}/slots?model={model}", timeout=_TIMEOUT) as resp:
                slots: Any = await resp.json(content_type=None) if resp.status == 200 else []
            busy = busy or any(isinstance(s, dict) and s.get("is_processing") for s in slots)
        if not busy:
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"llmproxy bench backends: {router} still busy after {timeout_s:g} s")


async def timed_completion(http: aiohttp.ClientSession, url: str, body: bytes) -> float | None:
    """Seconds for the completion ``body`` on ``url`` (None: not a 200 or no answer)."""
    sent = time.perf_counter()
    try:
        async with http.post(
            url + "/completion", data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            await resp.read()
            ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return None
    return time.perf_counter() - sent if ok else None


async def _chat(
    http: aiohttp.ClientSession, url: str, body: bytes, decoding: asyncio.Event
) -> bool:
    """Stream the chat ``body``; ``decoding`` is set at its first content token. True if it
    answered 200."""
    async with http.post(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        async for line in resp.content:
            if line.startswith(b"data:") and b'"content"' in line:
                decoding.set()
        return resp.status == 200


@dataclass
class Side:
    """One target's times: the completion idle and beside the chat."""

    idle_s: list[float] = field(default_factory=list)
    beside_s: list[float] = field(default_factory=list)
    overlapped: int = 0  # repetitions whose chat was still decoding when the completion ended
    errors: int = 0


async def _beside_once(
    http: aiohttp.ClientSession, url: str, router: str, chat_tokens: int, side: Side
) -> None:
    decoding = asyncio.Event()
    chat = asyncio.create_task(_chat(http, url, chat_body(chat_tokens), decoding))
    try:
        started = asyncio.create_task(decoding.wait())
        await asyncio.wait([chat, started], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if not decoding.is_set():
            side.errors += 1
            return
        took = await timed_completion(http, url, completion_body())
        if took is None:
            side.errors += 1
            return
        side.beside_s.append(took)
        side.overlapped += not chat.done()
    finally:
        chat.cancel()  # closes its connection: the router stops a streaming generation
        await asyncio.gather(chat, return_exceptions=True)
        await wait_idle(http, router)


async def _idle_once(http: aiohttp.ClientSession, url: str, side: Side) -> None:
    took = await timed_completion(http, url, completion_body())
    if took is None:
        side.errors += 1
    else:
        side.idle_s.append(took)


async def beside_cell(
    router: str, proxied: str, reps: int, chat_tokens: int, steps: Steps | None = None
) -> dict[str, object]:
    """Completion beside chat, ``reps`` times per target; see the module docstring."""
    direct, through = Side(), Side()
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as http:
        for model in ROUTER_MODELS:
            await load(http, router, model)
        await wait_idle(http, router)
        for url in (router, proxied):  # warm both paths' prompt cache and connections
            await timed_completion(http, url, completion_body())
        for rep in range(reps):
            if steps is not None:
                steps.step(f"completion beside chat {rep + 1}/{reps}")
            for url, side in ((router, direct), (proxied, through)):
                await wait_idle(http, router)
                await _idle_once(http, url, side)
                await wait_idle(http, router)
                await _beside_once(http, url, router, chat_tokens, side)
    return beside_row(direct, through)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000 if times else math.nan


def beside_row(direct: Side, through: Side) -> dict[str, object]:
    idle = _median_ms(direct.idle_s)
    d_beside, p_beside = _median_ms(direct.beside_s), _median_ms(through.beside_s)
    p_x = p_beside / idle
    return {
        "scenario": "completion beside chat",
        "idle_ms": idle,
        "proxied_idle_ms": _median_ms(through.idle_s),
        "direct_beside_ms": d_beside,
        "direct_x_idle": d_beside / idle,
        "proxied_beside_ms": p_beside,
        "proxied_x_idle": p_x,
        "overlapped": f"{direct.overlapped} / {through.overlapped}",
        "direct_errors": direct.errors,
        "proxied_errors": through.errors,
        "goal": bool(p_x <= GOAL_BESIDE_X_IDLE and through.errors == 0),
    }


BESIDE_HEADER = (
    f"\ncompletion beside chat ({BESIDE_TOKENS} tokens on {FIM!r}, a streaming chat on {CHAT!r}; "
    "x idle: over the direct idle median)\n\n"
    "| server | -np | idle ms (direct / proxied) | direct beside ms | x idle "
    "| proxied beside ms | x idle | chat overlapped (direct / proxied) "
    "| errors (direct / proxied) | goal |\n|---|---|---|---|---|---|---|---|---|---|"
)


def beside_line(r: dict[str, object]) -> str:
    return (
        f"| {r['server']} | {r['parallel']} | {r['idle_ms']:.0f} / {r['proxied_idle_ms']:.0f} | "
        f"{r['direct_beside_ms']:.0f} | {r['direct_x_idle']:.2f} | "
        f"{r['proxied_beside_ms']:.0f} | {r['proxied_x_idle']:.2f} | {r['overlapped']} | "
        f"{r['direct_errors']} / {r['proxied_errors']} | {'PASS' if r['goal'] else 'FAIL'} |"
    )


GOALS = (
    f"goals: burst, the last completion through the proxy <= {GOAL_BURST_X_T} x T "
    "(and never longer than direct); "
    f"completion beside chat through the proxy <= {GOAL_BESIDE_X_IDLE} x idle"
)
