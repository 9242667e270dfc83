"""The live page in a real browser: headless Chromium opens /llmproxy/ while editors type.

Skipped, saying why, where Debian's ``chromium`` is absent (``make test`` installs it).
``LLMPROXY_PAGE_SCREENSHOT=docs/page.png`` keeps the screenshot the first test takes
(the README shows it).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.browser import chromium, chromium_path
from tests.helpers.proxy import run_proxy

pytestmark = pytest.mark.slow

PREFIX = "def add(a, b):\n    "


def infill(prefix: str) -> dict[str, Any]:
    return {"input_prefix": prefix, "input_suffix": "\n", "n_predict": 6, "stream": False}


async def keystroke(
    http: aiohttp.ClientSession, url: str, session: str, prefix: str, **headers: str
) -> tuple[int, str]:
    async with http.post(
        url + "/infill", json=infill(prefix), headers={"X-LLMProxy-Session": session, **headers}
    ) as r:
        body = await r.json()
        return r.status, body.get("content", "")


def count(selector: str) -> str:
    return f"document.querySelectorAll({selector!r}).length"


def number(element_id: str) -> str:
    return f"Number(document.getElementById({element_id!r}).textContent) || 0"


async def test_the_page_shows_slots_supersedes_reuses_and_counters(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    chromium_path()  # skip before starting anything
    hold = asyncio.Event()
    script = lambda _p, body: Script(  # noqa: E731
        tokens=6, token_delay_s=0.01, hold=hold if body["input_prefix"].endswith("#") else None
    )
    async with (
        FakeUpstream(slots=2, script=script) as fake,
        run_proxy(fake.url, log_flush_s=0) as px,
        chromium(http) as tab,
    ):
        await tab.goto(px.url + "/llmproxy/")
        await tab.until("document.getElementById('conn').dataset.state === 'live'")
        await tab.until(f"{count('.tile')} === 2")
        assert await tab.eval(f"{count('.tile[data-state=idle]')}") == 2

        # an editor whose generation is still running: its slot shows busy, with its session
        busy = asyncio.create_task(keystroke(http, px.url, "held", PREFIX + "#"))
        await tab.until(f"{count('.tile[data-state=generating]')} === 1")
        tile = await tab.eval("document.querySelector('.tile[data-state=generating]').innerText")
        assert "/infill" in tile and "complete" in tile

        # a burst: each keystroke abandons the previous one, which is superseded
        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(keystroke(http, px.url, "burst", PREFIX + "x" * i)))
            await asyncio.sleep(0.02)  # the keystroke interval being simulated
        results = await asyncio.gather(*tasks)
        assert results[-1][0] == 200 and any(status == 499 for status, _ in results[:-1])
        await tab.until(f"{count('#timeline .bar[data-outcome=superseded]')} >= 1")
        await tab.until(f"({number('c-never-sent')}) + ({number('c-stopped-early')}) >= 1")

        # typing what the model wrote: answered from its generation (type-through)
        status, text = await keystroke(http, px.url, "typist", PREFIX)
        assert status == 200 and text
        status, _ = await keystroke(http, px.url, "typist", PREFIX + text[:3])
        assert status == 200
        await tab.until(f"{count('#timeline .bar[data-outcome=reused]')} >= 1")
        await tab.until(f"{number('c-reused-tokens')} >= 1")
        requests = await tab.until(f"{number('c-requests')} >= 8")

        shot = await tab.screenshot()
        assert shot.startswith(b"\x89PNG")
        keep = os.environ.get("LLMPROXY_PAGE_SCREENSHOT")
        (Path(keep) if keep else tmp_path / "page.png").write_bytes(shot)

        hold.set()
        assert (await busy)[0] == 200
        await tab.until(f"{number('c-requests')} > {requests}")  # the counters keep moving
        await tab.until(f"{count('.tile[data-state=generating]')} === 0")
        assert await tab.eval("document.body.innerText.includes('def add')") is False
        assert len(fake.generations) < 9  # what the page shows the proxy saved


async def test_the_page_asks_for_the_key_once(http: aiohttp.ClientSession) -> None:
    """With keys configured the page's data needs the key, which the user pastes once into
    the page; it goes in a header (sessionStorage keeps it for the tab), never in a URL.

    The page's own files are static and open (a browser cannot send a key when it
    navigates); everything with data needs the key."""
    chromium_path()
    async with (
        FakeUpstream(slots=1) as fake,
        run_proxy(fake.url, api_key="page-key", log_flush_s=0) as px,
        chromium(http) as tab,
    ):
        for path in ("/llmproxy/", "/llmproxy/page.js", "/llmproxy/page.css"):
            async with http.get(px.url + path) as r:
                assert r.status == 200, path
        for path in ("/llmproxy/events", "/llmproxy/status", "/llmproxy/metrics"):
            async with http.get(px.url + path) as r:
                assert r.status == 401, path
        await tab.goto(px.url + "/llmproxy/")
        await tab.until("document.getElementById('keyform').hidden === false")
        assert await tab.eval("document.getElementById('conn').textContent") == "key needed"
        await tab.eval(
            "document.getElementById('key').value = 'page-key';"
            "document.getElementById('keyform').requestSubmit()"
        )
        await tab.until("document.getElementById('conn').dataset.state === 'live'")
        await tab.until(f"{count('.tile')} === 1")
        auth = {"Authorization": "Bearer page-key"}
        assert (await keystroke(http, px.url, "s", PREFIX, **auth))[0] == 200
        await tab.until(f"{number('c-requests')} === 1")
        await tab.reload()  # the key stays in this tab: no second prompt
        await tab.until("document.getElementById('conn').dataset.state === 'live'")
        assert await tab.eval("document.getElementById('keyform').hidden") is True
        assert await tab.eval("location.href") == px.url + "/llmproxy/"  # no key in the URL


async def test_the_page_groups_slots_by_model(http: aiohttp.ClientSession) -> None:
    """Two upstreams, each serving its own model: each model's slots under its own heading,
    a chat running on the chat model's slot and none on the completion model's."""
    chromium_path()
    hold = asyncio.Event()
    chat_script = lambda _p, _b: Script(tokens=4, hold=hold)  # noqa: E731
    async with (
        FakeUpstream(slots=2) as fim,
        FakeUpstream(slots=1, script=chat_script) as chat,
        run_proxy(
            None,
            upstreams=[
                {"url": fim.url, "name": "coder", "models": ["fim"]},
                {"url": chat.url, "name": "talker", "models": ["chat"]},
            ],
            log_flush_s=0,
        ) as px,
        chromium(http) as tab,
    ):
        await tab.goto(px.url + "/llmproxy/")
        await tab.until("document.getElementById('conn').dataset.state === 'live'")
        await tab.until(f"{count('.model')} === 2")
        assert await tab.eval(f"{count('.model[data-model=fim] .tile')}") == 2
        assert await tab.eval(f"{count('.model[data-model=chat] .tile')}") == 1
        heading = await tab.eval("document.querySelector('.model[data-model=chat] h2').innerText")
        assert heading.startswith("model chat")
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        running = asyncio.create_task(http.post(px.url + "/v1/chat/completions", json=body))
        await tab.until(f"{count('.model[data-model=chat] .tile[data-state=generating]')} === 1")
        assert await tab.eval(f"{count('.model[data-model=fim] .tile[data-state=idle]')}") == 2
        hold.set()
        async with await running as r:
            assert r.status == 200
