"""End to end: ``llmproxy serve --port 0 --upstream URL`` as a real subprocess.

Also the shutdown contract: SIGTERM answers queued requests 503, lets in-flight ones
finish, exits 0; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.common.children import child_preexec
from tests.helpers.net import raw_exchange
from tests.helpers.serve import LLMPROXY, serve, wait_for_log
from tests.helpers.streams import read_all


async def test_serve_subprocess_proxies_and_stops_cleanly(tmp_path: Path) -> None:
    script = lambda _p, _b: Script(tokens=4, token_delay_s=0.001)  # noqa: E731
    async with (
        FakeUpstream(slots=2, script=script) as fake,
        serve(tmp_path, "--upstream", fake.url) as (proc, url),
    ):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/infill", data=b'{"input_prefix":"x","n_predict":4}') as r:
                assert r.status == 200
                assert (
                    await r.read()
                    == b'{"index":0,"content":"t0 t1 t2 t3 ","id_slot":0,"stop":true,'
                    b'"model":"fake","tokens_predicted":4,"tokens_evaluated":1,'
                    b'"stop_type":"limit","truncated":false}'
                )
            async with http.get(url + "/llmproxy/status") as r:
                assert (await r.json())["permits"]["total"] == 2
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        lines = [
            json.loads(ln)
            for ln in (await proc.stderr.read()).decode().splitlines()
            if ln.startswith("{")
        ]
        req = [ln for ln in lines if ln.get("event") == "request" and ln["route"] == "/infill"]
        assert req and req[0]["outcome"] == "completed" and req[0]["request_id"]


async def test_sigterm_drains_inflight_and_503s_queued(tmp_path: Path) -> None:
    script = lambda _p, _b: Script(tokens=30, token_delay_s=0.02)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        serve(tmp_path, "--upstream", fake.url, "--shutdown-timeout-s", "10") as (proc, url),
        aiohttp.ClientSession() as http,
    ):
        inflight = asyncio.create_task(
            http.post(
                url + "/completion", json={"prompt": "a"}, headers={"X-LLMProxy-Session": "a"}
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        queued = asyncio.create_task(
            http.post(
                url + "/completion", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "b"}
            )
        )

        async def is_queued() -> bool:
            async with http.get(url + "/llmproxy/status") as r:
                return (await r.json())["queue"]["depth"] == 1

        # the served process's status is the only signal that crosses the process boundary
        while not await is_queued():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        rq = await queued
        assert rq.status == 503 and (await rq.json())["error"]["type"] == "shutting_down"
        ri = await inflight
        assert ri.status == 200
        assert (await ri.json())["content"] == "".join(f"t{i} " for i in range(30))
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert len(fake.generations) == 1


async def test_sigterm_cuts_inflight_at_the_deadline(tmp_path: Path) -> None:
    """In-flight requests get ``shutdown_timeout_s`` in all, not once per shutdown stage: a
    stream still running at the deadline ends with an error event, and the process exits 0."""
    script = lambda _p, _b: Script(tokens=3000, token_delay_s=0.01)  # noqa: E731  (30 s)
    async with (
        FakeUpstream(kind="openai", slots=1, script=script) as fake,
        serve(
            tmp_path,
            "--upstream",
            fake.url,
            "--shutdown-timeout-s",
            "2",
            "--on-disconnect",
            "finish",
        ) as (proc, url),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(url + "/v1/completions", json={"prompt": "a", "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # the stream has started
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            proc.send_signal(signal.SIGTERM)
            # to the end the proxy gives it: a completion stream is cut after its error event
            rest, whole = await asyncio.wait_for(read_all(r), 10)
        assert b'"type":"shutting_down"' in rest.rstrip().rsplit(b"\n", 1)[-1]  # the last event
        assert not whole
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert loop.time() - t0 < 4.5  # 2 s, plus slack
        lines = [
            json.loads(ln)
            for ln in (await proc.stderr.read()).decode().splitlines()
            if ln.startswith("{")
        ]
        assert [ln["outcome"] for ln in lines if ln.get("event") == "request"] == [
            "cancelled_inflight"
        ]


async def test_second_signal_forces_exit(tmp_path: Path) -> None:
    script = lambda _p, _b: Script(fail="hang_before_headers")  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        serve(tmp_path, "--upstream", fake.url, "--shutdown-timeout-s", "60") as (proc, url),
        aiohttp.ClientSession() as http,
    ):
        hung = asyncio.create_task(http.post(url + "/completion", json={"prompt": "a"}))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        proc.send_signal(signal.SIGTERM)
        await wait_for_log(proc, "signal received: shutting down gracefully")
        assert proc.returncode is None  # still draining the hung request
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 5) == 1
        await asyncio.gather(hung, return_exceptions=True)


async def test_request_id_on_every_log_line_of_a_request(tmp_path: Path) -> None:
    """The adapter's confirmation-timeout error is logged deep inside the job, without an
    explicit request id: it must still carry the request's id (bound contextvars)."""
    script = lambda _p, _b: Script(tokens=500, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=30) as fake,
        serve(tmp_path, "--upstream", fake.url, "--confirm-timeout-s", "0.3") as (proc, url),
        aiohttp.ClientSession() as http,
    ):
        task = asyncio.create_task(
            http.post(
                url + "/completion", json={"prompt": "a"}, headers={"X-Request-Id": "req-abc"}
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        lines: list[dict] = []
        async with asyncio.timeout(10):
            while not any(ln.get("event") == "request" for ln in lines):
                raw = await proc.stderr.readline()
                if raw.startswith(b"{"):
                    lines.append(json.loads(raw))
        during = [
            ln
            for ln in lines
            if ln.get("request_id") == "req-abc" or ln.get("level") in ("warning", "error")
        ]
        assert any("confirmation timed out" in ln["event"] for ln in during)
        assert all(ln.get("request_id") == "req-abc" for ln in during), during


async def test_exposed_with_a_key_serves_any_address_of_this_machine(tmp_path: Path) -> None:
    """Bound to every interface (which needs a key: tests/proxy/test_startup_mistakes.py),
    a client naming any IP address of the machine in ``Host`` is served; a name is not
    unless allowed (a rebinding page always has one)."""
    async with (
        FakeUpstream(slots=1) as fake,
        serve(tmp_path, "--upstream", fake.url, "--host", "0.0.0.0", "--api-key", "k") as (
            proc,
            url,
        ),
        aiohttp.ClientSession() as http,
    ):
        port = url.rsplit(":", 1)[1]
        for host, status in ((f"192.0.2.7:{port}", 200), (f"lan-box.example:{port}", 403)):
            async with http.get(url + "/slots", headers={"Host": host, "api-key": "k"}) as r:
                assert r.status == status, host
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert not (tmp_path / "port").exists()  # removed at exit: the next run's wait starts clean


async def test_malformed_requests_log_one_json_warning_each(tmp_path: Path) -> None:
    """What a client's bad bytes cause is a one-line warning, never an ERROR traceback (any
    client could repeat it at will), and aiohttp's own records come out as JSON too."""
    async with (
        FakeUpstream(slots=1) as fake,
        serve(tmp_path, "--upstream", fake.url) as (proc, url),
    ):
        # refused unread; aiohttp then fails to discard it
        await raw_exchange(
            url,
            b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: 2\r\n\r\n{}",
        )
        await raw_exchange(
            url,
            b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\n{}\r\nZZ\r\n",
        )
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        # all JSON
        lines = [json.loads(ln) for ln in (await proc.stderr.read()).decode().splitlines()]
    assert not [ln for ln in lines if ln["level"] in ("error", "critical") or "exception" in ln], (
        lines
    )
    bad = {ln["kind"] for ln in lines if ln["event"] == "malformed request from the client"}
    assert bad == {"ContentEncodingError", "BadHttpMessage"}, lines


async def test_invalid_option_exits_with_one_readable_error() -> None:
    """A bad value for ``llmproxy serve`` ends it at once with the flag named, no traceback."""
    env = {**os.environ, "LLMPROXY_QUEUE_TIMEOUT_S": "soon"}
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        "serve",
        "--port",
        "0",
        "--max-queue",
        "-1",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=child_preexec(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 2 and out == b""
    assert "Traceback" not in text
    assert "--max-queue (env LLMPROXY_MAX_QUEUE, config max_queue)" in text
    assert "--queue-timeout-s (env LLMPROXY_QUEUE_TIMEOUT_S" in text and "got 'soon'" in text


async def test_port_file_is_cleared_at_start_and_removed_at_exit(tmp_path: Path) -> None:
    """A port file left by an earlier run names a port nothing (or someone else) listens on:
    a wrapper waiting for the file while this run starts up must not read it. So the file
    is removed at start, written once listening, and removed again at a clean exit."""
    port_file = tmp_path / "port"
    port_file.write_text("1\n")  # stale
    async with FakeUpstream(slots=1) as fake:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
        proc = await asyncio.create_subprocess_exec(
            LLMPROXY,
            "serve",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--log-json",
            "--upstream",
            fake.url,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=child_preexec(),
        )
        try:
            await wait_for_log(proc, "listening", 30)
            port = int(port_file.read_text())
            assert port != 1
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/llmproxy/health") as r,
            ):
                assert r.status == 200
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert not port_file.exists()
