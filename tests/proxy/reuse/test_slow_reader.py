"""A keystroke answered from a running generation (type-through) whose client stops
reading is dropped after ``client_write_timeout_s``, as a gated request's client is
(tests/proxy/upstream/test_slow_client.py): the answer goes through the same Responder."""

from __future__ import annotations

import asyncio

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.slow_client import dropped, stalled

HEADERS = {"X-LLMProxy-Session": "editor"}


async def test_a_reused_answer_to_a_client_that_takes_nothing_is_dropped(
    http: aiohttp.ClientSession,
) -> None:
    script = lambda _p, _b: Script(tokens=2048, token_delay_s=0.002, padding=16384)  # noqa: E731
    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script, abort_linger_s=0.01) as fake,
        run_proxy(
            fake.url, type_through="on", client_buffer_bytes=65536, client_write_timeout_s=0.5
        ) as px,
    ):
        generations = px.state.generations
        assert generations is not None
        body = {"prompt": "x = ", "n_predict": 2048, "stream": True}
        with structlog.testing.capture_logs() as logs:
            first = await http.post(px.url + "/completion", json=body, headers=HEADERS)
            await first.content.readline()  # the generation runs: "t0 " on its way
            keystroke = {**body, "prompt": "x = t"}  # types what the generation wrote
            async with stalled(px.url, "/completion", keystroke, HEADERS) as reader:
                first.close()  # superseded by the keystroke that continues its generation
                # once the stalled keystroke is dropped nobody reads the generation: it is
                # stopped, seconds before its 2048 tokens would end
                await wait_until(lambda: len(px.state.jobs) == 0, what="the generation stopped")
                assert fake.completed == [] and len(fake.aborted) == 1
                assert await asyncio.wait_for(dropped(reader), 5)
            px.flush_log()
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "stalled")
        assert line["outcome"] == "reused" and "dropped" in line["error"]
