"""``llmproxy status``: the live page's picture as text, read from a running proxy."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import closed_port, wait_until
from tests.helpers.proxy import run_proxy


async def status(url: str, *args: str, key: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMPROXY_API_KEY"}
    if key is not None:
        env["LLMPROXY_API_KEY"] = key
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmproxy.proxy", "status", "--url", url, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_prints_slots_queue_and_counters(http: aiohttp.ClientSession) -> None:
    hold = asyncio.Event()
    script = lambda _p, body: Script(hold=hold if body.get("tag") == "held" else None)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, api_key="k1", log_flush_s=0) as px,
    ):
        auth = {"Authorization": "Bearer k1"}

        async def post(session: str, tag: str) -> int:
            body = {"input_prefix": "x", "input_suffix": "", "n_predict": 4, "tag": tag}
            headers = {**auth, "X-LLMProxy-Session": session}
            async with http.post(px.url + "/infill", json=body, headers=headers) as r:
                await r.read()
                return r.status

        held = asyncio.create_task(post("one", "held"))
        await fake.wait_for(lambda f: f.slot_busy[0])
        queued = asyncio.create_task(post("two", "queued"))
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="one queued")

        rc, out, err = await status(px.url, key="k1")
        assert rc == 0, err
        assert f"upstream {fake.url.removeprefix('http://')} (llamacpp, 0/1 permits free)" in out
        slot = next(ln.split() for ln in out.splitlines() if ln.strip().startswith("0 "))
        assert slot[:2] == ["0", "generating"] and slot[3:5] == ["complete", "/infill"]
        assert "queue: 1 waiting, 0 held" in out
        assert "generations never sent" in out

        hold.set()
        assert await held == 200 and await queued == 200
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        px.flush_log()
        rc, out, _ = await status(px.url, key="k1")
        assert "last 2 requests: 2 completed" in out
        assert out.splitlines()[-1].split() == ["requests", "2", "(2", "completed)"]

        rc, _, err = await status(px.url)  # no key
        assert rc == 1 and "wants a key" in err


async def test_status_says_when_nothing_listens() -> None:
    rc, out, err = await status(f"http://127.0.0.1:{closed_port()}")
    assert rc == 1 and out == "" and "cannot read" in err
