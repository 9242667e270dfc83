"""Stops nothing can confirm (OpenAI-compatible upstreams): a superseded stream is cut and its
permit held about one token's time; so is a non-streaming ``/v1/completions`` request, sent
upstream as a stream; one sent as it is (``upstream_stream`` off) is left to finish.

llama-cpp-python's server notices a dropped streaming client after its next chunk and a
dropped non-streaming one never (tests/interop/test_llama_cpp_python.py checks it)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy

TOKEN_S = 0.02


def script(_path: str, body: dict[str, Any]) -> Script:
    return Script(tokens=200 if body.get("prompt") == "first" else 3, token_delay_s=TOKEN_S)


async def supersede(
    http: aiohttp.ClientSession,
    stream: bool,
    *,
    after: int = 5,
    warm: bool = False,
    upstream_stream: str = "auto",
) -> tuple[FakeUpstream, list[dict[str, Any]]]:
    """A long generation superseded once the fake has sent ``after`` tokens of it; with
    ``warm``, after a short stream ran to its end first (``after=1``: once its first piece
    reached the client)."""
    # the fake's slot stays busy one more token after a dropped client, as llama-cpp-python's
    async with (
        FakeUpstream(kind="openai", slots=1, script=script, abort_linger_s=TOKEN_S) as fake,
        run_proxy(fake.url, upstream_stream=upstream_stream) as px,
    ):
        headers = {"X-LLMProxy-Session": "editor"}

        first_piece = asyncio.Event()

        async def post(prompt: str) -> int:
            body = {"model": "fake", "prompt": prompt, "max_tokens": 200, "stream": stream}
            async with http.post(px.url + "/v1/completions", json=body, headers=headers) as r:
                # a superseded stream is cut after its error event (relay/error_event.py)
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for _ in r.content.iter_any():
                        if prompt == "first":
                            first_piece.set()
                return r.status

        if warm:
            assert await post("warm") == 200
        with structlog.testing.capture_logs() as logs:
            async with asyncio.TaskGroup() as tg:
                first = tg.create_task(post("first"))
                if after == 1:  # its first piece went through the proxy: cut before the second
                    await asyncio.wait_for(first_piece.wait(), 5)
                else:
                    await wait_until(
                        lambda: fake._slots[0].n_decoded >= after, what="first generation under way"
                    )
                second = tg.create_task(post("second"))
            assert second.result() == 200 and first.result() in (200, 499)
            await wait_until(lambda: px.member.gate.free == 1, what="permits back")
            px.flush_log()
        return fake, [
            ln
            for ln in logs
            if ln.get("event") == "request" and ln.get("route") == "/v1/completions"
        ]


async def test_superseded_stream_is_cut_and_held_about_one_token(
    http: aiohttp.ClientSession,
) -> None:
    fake, (first, _second) = await supersede(http, stream=True)
    assert len(fake.aborted) == 1 and fake.max_concurrent == 1
    assert first["outcome"] == "superseded"
    assert (
        first["confirm_wait_ms"] < 1000 * 10 * TOKEN_S
    )  # twice a token's gap, not unconfirmed_cancel_hold_s (1 s)


async def test_a_stream_cut_after_its_first_piece_is_held_the_upstreams_recent_token_gap(
    http: aiohttp.ClientSession,
) -> None:
    """One piece gives no gap of its own: the adapter's recent streams tell a token's time."""
    fake, lines = await supersede(http, stream=True, after=1, warm=True)
    (first,) = [ln for ln in lines if ln["outcome"] == "superseded"]
    assert fake.max_concurrent == 1
    assert first["confirm_wait_ms"] < 1000 * 10 * TOKEN_S  # not unconfirmed_cancel_hold_s (1 s)


async def test_superseded_non_streaming_request_is_cut_as_a_stream(
    http: aiohttp.ClientSession,
) -> None:
    """Sent upstream as a stream: cut at once and held about one token, like a stream."""
    fake, (first, second) = await supersede(http, stream=False)
    assert fake.generations[0].body["stream"] is True
    assert len(fake.aborted) == 1 and fake.max_concurrent == 1
    assert first["outcome"] == "superseded" and second["status"] == 200
    assert first["confirm_wait_ms"] < 1000 * 10 * TOKEN_S


async def test_superseded_non_streaming_request_sent_as_it_is_runs_to_its_end(
    http: aiohttp.ClientSession,
) -> None:
    fake, (first, _second) = await supersede(http, stream=False, upstream_stream="off")
    assert fake.generations[0].body["stream"] is False
    assert fake.aborted == [] and len(fake.completed) == 2 and fake.max_concurrent == 1
    assert (
        first["outcome"] == "completed" and first["status"] == 200
    )  # policy finish: its client got it


FAILING = [
    ("openai", True, "/v1/completions", {"model": "m", "prompt": "a", "stream": True}),
    ("ollama", True, "/api/generate", {"model": "m", "prompt": "a"}),  # NDJSON stream
    ("llamacpp", False, "/completion", {"prompt": "a", "stream": True}),  # --no-slots
    (
        "llamacpp",
        True,
        "/v1/embeddings",
        {"model": "m", "input": "a"},
    ),  # any slot: /slots cannot tell
]


@pytest.mark.parametrize(
    ("kind", "slots_endpoint", "path", "body"),
    FAILING,
    ids=["openai", "ollama", "llamacpp-no-slots", "llamacpp-embeddings"],
)
async def test_a_failure_nothing_can_confirm_holds_the_permit(
    http: aiohttp.ClientSession, kind: str, slots_endpoint: bool, path: str, body: dict[str, Any]
) -> None:
    """A read timeout mid-body closes the upstream connection, like a stop: where nothing can
    confirm that the generation ended, the permit is held ``unconfirmed_cancel_hold_s`` (the
    upstream keeps the slot a while after the cut), so the next request does not wait
    inside the upstream."""

    def hangs(_path: str, b: dict[str, Any]) -> Script:
        first = "a" in (b.get("prompt"), b.get("input"))
        return Script(tokens=4, token_delay_s=0.001, fail="hang_mid_body" if first else None)

    async with (
        FakeUpstream(
            kind=kind,
            slots=1,
            script=hangs,
            abort_linger_s=0.3,  # type: ignore[arg-type]
            slots_endpoint=slots_endpoint,
        ) as fake,
        run_proxy(fake.url, read_timeout_s=0.3, unconfirmed_cancel_hold_s=1.0) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            async with http.post(
                px.url + path, json=body, headers={"X-LLMProxy-Session": "a"}
            ) as r:
                with contextlib.suppress(
                    aiohttp.ClientPayloadError
                ):  # a body of fixed length is cut
                    await r.read()
            await fake.wait_for(lambda f: len(f.aborted) == 1)
            again = {**body, "prompt": "b"} if "prompt" in body else {**body, "input": "b"}
            async with http.post(
                px.url + path, json=again, headers={"X-LLMProxy-Session": "b"}
            ) as r:
                assert r.status == 200
                await r.read()
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
            px.flush_log()
        assert fake.deferred == [] and fake.max_concurrent == 1, fake.snapshot()
        failed = next(
            ln for ln in logs if ln.get("event") == "request" and ln["outcome"] == "error"
        )
        assert failed["confirm_wait_ms"] >= 1000
