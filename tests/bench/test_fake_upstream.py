"""Tests of the fake LLM upstream (bench/fake/upstream.py) over real loopback HTTP.

The proxy's tests rely on this fake to tell the truth about what reached the backend, so
its shapes, slot accounting, abort recording and fail modes are checked here first.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.loadgen import run_load
from llmproxy.common.children import child_preexec

TEXT8 = "".join(f"t{i} " for i in range(8))


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


def by_prompt(scripts: dict[str, Script]) -> Callable[[str, dict[str, Any]], Script]:
    """A script chosen by the request's "prompt" field (default Script() otherwise)."""
    return lambda _path, body: scripts.get(str(body.get("prompt")), Script())


def sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


# ----------------------------------------------------------------------------- llamacpp
async def test_llamacpp_info_routes(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(slots=3) as up:
        async with session.get(up.url + "/health") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}
        async with session.get(up.url + "/props") as r:
            assert (await r.json())["total_slots"] == 3
        async with session.get(up.url + "/slots") as r:
            slots = await r.json()
        assert [s["id"] for s in slots] == [0, 1, 2]
        assert all(s["is_processing"] is False and s["next_token"]["n_decoded"] == 0 for s in slots)
        async with session.get(up.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "fake"
        async with session.get(up.url + "/api/version") as r:
            assert r.status == 404
        assert [r.path for r in up.received] == [
            "/health",
            "/props",
            "/slots",
            "/v1/models",
            "/api/version",
        ]
        assert up.generations == []


async def test_completion_nonstream_compact_and_recorded(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream() as up:
        payload = {"prompt": "x", "n_predict": 128, "id_slot": 0}
        async with session.post(
            up.url + "/infill", json=payload, headers={"User-Agent": "curl/8"}
        ) as r:
            raw = await r.read()
            assert r.status == 200 and r.content_type == "application/json"
        assert b"\n" not in raw and f'"content":"{TEXT8}"'.encode() in raw  # llama.vim's regex
        obj = json.loads(raw)
        assert obj["stop"] is True and obj["tokens_predicted"] == 8 and obj["id_slot"] == 0
        [rec] = up.received
        assert (rec.path, rec.body, rec.headers["User-Agent"], rec.id) == (
            "/infill",
            payload,
            "curl/8",
            0,
        )
        assert (
            rec.headers.get("user-agent") == "curl/8"
            and "USER-AGENT" in rec.headers
            and "x-missing" not in rec.headers
        )
        assert json.loads(rec.raw) == payload
        await up.wait_for(lambda u: u.concurrent == 0)
        assert (up.completed, up.aborted, up.max_concurrent, up.slot_busy) == ([0], [], 1, [False])


async def test_n_predict_caps_tokens_warmup_answers_empty(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(script=lambda _p, _b: Script(tokens=50, token_delay_s=1.0)) as up:
        async with session.post(up.url + "/infill", json={"prompt": "", "n_predict": 0}) as r:
            obj = await r.json()
        assert obj["content"] == "" and obj["tokens_predicted"] == 0


async def test_completion_stream_chunk_by_chunk(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(script=lambda _p, _b: Script(tokens=5, token_delay_s=0.1)) as up:
        async with session.post(up.url + "/completion", json={"prompt": "x", "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            first = await r.content.readline()
            assert first == b'data: {"index":0,"content":"t0 ","id_slot":0,"stop":false}\n'
            assert up.completed == [] and up.slot_busy == [True]  # still generating
            raw = first + await r.read()
        events = [json.loads(e) for e in sse_events(raw)]
        assert [e["content"] for e in events] == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 ", ""]
        assert [e["stop"] for e in events] == [False] * 5 + [True]
        assert events[-1]["tokens_predicted"] == 5
        await up.wait_for(lambda u: u.completed == [0] and u.concurrent == 0)


async def test_oai_routes_nonstream_and_stream(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(kind="openai") as up:
        async with session.post(up.url + "/v1/completions", json={"prompt": "x"}) as r:
            obj = await r.json()
        assert obj["object"] == "text_completion"
        assert obj["choices"][0]["text"] == TEXT8 and obj["choices"][0]["finish_reason"] == "length"
        async with session.post(
            up.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 3}
        ) as r:
            obj = await r.json()
        assert obj["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 "}
        for path, key in (("/v1/completions", "text"), ("/v1/chat/completions", "delta")):
            async with session.post(up.url + path, json={"stream": True, "max_tokens": 2}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(await r.read())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
            texts = [c["choices"][0][key] for c in chunks[:2]]
            assert texts == (
                ["t0 ", "t1 "]
                if key == "text"
                else [{"role": "assistant", "content": f"t{i} "} for i in range(2)]
            )
        for path in ("/props", "/slots", "/health", "/completion"):
            async with session.request(
                "GET" if path != "/completion" else "POST", up.url + path, json={}
            ) as r:
                assert r.status == 404, path
        assert len(up.completed) == 4


async def test_ollama_ndjson(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(kind="ollama") as up:
        async with session.get(up.url + "/api/version") as r:
            assert "version" in await r.json()
        async with session.get(up.url + "/api/tags") as r:
            assert (await r.json())["models"][0]["name"] == "fake:latest"
        async with session.get(up.url + "/props") as r:
            assert r.status == 404
        async with session.post(
            up.url + "/api/generate", json={"model": "fake", "prompt": "x"}
        ) as r:
            assert r.headers["Content-Type"] == "application/x-ndjson"
            raw = await r.read()
        assert raw.endswith(b"\n")
        lines = [json.loads(line) for line in raw.decode().splitlines()]
        assert "".join(line["response"] for line in lines) == TEXT8
        assert [line["done"] for line in lines] == [False] * 8 + [True]
        async with session.post(
            up.url + "/api/chat", json={"stream": False, "options": {"num_predict": 2}}
        ) as r:
            obj = await r.json()
        assert obj["message"]["content"] == "t0 t1 " and obj["done"] is True


# ----------------------------------------------------------------------------- slots
async def test_id_slot_busy_defers_while_other_slot_free(session: aiohttp.ClientSession) -> None:
    scripts = {
        "slow": Script(tokens=1, token_delay_s=0.5),
        "fast": Script(tokens=1, token_delay_s=0),
    }
    async with FakeUpstream(slots=2, script=by_prompt(scripts)) as up:
        url = up.url + "/completion"
        a = asyncio.create_task(session.post(url, json={"prompt": "slow", "id_slot": 0}))
        await up.wait_for(lambda u: u.slot_busy == [True, False])
        b = asyncio.create_task(session.post(url, json={"prompt": "fast", "id_slot": 0}))
        await up.wait_for(lambda u: len(u.received) == 2)
        assert up.concurrent == 2 and up.slot_busy == [True, False]  # b waits for slot 0
        async with session.post(
            url, json={"prompt": "fast", "id_slot": -1}
        ) as r:  # any slot: runs now
            assert (await r.json())["id_slot"] == 1
        assert up.completed == [2]
        ra, rb = await a, await b
        assert (await ra.json())["id_slot"] == 0 and (await rb.json())["id_slot"] == 0
        ra.release(), rb.release()
        assert up.completed == [2, 0, 1] and up.max_concurrent == 3


async def test_n_cmpl_runs_on_that_many_slots_at_once(session: aiohttp.ClientSession) -> None:
    """llama-server's n_cmpl: id_slot's slot plus the lowest other idle ones, launched only
    when all are idle (the request is deferred until then), k generations in ``concurrent``."""
    scripts = {
        "slow": Script(tokens=2, token_delay_s=0.3),
        "fast": Script(tokens=2, token_delay_s=0),
    }
    async with FakeUpstream(slots=3, script=by_prompt(scripts), abort_linger_s=0.3) as up:
        url = up.url + "/infill"
        async with session.post(url, json={"prompt": "fast", "id_slot": 2, "n_cmpl": 2}) as r:
            both = await r.json()
        assert [(c["index"], c["id_slot"], c["content"]) for c in both] == [
            (0, 2, "t0 t1 "),
            (1, 0, "t0 t1 "),
        ]
        assert up.max_concurrent == 2 and up.deferred == []
        a = asyncio.create_task(session.post(url, json={"prompt": "slow", "id_slot": 1}))
        await up.wait_for(lambda u: u.slot_busy == [False, True, False])
        b = asyncio.create_task(
            session.post(url, json={"prompt": "fast", "id_slot": 0, "n_cmpl": 3})
        )
        await up.wait_for(lambda u: len(u.received) == 3)
        assert (
            up.slot_busy == [False, True, False] and up.concurrent == 4
        )  # all or nothing: b waits
        assert up.deferred == [2]
        rb = await b
        assert up.completed == [0, 1, 2] and [c["id_slot"] for c in await rb.json()] == [0, 1, 2]
        (await a).release()
        async with session.post(url, json={"prompt": "x", "n_cmpl": 4}) as r:  # more than the slots
            assert r.status == 400 and "n_cmpl" in (await r.json())["error"]["message"]
        async with session.post(up.url + "/v1/completions", json={"prompt": "fast", "n": 2}) as r:
            assert [c["index"] for c in (await r.json())["choices"]] == [0, 1]
        async with session.post(url, json={"prompt": "fast", "n_cmpl": 2, "stream": True}) as r:
            events = [json.loads(e) for e in sse_events(await r.read())]
        assert [(e["index"], e["content"], e["stop"]) for e in events] == [
            (0, "t0 ", False),
            (1, "t0 ", False),
            (0, "t1 ", False),
            (1, "t1 ", False),
            (0, "", True),
            (1, "", True),
        ]
        r = await session.post(url, json={"prompt": "slow", "n_cmpl": 2, "stream": True})
        await r.content.readline()
        r.close()  # an abort keeps every slot of the request busy for the linger
        await up.wait_for(lambda u: len(u.aborted) == 1)
        assert up.slot_busy == [True, True, False] and up.concurrent == 2
        await up.wait_for(lambda u: u.slot_busy == [False, False, False] and u.concurrent == 0)


async def test_max_concurrent_counts_waiting_generations(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(
        slots=2, script=lambda _p, _b: Script(tokens=4, token_delay_s=0.05)
    ) as up:

        async def one() -> str:
            async with session.post(up.url + "/completion", json={"prompt": "x"}) as r:
                return (await r.json())["content"]

        assert await asyncio.gather(*(one() for _ in range(5))) == ["t0 t1 t2 t3 "] * 5
        assert (
            up.max_concurrent == 5 and up.concurrent == 0 and sorted(up.completed) == list(range(5))
        )
        for _ in range(3):
            await one()
        assert up.max_concurrent == 5


async def test_abort_keeps_slot_busy_for_linger_then_idle(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(
        abort_linger_s=0.4, script=lambda _p, _b: Script(tokens=100, token_delay_s=0.05)
    ) as up:
        r = await session.post(up.url + "/completion", json={"prompt": "x", "stream": True})
        await r.content.readline()
        r.close()  # the client goes away mid-generation
        await up.wait_for(lambda u: u.aborted == [0])
        t_abort = time.monotonic()
        async with session.get(up.url + "/slots") as s:
            [slot] = await s.json()
        assert (
            slot["is_processing"] is True
            and slot["id_task"] == 0
            and slot["next_token"]["n_decoded"] >= 1
        )
        assert up.concurrent == 1 and up.slot_busy == [True]
        await up.wait_for(lambda u: u.slot_busy == [False])
        assert time.monotonic() - t_abort > 0.2
        assert (up.concurrent, up.completed, up.max_concurrent) == (0, [], 1)


async def test_nonstream_abort_and_waiting_request_abort(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(
        abort_linger_s=0.1, script=lambda _p, _b: Script(tokens=100, token_delay_s=0.05)
    ) as up:
        t1 = asyncio.create_task(session.post(up.url + "/completion", json={"prompt": "x"}))
        await up.wait_for(lambda u: u.slot_busy == [True])
        t2 = asyncio.create_task(session.post(up.url + "/completion", json={"prompt": "y"}))
        await up.wait_for(lambda u: u.concurrent == 2)
        t2.cancel()  # waiting for the slot: aborts without lingering anywhere
        await up.wait_for(lambda u: u.aborted == [1] and u.concurrent == 1)
        t1.cancel()
        await up.wait_for(lambda u: u.aborted == [1, 0] and u.slot_busy == [True])
        await up.wait_for(lambda u: u.concurrent == 0 and u.slot_busy == [False])
        for t in (t1, t2):
            with pytest.raises(asyncio.CancelledError):
                await t


async def test_slots_endpoint_disabled_501(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(slots_endpoint=False) as up:
        async with session.get(up.url + "/slots") as r:
            assert r.status == 501 and "message" in (await r.json())["error"]
        async with session.get(up.url + "/props") as r:
            assert (await r.json())["total_slots"] == 1


# ----------------------------------------------------------------------------- failures
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


# ----------------------------------------------------------------------------- helpers
async def test_wait_for_timeout_explains_state() -> None:
    async with FakeUpstream() as up:
        with pytest.raises(TimeoutError, match="never_true.*concurrent"):

            def never_true(u: FakeUpstream) -> bool:
                return False

            await up.wait_for(never_true, timeout=0.05)


async def test_loadgen_against_fake() -> None:
    async with FakeUpstream(slots=4, script=lambda _p, _b: Script(tokens=3, token_delay_s=0)) as up:
        body = json.dumps({"prompt": "x", "stream": True}).encode()
        res = await run_load(
            up.url + "/completion",
            body,
            requests=40,
            warmup=5,
            concurrency=4,
            duration_s=30,
            stream=True,
            headers=lambda w: {"X-LLMProxy-Session": f"s{w}"},
        )
        assert (res.ok, res.errors, res.capped) == (40, 0, False)
        assert len(up.completed) == 45 and 1 < up.max_concurrent <= 4
        assert {r.headers["X-LLMProxy-Session"] for r in up.received} == {"s0", "s1", "s2", "s3"}
        assert 0 < res.percentile_ms(50) <= res.percentile_ms(99) and res.rps > 0


def test_subprocess_entry(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmproxy.bench.fake.upstream",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--slots",
            "3",
            "--tokens",
            "2",
            "--token-delay-ms",
            "0",
        ],
        preexec_fn=child_preexec(),
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        port = int(port_file.read_text())

        async def check() -> None:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/props") as r:
                    assert (await r.json())["total_slots"] == 3
                async with s.post(f"http://127.0.0.1:{port}/completion", json={}) as r:
                    assert (await r.json())["content"] == "t0 t1 "

        asyncio.run(check())
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_overhead_bench_direct_half() -> None:
    """The overhead bench's own plumbing: fake upstream child, load, table (no proxy)."""
    from llmproxy.bench.child import cpu_seconds
    from llmproxy.bench.overhead.run import OverheadSettings, _bench, format_table

    settings = OverheadSettings(
        requests=20, warmup=2, concurrency=[1, 3], proxy=False, tokens=4, token_delay_ms=[1.0, 0.0]
    )
    cases = asyncio.run(_bench(settings))
    shapes = [(m, c) for m in ("nonstream", "stream") for c in (1, 3)]
    assert [(c.token_delay_ms, c.mode, c.concurrency) for c in cases] == [
        (d, *mc) for d in (1.0, 0.0) for mc in shapes
    ]
    assert all(c.direct.ok == 20 and c.direct.errors == 0 and c.proxied is None for c in cases)
    # CPU was read (clock ticks are 10 ms, so a short case may show 0, never NaN or < 0)
    assert all(c.direct.cpu_us_per_request(0) >= 0 for c in cases)
    assert cpu_seconds(os.getpid()) > 0
    assert all(
        c.direct.percentile_ms(50) >= 4 for c in cases if c.token_delay_ms == 1.0
    )  # 4 tokens x 1 ms
    table = format_table(cases, loop="asyncio")
    assert "1ms/tok stream c=3" in table and "instant nonstream c=1" in table
    assert "overall (paced upstream rows): n/a" in table


_PARENT = """
import asyncio, sys
from pathlib import Path
from llmproxy.bench.child import child

async def main():
    argv = [sys.executable, "-m", "llmproxy.bench.fake.upstream", "--port", "0", "--log-level", "warning"]
    async with child("fake", argv, Path(sys.argv[1]), 60) as (pid, _url):
        print(pid, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def test_bench_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A bench killed without cleanup (SIGKILL) leaves no orphan server behind."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=child_preexec(),
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        os.kill(pid, 0)  # the child runs
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + 20
    while (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2:3]
    ):
        assert time.monotonic() < deadline, "bench child outlived its parent"
        time.sleep(0.05)
