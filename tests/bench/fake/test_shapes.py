"""What the fake upstream answers on the wire, per kind, over real loopback HTTP.

llama-server's native routes (compact JSON, SSE chunk by chunk), the OpenAI routes and
Ollama's NDJSON, the fixed info routes of each kind, and what ``received`` records.
"""

from __future__ import annotations

import json

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.fake import TEXT8, sse_events


async def test_llamacpp_info_routes(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(slots=3) as up:
        async with session.get(up.url + "/health") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}
        async with session.get(up.url + "/props") as r:
            assert (await r.json())["total_slots"] == 3
        async with session.get(up.url + "/slots") as r:
            slots = await r.json()
        assert [s["id"] for s in slots] == [0, 1, 2]
        assert all(s["is_processing"] is False and s["next_token"]["n_decoded"] == 0 for s in slots)
        async with session.get(up.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "fake"
        async with session.get(up.url + "/api/version") as r:
            assert r.status == 404
        assert [r.path for r in up.received] == [
            "/health",
            "/props",
            "/slots",
            "/v1/models",
            "/api/version",
        ]
        assert up.generations == []


async def test_completion_nonstream_compact_and_recorded(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream() as up:
        payload = {"prompt": "x", "n_predict": 128, "id_slot": 0}
        async with session.post(
            up.url + "/infill", json=payload, headers={"User-Agent": "curl/8"}
        ) as r:
            raw = await r.read()
            assert r.status == 200 and r.content_type == "application/json"
        assert b"\n" not in raw and f'"content":"{TEXT8}"'.encode() in raw  # llama.vim's regex
        obj = json.loads(raw)
        assert obj["stop"] is True and obj["tokens_predicted"] == 8 and obj["id_slot"] == 0
        [rec] = up.received
        assert (rec.path, rec.body, rec.headers["User-Agent"], rec.id) == (
            "/infill",
            payload,
            "curl/8",
            0,
        )
        assert (
            rec.headers.get("user-agent") == "curl/8"
            and "USER-AGENT" in rec.headers
            and "x-missing" not in rec.headers
        )
        assert json.loads(rec.raw) == payload
        await up.wait_for(lambda u: u.concurrent == 0)
        assert (up.completed, up.aborted, up.max_concurrent, up.slot_busy) == ([0], [], 1, [False])


async def test_n_predict_caps_tokens_warmup_answers_empty(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(script=lambda _p, _b: Script(tokens=50, token_delay_s=1.0)) as up:
        async with session.post(up.url + "/infill", json={"prompt": "", "n_predict": 0}) as r:
            obj = await r.json()
        assert obj["content"] == "" and obj["tokens_predicted"] == 0


async def test_completion_stream_chunk_by_chunk(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(script=lambda _p, _b: Script(tokens=5, token_delay_s=0.1)) as up:
        async with session.post(up.url + "/completion", json={"prompt": "x", "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            first = await r.content.readline()
            assert first == b'data: {"index":0,"content":"t0 ","id_slot":0,"stop":false}\n'
            assert up.completed == [] and up.slot_busy == [True]  # still generating
            raw = first + await r.read()
        events = [json.loads(e) for e in sse_events(raw)]
        assert [e["content"] for e in events] == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 ", ""]
        assert [e["stop"] for e in events] == [False] * 5 + [True]
        assert events[-1]["tokens_predicted"] == 5
        await up.wait_for(lambda u: u.completed == [0] and u.concurrent == 0)


async def test_oai_routes_nonstream_and_stream(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(kind="openai") as up:
        async with session.post(up.url + "/v1/completions", json={"prompt": "x"}) as r:
            obj = await r.json()
        assert obj["object"] == "text_completion"
        assert obj["choices"][0]["text"] == TEXT8 and obj["choices"][0]["finish_reason"] == "length"
        async with session.post(
            up.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 3}
        ) as r:
            obj = await r.json()
        assert obj["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 "}
        for path, key in (("/v1/completions", "text"), ("/v1/chat/completions", "delta")):
            async with session.post(up.url + path, json={"stream": True, "max_tokens": 2}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(await r.read())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
            texts = [c["choices"][0][key] for c in chunks[:2]]
            assert texts == (
                ["t0 ", "t1 "]
                if key == "text"
                else [{"role": "assistant", "content": f"t{i} "} for i in range(2)]
            )
        for path in ("/props", "/slots", "/health", "/completion"):
            async with session.request(
                "GET" if path != "/completion" else "POST", up.url + path, json={}
            ) as r:
                assert r.status == 404, path
        assert len(up.completed) == 4


async def test_ollama_ndjson(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(kind="ollama") as up:
        async with session.get(up.url + "/api/version") as r:
            assert "version" in await r.json()
        async with session.get(up.url + "/api/tags") as r:
            assert (await r.json())["models"][0]["name"] == "fake:latest"
        async with session.get(up.url + "/props") as r:
            assert r.status == 404
        async with session.post(
            up.url + "/api/generate", json={"model": "fake", "prompt": "x"}
        ) as r:
            assert r.headers["Content-Type"] == "application/x-ndjson"
            raw = await r.read()
        assert raw.endswith(b"\n")
        lines = [json.loads(line) for line in raw.decode().splitlines()]
        assert "".join(line["response"] for line in lines) == TEXT8
        assert [line["done"] for line in lines] == [False] * 8 + [True]
        async with session.post(
            up.url + "/api/chat", json={"stream": False, "options": {"num_predict": 2}}
        ) as r:
            obj = await r.json()
        assert obj["message"]["content"] == "t0 t1 " and obj["done"] is True
