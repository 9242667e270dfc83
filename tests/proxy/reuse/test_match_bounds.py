"""The type-through matcher's work is linear in the request (reuse/match.py).

The hostile pair: a prompt of 8,000 ``a``s, then one of megabytes of ``a``s. Every place
in the run of ``a``s was a candidate cursor, each giving a slice as long as the whole
insertion: quadratic work on the event loop (a 2 MB prompt stalled the proxy 5 s). Now
an insertion longer than ``MAX_TYPED`` is no continuation, and the common prefix and
suffix are found at C speed. The proxy's loop must keep answering while such requests go
through it: ``/llmproxy/health`` is asked during the hostile exchange.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.reuse.match import MAX_TYPED, typed
from tests.helpers.net import raw_exchange
from tests.helpers.proxy import run_proxy


def _completion(prompt: str) -> dict[str, object]:
    return {"prompt": prompt, "n_predict": 8}


def test_an_insertion_beyond_the_bound_is_no_continuation() -> None:
    old = _completion("a" * 8000)
    assert typed("/completion", old, _completion("a" * (8000 + MAX_TYPED))) == ("a" * MAX_TYPED,)
    assert typed("/completion", old, _completion("a" * (8001 + MAX_TYPED))) == ()
    infill = {"input_prefix": "x" * 8000, "prompt": "", "input_suffix": ""}
    longer = {**infill, "prompt": "y" * (MAX_TYPED + 1)}
    assert typed("/infill", infill, longer) == ()


def test_the_hostile_pair_is_matched_in_linear_time() -> None:
    """Not a speed goal (that is the benchmark's): a bound a hundred times above what the
    linear matcher takes, far below the quadratic one's minutes."""
    old = _completion("a" * 8000)
    for size in (2_000_000, 8_000_000):
        t0 = time.perf_counter()
        assert typed("/completion", old, _completion("a" * size)) == ()
        assert time.perf_counter() - t0 < 1.0
    # the longest allowed insertion into megabytes of one letter: one candidate, found fast
    big = "a" * 4_000_000
    t0 = time.perf_counter()
    assert typed("/completion", _completion(big), _completion(big + "a" * MAX_TYPED)) == (
        "a" * MAX_TYPED,
    )
    # a random-looking period: MAX_TYPED distinct rotations at the most
    d = "".join(chr(0x4E00 + (i * 7919) % 2000) for i in range(MAX_TYPED))
    options = typed("/completion", _completion(d), _completion(d + d))
    assert len(options) == MAX_TYPED and len(set(options)) == MAX_TYPED
    assert time.perf_counter() - t0 < 2.0


async def test_the_proxy_answers_health_while_a_hostile_keystroke_is_matched() -> None:
    script = lambda _p, _b: Script(tokens=2, token_delay_s=0.001)  # noqa: E731
    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script) as fake,
        run_proxy(fake.url, max_body_bytes=8 * 1024 * 1024) as px,
        aiohttp.ClientSession() as http,
    ):
        session = {"X-LLMProxy-Session": "editor"}
        async with http.post(
            px.url + "/completion", json=_completion("a" * 8000), headers=session
        ) as r:
            assert r.status == 200
        # under the fake upstream's 1 MiB body limit; quadratic: 8,001 slices of 900 kB
        body = json.dumps(_completion("a" * 900_000)).encode()
        head = (
            "POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nX-LLMProxy-Session: editor\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        hostile = asyncio.create_task(raw_exchange(px.url, head + body))
        # the loop stays free: health answers while the hostile request is read and matched
        # (the quadratic matcher held the loop for minutes with this pair)
        slowest, done = 0.0, 0
        while not hostile.done():
            t0 = time.perf_counter()
            async with http.get(px.url + "/llmproxy/health") as r:
                assert r.status == 200
            slowest, done = max(slowest, time.perf_counter() - t0), done + 1
        assert (await hostile).startswith(b"HTTP/1.1 200"), (await hostile)[:300]
        assert done >= 1 and slowest < 1.0, (done, slowest)
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
