"""``llmproxy bench backends --server llama-server-router``'s harness against a real
llama-server in router mode (direct only, tiny settings): the model loads before T, a
burst's requests all name ``fim``, and the completion-beside-chat repetition overlaps a
decoding chat on ``chat``, which is stopped before the next request."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from llmproxy.backend.model_path import default_model_path
from llmproxy.bench import backends_router as router
from llmproxy.bench.backends import BackendsSettings, _burst_settings
from llmproxy.bench.burst.run import run_target
from llmproxy.bench.servers import model_server


async def test_router_bursts_and_completion_beside_chat(llama_bin: Path, tmp_path: Path) -> None:
    settings = BackendsSettings(
        server="llama-server-router", keystrokes=3, bursts=1, n_predict=8, gap_s=0, baseline_runs=1
    )
    log = tmp_path / "router.log"
    async with model_server(
        "llama-server-router", llama_bin, default_model_path(), 1, 1, log
    ) as url:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/props") as resp:
                assert (await resp.json())["role"] == "router"
            await router.load(http, url, router.FIM)
        burst = await run_target(url, _burst_settings(settings, "stream"))
        s = burst.summary()
        assert (s["errors"], s["failed_bursts"], s["completed"]) == (0, 0, 1)
        row = await router.beside_cell(url, url, reps=1, chat_tokens=200)
        assert (row["direct_errors"], row["proxied_errors"]) == (0, 0)
        assert row["overlapped"] == "1 / 1"
        async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as resp:
            models = {m["id"]: m["status"]["value"] for m in (await resp.json())["data"]}
        assert models == {"fim": "loaded", "chat": "loaded"}
    assert "model name is missing" not in log.read_text(errors="replace")
