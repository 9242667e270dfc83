"""The proxy in front of a real llama-server (``make interop``).

- Differential: a non-streaming request answered through the proxy (sent upstream as a
  stream, assemble.py) equals llama-server's own non-streaming answer to the same request,
  field for field except the timings (and OpenAI's ``created`` and random ``id``).
- A cancelled non-streaming generation stops within a few tokens, and only because the
  proxy streams it: with ``upstream_stream=off`` llama-server runs it to its end.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import pytest
import structlog

from tests.helpers.interop import LlamaServer
from tests.helpers.net import wait_until
from tests.helpers.proxy import request_events, run_proxy

PREFIX = (
    'def fibonacci(n: int) -> int:\n    """The n-th Fibonacci number."""\n'
    "    if n < 2:\n        return n\n"
)
LLAMA_VIM = {
    "id_slot": 0,
    "input_prefix": PREFIX,
    "input_suffix": "\n\nprint(fibonacci(10))\n",
    "input_extra": [
        {"text": "import math\n", "time": [1738000000, 123456], "filename": "src/util.py"}
    ],
    "prompt": "    retu",
    "n_predict": 24,
    "stop": [],
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"],
    "stream": False,
    "cache_prompt": True,
    "seed": 3,
    "t_max_prompt_ms": 5000,
    "t_max_predict_ms": 5000,
    "response_fields": [
        "content",
        "timings/prompt_n",
        "timings/predicted_n",
        "truncated",
        "tokens_cached",
        "generation_settings/stream",
    ],
}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/completion", {"prompt": PREFIX, "n_predict": 24, "seed": 7}),
    (
        "/completion",
        {"prompt": PREFIX, "n_predict": 48, "seed": 7, "stop": ["\n"], "stream": False},
    ),
    ("/completion", {"prompt": PREFIX, "n_predict": 16, "seed": 7, "n_cmpl": 2}),
    ("/completions", {"prompt": PREFIX + "ü€ 😀", "n_predict": 16, "seed": 9}),
    ("/infill", LLAMA_VIM),
    (
        "/infill",
        {"input_prefix": PREFIX, "input_suffix": "\n", "prompt": "", "n_predict": 16, "seed": 5},
    ),
    ("/v1/completions", {"prompt": PREFIX, "max_tokens": 24, "seed": 7}),
    ("/v1/completions", {"prompt": PREFIX, "max_tokens": 12, "seed": 7, "n": 2, "stop": ["\n\n"]}),
    (
        "/completion",
        {"prompt": "word " * 3000, "n_predict": 4},
    ),  # over the slot's context: an error
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 24, "seed": 3},
    ),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "seed": 5},
    ),
]
VARYING = {"timings", "created", "id"}


def normalised(body: Any) -> Any:
    """The body without what differs between any two runs of the same request."""
    if isinstance(body, list):
        return [normalised(b) for b in body]
    if not isinstance(body, dict):
        return body
    return {
        k: normalised(v)
        for k, v in body.items()
        if k not in VARYING and not k.startswith("timings/")
    }


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, str, bytes]:
    async with http.post(url, data=json.dumps(body, separators=(",", ":"))) as r:
        return r.status, r.headers["Content-Type"], await r.read()


@pytest.mark.parametrize(
    ("route", "body"), CASES, ids=[f"{r}-{i}" for i, (r, _) in enumerate(CASES)]
)
async def test_non_streaming_answer_through_the_proxy_matches_llama_server(
    llama_server: LlamaServer, fim_gguf: Any, route: str, body: dict[str, Any]
) -> None:
    async with (
        llama_server(parallel=2, model=fim_gguf) as srv,
        run_proxy(srv.url) as px,
        aiohttp.ClientSession() as http,
    ):
        direct_body = {
            **body,
            "id_slot": 0,
        }  # what the proxy sends: its permit's slot, 0 when all are free
        await post(http, srv.url + route, direct_body)  # the same prompt cache state for both
        status, ctype, direct = await post(http, srv.url + route, direct_body)
        p_status, p_ctype, proxied = await post(http, px.url + route, body)
        px.flush_log()
        assert (p_status, p_ctype) == (status, ctype)
        assert normalised(json.loads(proxied)) == normalised(json.loads(direct))
        if status == 200:
            assert px.member.gate.free == 2
            assert (
                b'"content":"' in proxied or b'"text":"' in proxied
            )  # compact, as llama.vim matches it
            if isinstance(json.loads(direct), dict):  # in its key order
                assert list(json.loads(proxied)) == list(json.loads(direct))
            assert b'": ' not in proxied.replace(b'\\"', b"")


async def slot_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/slots") as r:
        return (await r.json())[0]


def decoded(state: dict[str, Any]) -> int:
    """Tokens the slot's current (or last) task decoded; 0 before its first task."""
    return state.get("next_token", [{}])[0].get("n_decoded", 0)


async def decoded_when_idle_after_disconnect(srv_url: str, px_url: str) -> tuple[int, int, float]:
    """Start a long non-streaming generation through the proxy, drop the client once it has
    decoded a few tokens; (tokens decoded at the drop, at idle, seconds to idle)."""
    body = {"prompt": PREFIX, "n_predict": 200, "ignore_eos": True, "seed": 1}
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(post(http, px_url + "/completion", body))
        deadline = time.monotonic() + 300
        while decoded(state := await slot_state(http, srv_url)) < 8 or not state["is_processing"]:
            assert time.monotonic() < deadline, "generation never started"
            await asyncio.sleep(0.01)
        at_drop, dropped = decoded(state), time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while (state := await slot_state(http, srv_url))["is_processing"]:
            assert time.monotonic() < deadline, "generation never stopped"
            await asyncio.sleep(0.01)
        return at_drop, decoded(state), time.monotonic() - dropped


@pytest.mark.parametrize("parallel", [1, 4])
async def test_a_dropped_non_streaming_client_stops_its_generation_within_a_few_tokens(
    llama_server: LlamaServer,
    parallel: int,
) -> None:
    async with llama_server(parallel=parallel) as srv:
        # upstream_stream=off: sent to llama-server as a non-streaming request
        async with run_proxy(srv.url, upstream_stream="off") as px:
            _, _, off_s = await decoded_when_idle_after_disconnect(srv.url, px.url)
            assert srv.stopped_tasks() == 0  # llama-server never noticed: it ran to the end
        # reuse_grace_s=0: with type-through a generation whose client left runs that long
        # for the next keystroke to continue it; this measures the stop that follows
        async with run_proxy(srv.url, reuse_grace_s=0) as px:
            at_drop, _, streamed_s = await decoded_when_idle_after_disconnect(srv.url, px.url)
            assert srv.stopped_tasks() == 1
            await wait_until(lambda: px.member.gate.free == parallel, 10, what="all permits free")
    # llama-server's log: "release: ... stop processing: n_tokens = N", N = prompt + generated
    ran_off, ran_streamed = [
        int(n) for n in re.findall(r"stop processing: n_tokens = (\d+)", srv.log_text())
    ]
    prompt = ran_off - 200  # the first ran to its end: all 200 tokens
    assert ran_streamed - prompt - at_drop <= 4, (ran_streamed - prompt, at_drop)
    assert off_s > 10 * streamed_s, (off_s, streamed_s)


async def test_a_long_prompt_cancelled_before_its_answer_never_runs_after_its_permit_came_back(
    llama_server: LlamaServer,
) -> None:
    """llama-server reads the body, tokenizes the prompt and queues the task before the slot
    shows it busy: a stop confirmed by idle polls alone could hand the slot on while the task
    is still on its way. The proxy cuts a stream only once its head arrived (the task runs)."""
    prompt = " ".join(f"word{i}" for i in range(1800))  # about 7000 tokens: a long tokenization
    violations: list[tuple[float, float]] = []
    async with (
        llama_server(parallel=1, ctx_per_slot=8192) as srv,
        run_proxy(srv.url, confirm_timeout_s=600) as px,
        aiohttp.ClientSession() as http,
    ):
        with structlog.testing.capture_logs() as logs:

            def ended() -> int:
                """Requests the proxy is done with: handler and upstream job both ended."""
                px.flush_log()
                return len(request_events(logs))

            delays = [0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.015, 0.02] * 2
            for n, delay in enumerate(delays, start=1):
                request = asyncio.create_task(
                    post(http, px.url + "/completion", {"prompt": prompt, "n_predict": 8})
                )
                await asyncio.sleep(delay)  # the next keystroke, this long after the request
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
                # the proxy may not have seen the client leave yet (a permit still free then
                # says nothing): wait for its request's end, the permit back with it
                await wait_until(lambda n=n: ended() == n, 120, what="the request's end")
                assert px.member.gate.free == 1
                await _no_task_after_release(http, srv.url, delay, violations)
    assert violations == []


async def _no_task_after_release(
    http: aiohttp.ClientSession, url: str, delay: float, violations: list[tuple[float, float]]
) -> None:
    """Does the slot turn busy in the half second after the permit came back?"""
    released = time.monotonic()
    while time.monotonic() - released < 0.5:
        if (await slot_state(http, url))["is_processing"]:
            violations.append((delay, time.monotonic() - released))
            return
        await asyncio.sleep(0.02)


async def test_back_to_back_requests_after_streams_all_succeed(llama_server: LlamaServer) -> None:
    """llama-server closes a connection after an event stream although it says keep-alive:
    the proxy does not reuse such a connection, so a request sent right after a stream
    never fails with 502 (ServerDisconnectedError)."""
    async with (
        llama_server(parallel=1) as srv,
        run_proxy(srv.url) as px,
        aiohttp.ClientSession() as http,
    ):
        statuses = []
        for stream in (True, True, False, False, True, False, True):
            body = {"prompt": PREFIX, "n_predict": 2, "stream": stream}
            async with http.post(px.url + "/completion", json=body) as r:
                await r.read()
                statuses.append(r.status)
        assert statuses == [200] * 7


async def test_a_slot_whose_stop_timed_out_gets_no_request_until_llama_server_shows_it_idle(
    llama_server: LlamaServer,
) -> None:
    """A cancelled long prompt keeps llama-server's slot busy for its whole prompt evaluation;
    a confirmation that gives up before then quarantines the slot, and the next request waits
    in the proxy, not in llama-server's own queue."""
    prompt = " ".join(
        f"word{i}" for i in range(800)
    )  # about 3,000 tokens: seconds of prompt evaluation
    async with (
        llama_server(parallel=1, ctx_per_slot=8192) as srv,
        run_proxy(srv.url, confirm_timeout_s=0.2, queue_timeout_s=600) as px,
        aiohttp.ClientSession() as http,
    ):
        first = asyncio.create_task(
            post(http, px.url + "/completion", {"prompt": prompt, "n_predict": 8})
        )
        # llama-server's /slots, another process: there is nothing to wait on but polls
        while not (await slot_state(http, srv.url))["is_processing"]:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await wait_until(lambda: px.member.gate.quarantined == [0], 30, what="slot 0 quarantined")
        second = asyncio.create_task(
            post(http, px.url + "/completion", {"prompt": "def f(x):", "n_predict": 4})
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, 10, what="one request queued")
        busy_while_queued = 0
        while px.member.gate.quarantined:  # llama-server still evaluates the cancelled prompt
            busy_while_queued += (await slot_state(http, srv.url))["is_processing"]
            assert not second.done()
            assert (
                px.member.gate.quarantined == [] or len(px.state.pool.queue) == 1
            )  # waits here, not upstream
            await asyncio.sleep(0.05)
        status, _, _ = await asyncio.wait_for(second, 120)
        assert status == 200 and busy_while_queued > 0


async def test_an_embedding_holds_the_slot_it_runs_on(llama_server: LlamaServer) -> None:
    """llama-server runs /embedding on a slot: while it does, a completion waits in the
    proxy's queue, not inside llama-server on a slot the gate believed free."""
    text = " ".join(f"word{i}" for i in range(400))  # about 1,500 tokens to embed
    flags = ("--embeddings", "--pooling", "mean", "-b", "2048", "-ub", "2048")
    async with (
        llama_server(parallel=1, extra=flags) as srv,
        run_proxy(srv.url) as px,
        aiohttp.ClientSession() as http,
    ):
        embedding = asyncio.create_task(post(http, px.url + "/embedding", {"content": text}))
        await wait_until(lambda: px.member.gate.free == 0, 30, what="the permit taken")
        completion = asyncio.create_task(
            post(http, px.url + "/completion", {"prompt": "def f(x):", "n_predict": 4})
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, 10, what="one request queued")
        assert (await slot_state(http, srv.url))["is_processing"] or embedding.done()
        assert (await embedding)[0] == 200
        assert (await asyncio.wait_for(completion, 120))[0] == 200
        assert px.member.gate.free == 1
