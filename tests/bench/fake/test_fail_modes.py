"""The fake upstream's scripted failures, over real loopback HTTP.

An error status answered at once, a connection reset mid-body, hangs that last until the
client leaves or ``stop()`` runs, malformed JSON, and ``wait_for``'s timeout message.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.fake import sse_events


async def test_scripted_status_answers_error_at_once(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(script=lambda _p, _b: Script(status=503, token_delay_s=10)) as up:
        async with session.post(up.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 503 and isinstance((await r.json())["error"]["message"], str)
        assert up.max_concurrent == 0 and up.completed == [0]


@pytest.mark.parametrize("stream", [False, True])
async def test_reset_mid_stream(session: aiohttp.ClientSession, stream: bool) -> None:
    async with FakeUpstream(
        script=lambda _p, _b: Script(fail="reset_mid_stream", token_delay_s=0)
    ) as up:
        async with session.post(
            up.url + "/completion", json={"prompt": "x", "stream": stream}
        ) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
        await up.wait_for(lambda u: u.failed == [0] and u.concurrent == 0)
        assert up.completed == [] and up.slot_busy == [False]


@pytest.mark.parametrize("fail", ["hang_before_headers", "hang_mid_body"])
async def test_hang_until_client_leaves(session: aiohttp.ClientSession, fail: str) -> None:
    async with FakeUpstream(
        abort_linger_s=0, script=lambda _p, _b: Script(fail=fail, token_delay_s=0)
    ) as up:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=0.3)
        with pytest.raises(TimeoutError):
            async with session.post(
                up.url + "/completion", json={"stream": True}, timeout=timeout
            ) as r:
                assert (
                    await r.content.readline()
                    == b'data: {"index":0,"content":"t0 ","id_slot":0,"stop":false}\n'
                )
                assert await r.content.readline() == b"\n"
                await r.content.readline()
        await up.wait_for(lambda u: u.aborted == [0] and u.concurrent == 0)


async def test_stop_releases_hanging_request(session: aiohttp.ClientSession) -> None:
    up = FakeUpstream(script=lambda _p, _b: Script(fail="hang_before_headers"))
    await up.start()
    req = asyncio.create_task(session.post(up.url + "/completion", json={}))
    await up.wait_for(lambda u: u.concurrent == 1)
    async with asyncio.timeout(3):
        await up.stop()
    with pytest.raises(aiohttp.ClientError):
        await req


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed(session: aiohttp.ClientSession, stream: bool) -> None:
    async with FakeUpstream(script=lambda _p, _b: Script(fail="malformed", token_delay_s=0)) as up:
        async with session.post(up.url + "/completion", json={"stream": stream}) as r:
            raw = await r.read()
        pieces = sse_events(raw) if stream else [raw.decode()]
        with pytest.raises(json.JSONDecodeError):
            [json.loads(p) for p in pieces]
        assert up.completed == [0]


async def test_wait_for_timeout_explains_state() -> None:
    async with FakeUpstream() as up:
        with pytest.raises(TimeoutError, match="never_true.*concurrent"):

            def never_true(u: FakeUpstream) -> bool:
                return False

            await up.wait_for(never_true, timeout=0.05)


@pytest.mark.parametrize("stream", [False, True])
async def test_error_event(session: aiohttp.ClientSession, stream: bool) -> None:
    """llama-server's way of failing a started stream: an error event, then the end."""
    async with FakeUpstream(
        script=lambda _p, _b: Script(tokens=6, fail="error_event", token_delay_s=0)
    ) as up:
        async with session.post(
            up.url + "/completion", json={"prompt": "x", "stream": stream}
        ) as r:
            body = await r.read()
        if stream:
            assert r.status == 200
            events = [json.loads(b[6:]) for b in body.split(b"\n\n") if b.startswith(b"data: ")]
            assert [e["content"] for e in events[:-1]] == ["t0 ", "t1 ", "t2 "]
            assert events[-1]["error"]["code"] == 500
        else:
            assert r.status == 500 and json.loads(body)["error"]["code"] == 500
        await up.wait_for(lambda u: u.concurrent == 0)
        assert up.slot_busy == [False]
