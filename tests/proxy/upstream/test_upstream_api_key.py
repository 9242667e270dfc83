"""A llama-server started with ``--api-key``: it refuses /props and /slots without the key,
so ``upstream_api_key`` drives it (the configured key replaces a client's), and without it
the log names the missing key.
"""

from __future__ import annotations

import aiohttp
import pytest
import structlog
from pydantic import ValidationError

from llmproxy.proxy.settings import ProxySettings
from tests.helpers.llama_fakes import KeyedFake
from tests.helpers.proxy import run_proxy


async def test_upstream_api_key_drives_a_keyed_llama_server(http: aiohttp.ClientSession) -> None:
    async with (
        KeyedFake(kind="llamacpp", slots=2) as fake,
        run_proxy(fake.url, upstream_api_key="K") as px,
    ):
        adapter = px.member.adapter
        assert (adapter.kind, adapter.slots, adapter.can_confirm) == ("llamacpp", 2, True)
        # the configured key replaces a client's
        for headers in ({}, {"Authorization": "Bearer editors-own"}):
            async with http.post(
                px.url + "/completion", json={"prompt": "x", "n_predict": 1}, headers=headers
            ) as r:
                assert r.status == 200
            assert fake.received[-1].headers.getall("Authorization") == ["Bearer K"]
        async with http.get(px.url + "/slots") as r:  # passthrough too
            assert r.status == 200
        assert fake.received[-1].headers["Authorization"] == "Bearer K"


async def test_a_keyed_llama_server_without_the_key_is_named_in_the_log() -> None:
    async with KeyedFake(kind="llamacpp", slots=2) as fake:
        with structlog.testing.capture_logs() as logs:
            async with run_proxy(fake.url) as px:
                # cannot tell without the key: the safe default
                assert px.member.adapter.kind == "openai"
        refused = [e for e in logs if e["event"].startswith("upstream refused /props")]
        assert (
            refused and refused[0]["status"] == 401 and refused[0]["hint"] == "set upstream_api_key"
        )


def test_upstream_key_and_url_credentials_are_exclusive() -> None:
    with pytest.raises(ValidationError, match="not both"):
        ProxySettings(upstream="http://u:p@127.0.0.1:1", upstream_api_key="K")
    assert (
        ProxySettings(upstream="http://127.0.0.1:1", upstream_api_key="K").upstream_api_key
        is not None
    )
