"""Load: 1,000 concurrent client connections against ``llmproxy serve`` (capacity 1, queue 200).

The queue limit holds exactly (the excess get 429 at once), ``/llmproxy/status`` answers
promptly throughout, and once quiet the proxy process has not grown (RSS) or leaked file
descriptors. The long first request is released by the test (client disconnect, policy
cancel), not by a timer, so the phases are synchronised on observed state.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.soak import rss_kb
from llmproxy.common.children import child_preexec
from tests.helpers.serve import serve

# One kept-alive connection (like a monitoring agent): measures the proxy's event loop, not
# the listen backlog (test_listen_backlog_holds_a_full_queue covers new connections, which a
# full backlog stalls until their SYN is retransmitted).
POLLER = """
import http.client, sys, time, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
while True:
    t0 = time.monotonic()
    c.request("GET", u.path)
    c.getresponse().read()
    print(time.monotonic() - t0, flush=True)
    time.sleep(0.05)
"""
CLIENTS = 1000
MAX_QUEUE = 200


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def many_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the proxy child inherits it
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def script(_path: str, body: dict) -> Script:
    return Script(tokens=100_000 if body.get("prompt") == "block" else 1, token_delay_s=0.001)


async def status(http: aiohttp.ClientSession, url: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    async with http.get(url + "/llmproxy/status") as r:
        return await r.json(), time.monotonic() - t0


@pytest.mark.slow
async def test_thousand_connections_queue_limit_status_rss_fds(
    tmp_path: Path, many_fds: None
) -> None:
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.01) as fake,
        serve(
            tmp_path,
            "--upstream",
            fake.url,
            "--capacity",
            "1",
            "--max-queue",
            str(MAX_QUEUE),
            "--queue-timeout-s",
            "120",
            "--log-level",
            "warning",
        ) as (proc, url),
        aiohttp.ClientSession() as admin,
    ):
        # drain the child's stderr so it never blocks on a full pipe
        drain = asyncio.create_task(proc.stderr.read())
        async with admin.post(url + "/completion", json={"prompt": "warm"}) as r:
            assert r.status == 200
        await (await admin.get(url + "/llmproxy/metrics")).read()
        fds0, rss0 = fd_count(proc.pid), rss_kb(proc.pid)

        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=90)
        ) as http:
            blocker = asyncio.create_task(http.post(url + "/completion", json={"prompt": "block"}))
            await fake.wait_for(lambda f: f.slot_busy == [True], 10)

            async def one(i: int) -> int:
                async with http.post(
                    url + "/completion",
                    json={"prompt": f"q{i}", "n_predict": 1},
                    headers={"X-LLMProxy-Session": f"c{i}"},
                ) as r:
                    body = await r.json()
                    if r.status == 429:
                        assert (
                            body["error"]["type"] == "queue_full"
                            and body["error"]["src"] == "llmproxy"
                        )
                    return r.status

            # its own process: our busy loop does not skew it
            poller = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                POLLER,
                url + "/llmproxy/status",
                stdout=asyncio.subprocess.PIPE,
                preexec_fn=child_preexec(),
            )
            assert poller.stdout is not None
            await poller.stdout.readline()  # first answer: the poller is running
            clients = [asyncio.create_task(one(i)) for i in range(CLIENTS)]
            rejected = lambda: sum(1 for c in clients if c.done() and c.result() == 429)  # noqa: E731
            deadline = time.monotonic() + 40
            while rejected() < CLIENTS - MAX_QUEUE:
                assert time.monotonic() < deadline, f"only {rejected()} rejected"
                assert not any(c.done() and c.result() != 429 for c in clients)
                await asyncio.sleep(0.05)
            st, _ = await status(admin, url)
            assert st["queue"]["depth"] == MAX_QUEUE and st["permits"]["free"] == 0
            blocker.cancel()  # the client leaves: policy cancel frees the permit, the queue drains
            results = await asyncio.wait_for(asyncio.gather(*clients), 60)
            poller.terminate()
            latencies = [float(x) for x in (await poller.stdout.read()).split()]
            await poller.wait()
            await asyncio.gather(blocker, return_exceptions=True)

        assert results.count(429) == CLIENTS - MAX_QUEUE
        assert results.count(200) == MAX_QUEUE
        assert len(latencies) >= 5 and max(latencies) < 1.0, latencies
        print(
            f"status latency max {max(latencies) * 1000:.0f} ms over {len(latencies)} polls; "
            f"fds {fds0}; rss0 {rss0} kB"
        )
        for _ in range(200):  # quiescence: no request left, connections closed on both sides
            st, _ = await status(admin, url)
            if (
                st["permits"]["free"] == 1
                and st["queue"]["depth"] == 0
                and st["jobs"] == 0
                and fd_count(proc.pid) <= fds0 + 3
            ):
                break
            await asyncio.sleep(0.05)
        assert st["permits"]["free"] == 1 and st["queue"]["depth"] == 0 and st["jobs"] == 0
        assert fd_count(proc.pid) <= fds0 + 3, (fds0, fd_count(proc.pid))
        assert rss_kb(proc.pid) - rss0 < 100 * 1024
        assert len(fake.generations) == 2 + MAX_QUEUE
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)


async def test_listen_backlog_holds_a_full_queue(tmp_path: Path, fake: FakeUpstream) -> None:
    async with serve(
        tmp_path, "--upstream", fake.url, "--capacity", "1", "--max-queue", str(MAX_QUEUE)
    ) as (proc, url):
        port = url.rsplit(":", 1)[1]
        ss = await asyncio.create_subprocess_exec(
            "ss", "-ltnH", f"sport = :{port}", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await ss.communicate()
        (line,) = out.decode().splitlines()
        backlog = int(line.split()[2])  # Send-Q of a listening socket = its backlog
        assert backlog >= MAX_QUEUE + 1, backlog
