"""GPU check, server part: the real backend process (``python -m llmproxy.backend``).

``measure_server(opts, model_dir, dtype, baseline)`` starts the torch backend with
``idle_unload_s`` set, through ``bench.engine.server.Server``, and returns a dict of:

* ``props``: ``/props``'s ``engine`` object (device, dtype, the memory profile);
* ``ms_per_token`` / ``ttft_ms``: one stream, best of two; ``burst``: ``max(concurrency)``
  concurrent streams (failures counted, never raised);
* ``cancel``: client closes a stream -> every slot of ``/slots`` idle, ms and tokens
  (p50 / max over ``cancels`` samples);
* ``idle_unload``: the worker's memory awake, once ``/health`` says the model sleeps,
  and after the next request reloaded it; that request's TTFT minus an awake one's is the
  reload time. Memory is the device's used memory (CUDA: ``cudaMemGetInfo`` from this
  process, whose own use is constant meanwhile; ``baseline`` is the reading before the
  backend started) or the worker's RSS (CPU);
* ``failed``: requests that did not complete, with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmproxy.bench.engine.server import PROMPTS, Server
from llmproxy.bench.gpu_check.engine import MIB, rss_mib

if TYPE_CHECKING:
    from llmproxy.bench.gpu_check.cli import CheckSettings

SLEEP_WAIT_S = 120.0  # longest wait, past idle_unload_s, for /health to report the model asleep


def device_used_mib(device: str) -> float:
    if device != "cuda":
        return float("nan")
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / MIB


class Check:
    def __init__(self, opts: CheckSettings, server: Server, session: Any) -> None:
        self.opts, self.server, self.s = opts, server, session
        self.failed: list[str] = []
        self.requests = 0
        self.worker_pid = 0

    async def get(self, path: str) -> Any:
        async with self.s.get(self.server.url + path) as r:
            return await r.json()

    async def stream(self, n_predict: int, prompt: str = PROMPTS[0]) -> tuple[float, float] | None:
        """One streamed request: (ttft ms, decode tok/s), or None when it failed."""
        self.requests += 1
        try:
            ttft, tps, _ = await self.server.run(self.s, prompt, n_predict)
            return ttft, tps
        except (RuntimeError, OSError, ValueError) as exc:  # aiohttp's errors are OSErrors
            self.failed.append(repr(exc)[:300])
            return None

    async def memory(self) -> float:
        if self.opts.device == "cuda":
            return device_used_mib("cuda")
        return rss_mib(self.worker_pid)

    async def until_sleeping(self) -> float:
        t0 = time.perf_counter()
        async with asyncio.timeout(self.opts.idle_unload_s + SLEEP_WAIT_S):
            while True:
                async with self.s.get(self.server.url + "/health") as r:
                    if (await r.json()).get("model") == "sleeping":
                        return time.perf_counter() - t0
                await asyncio.sleep(0.05)


async def _run(opts: CheckSettings, server: Server, baseline: float) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        c = Check(opts, server, session)
        await server.wait_ready(session)
        props = await c.get("/props")
        c.worker_pid = int((await c.get("/slots"))[0]["worker_pid"])
        res: dict[str, Any] = {"props": props["engine"], "slots": props["total_slots"]}
        await c.stream(8)  # first request
        single = [r for r in [await c.stream(opts.n_predict) for _ in range(2)] if r is not None]
        if single:
            res["ttft_ms"] = min(t for t, _ in single)
            res["ms_per_token"] = 1000.0 / max(tps for _, tps in single)
        n = max(opts.concurrency)
        t0 = time.perf_counter()
        burst = await asyncio.gather(
            *(c.stream(opts.n_predict, PROMPTS[i % len(PROMPTS)]) for i in range(n))
        )
        res["burst"] = {"streams": n, "completed": sum(r is not None for r in burst),
                        "wall_s": time.perf_counter() - t0}  # fmt: skip
        cancels = []
        for _ in range(opts.cancels):
            c.requests += 1
            try:
                cancels.append(await server.cancel_latency(session))
            except (RuntimeError, OSError, ValueError) as exc:
                c.failed.append(repr(exc)[:300])
        if cancels:
            per_tok = res.get("ms_per_token", float("nan"))
            p50, worst = statistics.median(cancels), max(cancels)
            res["cancel"] = {
                "samples": len(cancels),
                "p50_ms": p50,
                "max_ms": worst,
                "p50_tokens": p50 / per_tok,
                "max_tokens": worst / per_tok,
            }
        res["idle_unload"] = await _idle_unload(c, baseline, res.get("ttft_ms", float("nan")))
        res["requests"] = c.requests
        res["failed"] = c.failed
        return res


async def _idle_unload(c: Check, baseline: float, awake_ttft: float) -> dict[str, Any]:
    awake = await c.memory()
    asleep_after = await c.until_sleeping()
    props = await c.get("/props")
    asleep = await c.memory()
    reload = await c.stream(8)
    reloaded = await c.memory()
    out: dict[str, Any] = {
        "idle_unload_s": c.opts.idle_unload_s,
        "sleeping_after_s": asleep_after,
        "props_is_sleeping": bool(props["is_sleeping"]),
        "baseline_mib": baseline,
        "awake_mib": awake,
        "asleep_mib": asleep,
        "reloaded_mib": reloaded,
        "freed_mib": awake - asleep,
    }
    if reload is not None:
        out["reload_ttft_ms"] = reload[0]
        out["reload_s"] = max(0.0, reload[0] - awake_ttft) / 1000.0
    return out


def measure_server(
    opts: CheckSettings, model_dir: Path, dtype: str, baseline: float
) -> dict[str, Any]:
    assert opts.work_dir is not None  # set by cli.run
    ns = argparse.Namespace(model=model_dir, n_ctx=opts.n_ctx, n_batch=16)
    extra = (
        "--device", opts.device, "--dtype", dtype,
        "--max-batch-size", str(max(opts.concurrency)),
        "--prefill-chunk", str(opts.prefill_chunk), "--idle-unload-s", str(opts.idle_unload_s),
        "--cache-dir", str(opts.work_dir / "cache"),
    )  # fmt: skip
    threads = opts.n_threads or os.cpu_count() or 1
    server = Server(ns, threads, engine="torch", extra=extra)
    try:
        return asyncio.run(_run(opts, server, baseline))
    finally:
        server.stop()
