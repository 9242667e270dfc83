"""``llmproxy serve``'s start: one banner line with what to paste into each editor and what is
served; every setting only at debug level."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.serve import serve


async def _lines_until_listening(proc: asyncio.subprocess.Process) -> list[dict[str, Any]]:
    assert proc.stderr is not None
    lines: list[dict[str, Any]] = []
    async with asyncio.timeout(30):
        while not lines or lines[-1]["event"] != "listening":
            line = await proc.stderr.readline()
            assert line, "serve ended before it listened"
            if line.startswith(b"{"):
                lines.append(json.loads(line))
    return lines


async def test_start_banner_names_the_editor_urls_and_what_is_served(tmp_path: Path) -> None:
    async with FakeUpstream() as fake, serve(tmp_path, "--upstream", fake.url) as (proc, url):
        lines = await _lines_until_listening(proc)
        banner = lines[-1]
        assert banner["url"] == url
        assert banner["llama_vim"] == url + "/infill" and banner["continue_dev"] == url + "/"
        assert banner["page"] == url + "/llmproxy/"
        assert banner["model"] == "from " + fake.url.removeprefix("http://")
        assert not any("settings" in ln for ln in lines)  # the dump is at debug level


async def test_settings_are_dumped_at_debug_level(tmp_path: Path) -> None:
    async with (
        FakeUpstream() as fake,
        serve(tmp_path, "--upstream", fake.url, "--log-level", "debug") as (proc, _url),
    ):
        lines = await _lines_until_listening(proc)
        dump = next(ln for ln in lines if ln["event"] == "settings")
        assert dump["level"] == "debug" and dump["settings"]["upstream"]


@pytest.mark.slow
async def test_the_embedded_backend_says_how_long_it_loaded(tmp_path: Path) -> None:
    async with serve(tmp_path, "--parallel", "1") as (proc, url):
        lines = await _lines_until_listening(proc)
        ready = next(ln for ln in lines if ln["event"] == "embedded backend ready")
        assert ready["took_s"] >= 0
        assert lines[-1]["model"].startswith("SmolLM2-135M-Instruct (the small demo model")
        async with aiohttp.ClientSession() as http, http.get(url + "/") as r:
            assert r.status == 200 and r.url.path == "/llmproxy/"  # a browser lands on the page
            assert "<title>llmproxy</title>" in await r.text()
