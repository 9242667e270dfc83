"""GET /metrics through a real server: off by default (501), and with ``--metrics`` the
counters move by exactly what each generation computed, a cancelled one included."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.backend.runtime.test_cancel import LONG, read_tokens, slot0
from tests.helpers.backend.server import parallel_flags


@pytest.fixture(scope="module")
def metered(engine: str, start_backend: Any) -> Any:
    return start_backend(engine, "--metrics", *parallel_flags(engine, 1))


def counters(text: str) -> dict[str, float]:
    """``llamacpp:NAME VALUE`` lines of a Prometheus text page, by NAME."""
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.removeprefix("llamacpp:").split()
            out[name] = float(value)
    return out


def read(backend: Any) -> dict[str, float]:
    status, body = backend.get("/metrics")
    assert status == 200, body
    return counters(body)


def test_metrics_are_off_unless_asked(backend: Any) -> None:
    status, body = backend.get("/metrics")
    assert status == 501
    assert body["error"]["type"] == "not_supported_error"
    assert "--metrics" in body["error"]["message"]


def test_a_finished_generation_adds_its_prompt_and_tokens(metered: Any) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 7, "ignore_eos": True}
    for _ in range(2):  # the second time, llama-cpp reuses the cached prompt
        before = read(metered)
        status, out = metered.post("/completion", body)
        assert status == 200, out
        after = read(metered)
        assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == 7
        assert (
            after["prompt_tokens_total"] - before["prompt_tokens_total"]
            == out["timings"]["prompt_n"]
            > 0
        )
        assert after["tokens_predicted_seconds_total"] > before["tokens_predicted_seconds_total"]
        assert after["requests_processing"] == 0


async def test_a_cancelled_generation_adds_what_it_decoded(metered: Any) -> None:
    before = read(metered)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(metered.url + "/completion", json=LONG)
        n_client = await read_tokens(resp, 5)
        assert read(metered)["requests_processing"] == 1
        resp.close()
        t0 = time.perf_counter()
        while (sl := await slot0(s, metered.url))["is_processing"]:
            assert time.perf_counter() - t0 < 5, "slot still busy 5 s after the client left"
            await asyncio.sleep(0.005)
    after = read(metered)
    decoded = after["tokens_predicted_total"] - before["tokens_predicted_total"]
    assert n_client <= sl["n_decoded"] <= decoded < LONG["n_predict"], (n_client, sl, decoded)
    assert after["prompt_tokens_total"] > before["prompt_tokens_total"]
    assert after["requests_processing"] == 0
