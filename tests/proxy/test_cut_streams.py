"""A superseded stream whose client still reads it, read as real clients read it (their
parsing rules: bench/burst/profiles.py): none takes the cut text for a suggestion.

minuet-ai.nvim keeps the text of any stream curl read to its end, whatever its last event
says; the proxy's superseded event followed by a clean end made it insert a cut suggestion.
On completion routes the stream is now cut after its event (relay/error_event.py):
curl exits 18, which minuet treats as a failed request.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.burst.profiles import PROFILES, read_continue, read_minuet
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.proxy import RunningProxy, run_proxy
from tests.helpers.streams import read_all

MINUET = PROFILES["minuet"]
HEADERS = {"Content-Type": "application/json", **dict(MINUET.headers), "User-Agent": "curl/8"}


def minuet_body(line: str) -> dict[str, Any]:
    return MINUET.body(line, 64, "")


@asynccontextmanager
async def setup() -> AsyncIterator[RunningProxy]:
    script = lambda _p, _b: Script(tokens=64, token_delay_s=0.02)  # noqa: E731
    async with (
        FakeUpstream(slots=1, abort_linger_s=0.01, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        yield px


async def supersede(http: aiohttp.ClientSession, px: RunningProxy) -> None:
    """The session's next keystroke (a different line: no continuation)."""
    async with http.post(px.url + MINUET.route, json=minuet_body("x = 1"), headers=HEADERS) as r:
        assert r.status == 200
        await r.read()


async def test_minuets_parsing_never_inserts_a_superseded_stream(
    http: aiohttp.ClientSession,
) -> None:
    async with setup() as px:
        async with http.post(px.url + MINUET.route, json=minuet_body("re"), headers=HEADERS) as r:
            assert r.status == 200
            first = await r.content.readline()  # its first event: text went out
            assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"]
            newer = asyncio.ensure_future(supersede(http, px))
            rest, complete = await read_all(r)
        await newer
    body = first + rest
    assert b'"type":"superseded"' in body
    assert read_minuet(200, body, complete).text is None  # nothing inserted
    assert read_continue(200, body, complete).text is None


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
async def test_curl_as_minuet_runs_it_reports_the_superseded_stream_failed(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """minuet's own command line (utils.lua make_curl_args): ``-L``, its headers, ``-d
    @file``; its exit code decides (0 or 28: the text is taken)."""
    data = tmp_path / "body.json"
    data.write_text(json.dumps(minuet_body("re")))
    async with setup() as px:
        args = ["-sS", "-N", "-L"]
        for k, v in HEADERS.items():
            args += ["-H", f"{k}: {v}"]
        curl = await asyncio.create_subprocess_exec(
            "curl",
            *args,
            "-d",
            f"@{data}",
            px.url + MINUET.route,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert curl.stdout is not None
        first = await asyncio.wait_for(curl.stdout.readline(), 10)  # text went out
        assert b'"text"' in first
        await supersede(http, px)
        rest, _ = await asyncio.wait_for(curl.communicate(), 10)
    out = first + rest
    assert b'"type":"superseded"' in out
    assert curl.returncode == 18  # "transfer closed with outstanding read data remaining"
    assert read_minuet(200, out, curl.returncode in (0, 28)).text is None
