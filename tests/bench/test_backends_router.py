"""``llmproxy bench backends --server llama-server-router``: the router's command line and
models directory, the bodies that name a model, the completion-beside-chat harness against
an in-process fake router, and the row's goal. The real router: tests/interop/."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web

from llmproxy.bench import backends_router as router
from llmproxy.bench.backends import BackendsSettings, _burst_settings
from llmproxy.bench.burst.profiles import PROFILES
from llmproxy.bench.servers import backend_argv, router_models_dir


def test_router_argv_and_models_dir(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    models = router_models_dir(gguf, tmp_path / "models")
    assert router_models_dir(gguf, tmp_path / "models") == models  # twice: no error
    assert sorted(p.name for p in models.iterdir()) == ["chat.gguf", "fim.gguf"]
    assert all((models / n).resolve() == gguf.resolve() for n in ("chat.gguf", "fim.gguf"))
    argv, ready = backend_argv("llama-server-router", Path("/bin/ls"), models, 1234, 2, 1)
    assert ready == "/health"
    joined = " ".join(argv)
    assert f"--models-dir {models} --models-max 2 -np 2 -c 4096 -t 1" in joined
    assert "--port 1234" in joined and "--no-webui" in joined and "-m " not in joined


def test_every_router_request_names_a_model() -> None:
    for mode in ("nonstream", "stream"):
        burst = _burst_settings(BackendsSettings(server="llama-server-router"), mode)
        body = json.loads(
            PROFILES[burst.profile].encode("x", 8, burst.model, json.loads(burst.extra_body))
        )
        assert (body["model"], body["stream"], burst.model) == ("fim", mode == "stream", "fim")
    assert json.loads(router.completion_body())["model"] == "fim"
    chat = json.loads(router.chat_body(400))
    assert (chat["model"], chat["stream"], chat["max_tokens"]) == ("chat", True, 400)
    plain = _burst_settings(BackendsSettings(), "stream")
    assert "model" not in json.loads(plain.extra_body)


class FakeRouter:
    """A router's wire shape: 400 without ``model``; ``/completion`` takes ``idle_s``, or
    twice that while a chat streams; a chat streams a token per 10 ms until its client
    leaves; ``/slots?model=NAME``."""

    def __init__(self, idle_s: float = 0.02) -> None:
        self.idle_s = idle_s
        self.chatting = 0
        self.models: list[str] = []

    async def completion(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "model" not in body:
            return web.json_response({"error": {"message": "model name is missing"}}, status=400)
        self.models.append(body["model"])
        await asyncio.sleep(self.idle_s * (2 if self.chatting else 1))
        return web.json_response({"content": "x", "model": body["model"]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.models.append(body["model"])
        resp = web.StreamResponse()
        await resp.prepare(request)
        self.chatting += 1
        try:
            for _ in range(body["max_tokens"]):
                await resp.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.chatting -= 1
        return resp

    async def slots(self, request: web.Request) -> web.Response:
        if "model" not in request.query:
            return web.json_response({"error": {"message": "model name is missing"}}, status=400)
        busy = request.query["model"] == "chat" and self.chatting > 0
        return web.json_response([{"id": 0, "is_processing": busy}])

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/completion", self.completion)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/slots", self.slots)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


async def test_beside_cell_against_a_fake_router() -> None:
    fake = FakeRouter()
    async with fake.serving() as url:
        row = await router.beside_cell(url, url, reps=2, chat_tokens=300)
    assert fake.chatting == 0  # every chat was stopped
    assert set(fake.models) == {"fim", "chat"}
    assert (row["direct_errors"], row["proxied_errors"], row["overlapped"]) == (0, 0, "2 / 2")
    assert 1.5 < float(str(row["direct_x_idle"])) < 3  # twice as slow beside the chat
    assert row["goal"] is False


def test_beside_row_goal() -> None:
    def side(idle: float, beside: float, errors: int = 0) -> router.Side:
        return router.Side([idle] * 3, [beside] * 3, overlapped=3, errors=errors)

    row = router.beside_row(side(1.0, 1.5), side(1.1, 1.2))
    assert (row["direct_x_idle"], row["proxied_x_idle"], row["goal"]) == (1.5, 1.2, True)
    assert router.beside_row(side(1.0, 1.5), side(1.0, 1.1, errors=1))["goal"] is False
    empty = router.beside_row(side(1.0, 1.5), router.Side())
    assert math.isnan(float(str(empty["proxied_x_idle"]))) and empty["goal"] is False
    line = router.beside_line({"server": "llama-server-router", "parallel": 1, **row})
    assert line.startswith("| llama-server-router | 1 | 1000 / 1100 | 1500 | 1.50 | 1200 | 1.20")
    assert line.endswith("| 3 / 3 | 0 / 0 | PASS |")
