"""Dialects are values: detection and later probes make new ones, never change one in place,
so a job keeps the dialect it was granted with (dialects/base.py)."""

from __future__ import annotations

import dataclasses
import json

import aiohttp
import pytest

from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.upstream.adapters.ollama import OllamaAdapter
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter
from llmproxy.proxy.upstream.dialects.base import Dialect, TooManySlots
from llmproxy.proxy.upstream.dialects.llamacpp import LlamaCppDialect

BASE = "http://127.0.0.1:9"  # never connected to: nothing here probes


async def test_reading_props_makes_a_new_dialect_and_leaves_the_old_one_as_it_was() -> None:
    async with aiohttp.ClientSession() as session:
        adapter = LlamaCppAdapter(BASE, session, ProxySettings(type_through="off"))
        try:
            before = adapter.dialect
            assert (before.own, before.streams) == (None, True)
            body = {"prompt": "x"}
            assert before.assembles("/infill", body)
            adapter.learn_props({"total_slots": 2, "build_info": "llmproxy-backend"})
            after = adapter.dialect
            assert after is not before
            assert (after.own, after.streams) == (True, False)
            assert not after.assembles("/infill", body)
            # what a job granted before the probe holds is unchanged
            assert (before.own, before.streams) == (None, True) and before.assembles(
                "/infill", body
            )
            with pytest.raises(dataclasses.FrozenInstanceError):
                after.streams = True  # type: ignore[misc]
        finally:
            adapter.close()


async def test_a_llama_server_dialect_writes_the_slot_and_asks_for_a_stream() -> None:
    d = LlamaCppDialect(own=False)
    body = {"prompt": "x", "n_predict": 4}
    sent = json.loads(d.prepare_body("/completion", json.dumps(body).encode(), body, 3))
    assert sent == {**body, "id_slot": 3, "stream": True}
    assert d.answers_at_start("/completion", body)
    assert not d.answers_at_start("/v1/embeddings", {"input": "x"})  # no slot of its own
    assert not LlamaCppDialect(own=True).answers_at_start("/completion", body)
    # embeddings: no id_slot, one permit per input up to the capacity
    emb = {"input": ["a", "b", "c"]}
    assert (
        d.prepare_body("/v1/embeddings", json.dumps(emb).encode(), emb, 1)
        == json.dumps(emb).encode()
    )
    assert d.permits("/v1/embeddings", emb, 2) == 2


async def test_a_router_models_dialect_names_its_model_where_the_body_does_not() -> None:
    async with aiohttp.ClientSession() as session:
        adapter = RouterModelAdapter(
            BASE, session, ProxySettings(), model="qwen", status="unloaded"
        )
        try:
            d = adapter.dialect
            assert (d.model, d.own) == ("qwen", False)
            named = {"prompt": "x", "model": "other"}
            raw = json.dumps(named).encode()
            assert json.loads(d.prepare_body("/completion", raw, named, 0))["model"] == "other"
            bare = {"prompt": "x"}
            sent = json.loads(d.prepare_body("/completion", json.dumps(bare).encode(), bare, 0))
            assert sent["model"] == "qwen"
            adapter.learn_props({"total_slots": 2, "build_info": "b4000"})
            assert adapter.dialect.model == "qwen" and adapter.dialect is not d
        finally:
            adapter.close()


async def test_too_many_slots_is_the_dialects_and_the_reason_the_adapters() -> None:
    d = LlamaCppDialect()
    with pytest.raises(TooManySlots) as caught:
        d.permits("/completion", {"prompt": "x", "n": 3}, 2)
    assert (caught.value.field, caught.value.wanted) == ("n", 3)
    async with aiohttp.ClientSession() as session:
        adapter = LlamaCppAdapter(BASE, session, ProxySettings(), slots=4)
        try:
            with pytest.raises(BadRequest) as refused:
                adapter.permits("/completion", {"prompt": "x", "n_cmpl": 3}, 2)
            assert refused.value.message == (
                "'n_cmpl' = 3 needs 3 slots at once, llmproxy has 2: "
                "--capacity is below the upstream's 4 slots"
            )
        finally:
            adapter.close()


async def test_a_plain_upstream_writes_bodies_as_sent() -> None:
    async with aiohttp.ClientSession() as session:
        adapter = OllamaAdapter(BASE, session, ProxySettings())
        try:
            assert adapter.dialect == Dialect(kind="ollama")
            body = {"prompt": "x", "n": 5}
            raw = json.dumps(body).encode()
            assert adapter.dialect.prepare_body("/api/generate", raw, body, 0) == raw
            assert adapter.permits("/api/generate", body, 1) == 1
            assert not adapter.dialect.assembles("/api/generate", body)
        finally:
            adapter.close()
