"""Prompts are tokenized off the slots (runtime/tokenize.py): a special-token flood under
the context bound (seconds of llama.cpp's tokenizer with a large ``n_ctx``) holds no slot
while it is tokenized, so another request runs meanwhile; a tokenizer past
``tokenize_timeout_s`` is a 400 in the envelope, and a client that leaves while its
prompt is tokenized never takes a slot."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend.api import envelope
from tests.helpers.backend.server import wait_until

N_CTX = 16384
# under the bound (fewer than n_ctx special-token strings), about a second or more of
# llama.cpp's tokenizer (its special-token split grows with the square of the matches)
FLOOD = {"prompt": "<|im_end|>" * (N_CTX - 400), "n_predict": 1}
SHORT = {"prompt": "Hello", "n_predict": 2}


def metric(b: Any, name: str) -> float:
    _, text = b.request("GET", "/metrics", timeout=5)
    line = next(ln for ln in text.splitlines() if ln.startswith(f"llamacpp:{name} "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def big(start_backend: Any) -> Any:
    return start_backend("llama-cpp", "--parallel", "1", "--n-ctx", str(N_CTX), "--metrics")


@pytest.mark.slow
async def test_a_flood_being_tokenized_holds_no_slot(big: Any) -> None:
    await _idle(big)
    async with aiohttp.ClientSession() as s:
        flood = asyncio.create_task(_post(s, big.url + "/completion", FLOOD))
        try:
            # the flood reached the server: tokenizing (deferred) or, tokenized on its
            # slot, processing
            assert await asyncio.to_thread(
                wait_until,
                lambda: metric(big, "requests_deferred") + metric(big, "requests_processing") >= 1,
                30,
            ), big.log_tail()
            assert not big.slots()[0]["is_processing"], "the flood holds the slot"
            t0 = time.perf_counter()
            status, body = await _post(s, big.url + "/completion", SHORT, deadline_s=30)
            elapsed = time.perf_counter() - t0
            assert status == 200, body
            assert not flood.done(), "the flood ended first: the short request waited for it"
        finally:
            flood.cancel()
            await asyncio.gather(flood, return_exceptions=True)
    assert elapsed < 5, elapsed
    # the flood's client left: nothing of it holds the slot for long
    assert await asyncio.to_thread(wait_until, lambda: not big.slots()[0]["is_processing"], 30), (
        big.slots()
    )


@pytest.mark.slow
async def test_a_client_that_leaves_while_tokenized_takes_no_slot(big: Any) -> None:
    await _idle(big)
    async with aiohttp.ClientSession() as s:
        flood = asyncio.create_task(_post(s, big.url + "/completion", FLOOD))
        assert await asyncio.to_thread(
            wait_until, lambda: metric(big, "requests_deferred") >= 1, 30
        ), big.log_tail()
        flood.cancel()
        await asyncio.gather(flood, return_exceptions=True)
        assert not big.slots()[0]["is_processing"]
    # its tokenization ends on its thread (counted until then); it never reaches a slot
    assert await asyncio.to_thread(wait_until, lambda: metric(big, "requests_deferred") == 0, 30), (
        big.log_tail()
    )
    before = metric(big, "prompt_tokens_total") + metric(big, "prompt_tokens_cached_total")
    status, _ = big.post("/completion", SHORT)
    assert status == 200
    after = metric(big, "prompt_tokens_total") + metric(big, "prompt_tokens_cached_total")
    assert after - before < 100, "the departed flood's prompt was evaluated"


@pytest.mark.slow
def test_a_tokenizer_past_its_budget_is_a_400(start_backend: Any) -> None:
    b = start_backend(
        "llama-cpp", "--parallel", "1", "--n-ctx", str(N_CTX), "--tokenize-timeout-s", "0.05"
    )
    status, body = b.post("/completion", FLOOD)
    envelope(status, body, 400)
    assert "to tokenize" in body["error"]["message"], body
    assert not b.slots()[0]["is_processing"]
    assert b.post("/completion", SHORT)[0] == 200


async def _idle(b: Any) -> None:
    """Nothing of an earlier test left: the slot idle, nothing tokenized or waiting."""
    assert await asyncio.to_thread(
        wait_until,
        lambda: not b.slots()[0]["is_processing"] and metric(b, "requests_deferred") == 0,
        60,
    ), b.log_tail()


async def _post(
    s: aiohttp.ClientSession, url: str, body: Any, deadline_s: float = 300
) -> tuple[int, Any]:
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=deadline_s)) as r:
        return r.status, await r.json(content_type=None)
