"""Answers from a generation that has ended: odd but legal bodies, and a suggestion typed to
its end (issue 33, item 6), through the proxy on the fake llama-server of
test_type_through.py."""

from __future__ import annotations

import json

import aiohttp
import pytest

from llmproxy.proxy.reuse.generation import Generation
from tests.helpers.net import wait_until
from tests.proxy.reuse.test_type_through import (
    HEADERS,
    OUTPUT,
    ROUTES,
    TOKENS,
    answer_text,
    body,
    latest,
    setup,
)


async def test_a_follower_whose_response_fields_leave_out_content_gets_them(
    http: aiohttp.ClientSession,
) -> None:
    """llama.vim's ``response_fields`` may name no ``content``; llama-server then leaves it
    out of its answer, and so does an answer from the generation (no KeyError, no 500)."""
    route, fields = "/infill", {"response_fields": ["tokens_predicted", "stop_type"]}
    async with setup("on", delay_s=0.005) as (fake, px):
        async with http.post(
            px.url + route, json=body(route, "", False, **fields), headers=HEADERS
        ) as r:
            assert (r.status, await r.json()) == (
                200,
                {"tokens_predicted": TOKENS, "stop_type": "limit"},
            )
        await wait_until(lambda: (g := latest(px, route)) is not None and g.done, what="its end")
        typed = body(route, OUTPUT[:4], False, **fields)
        async with http.post(px.url + route, json=typed, headers=HEADERS) as r:
            assert r.status == 200, await r.text()
            assert json.loads(await r.read()) == {"tokens_predicted": TOKENS, "stop_type": "limit"}
        assert len(fake.generations) == 1  # answered from the generation


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ROUTES)
async def test_typing_a_suggestion_cut_at_its_limit_to_its_end_asks_for_more(
    http: aiohttp.ClientSession, route: str, stream: bool
) -> None:
    """The generation stopped at its token limit (``n_predict``); the user typed all of it.
    It has nothing left to say, a new request would write more: the keystroke is sent to
    the upstream, not answered "" from the generation."""
    path = route.split()[0]
    async with setup("on", delay_s=0.005) as (fake, px):
        async with http.post(px.url + path, json=body(route, "", stream), headers=HEADERS) as r:
            assert await answer_text(path, r, stream) == OUTPUT
        await wait_until(lambda: (g := latest(px, path)) is not None and g.done, what="its end")
        async with http.post(px.url + path, json=body(route, OUTPUT, stream), headers=HEADERS) as r:
            assert await answer_text(path, r, stream) == OUTPUT  # the fake's next generation
        assert len(fake.generations) == 2


def finished(oai: bool, last: dict[str, object]) -> Generation:
    generation = Generation("/v1/completions" if oai else "/completion", {}, oai=oai, stream=True)
    piece = {"choices": [{"index": 0, "text": "t0 "}]} if oai else {"content": "t0 ", "stop": False}
    generation.feed(b"data: " + json.dumps(piece).encode() + b"\n\n")
    generation.feed(b"data: " + json.dumps(last).encode() + b"\n\n")
    generation.end()
    return generation


@pytest.mark.parametrize(
    ("oai", "last", "said_all"),
    [
        (False, {"stop": True, "stop_type": "eos"}, True),
        (False, {"stop": True, "stop_type": "word"}, True),
        (False, {"stop": True, "stop_type": "limit"}, False),
        (False, {"tokens_predicted": 1}, False),  # response_fields left the reason out
        (True, {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, True),
        (True, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, False),
    ],
)
def test_a_generation_said_all_only_when_it_stopped_by_itself(
    oai: bool, last: dict[str, object], said_all: bool
) -> None:
    assert finished(oai, last).said_all is said_all
