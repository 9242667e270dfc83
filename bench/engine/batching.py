"""``llmproxy bench engine --engine torch``: continuous vs static batching, side by side.

Drives the torch engine in-process the way the worker loop does (admit between steps,
``step`` while busy), same model, same prompts, greedy with ``ignore_eos`` so every
request generates exactly ``n_predict`` tokens. For each batching mode:

* aggregate tokens/s at concurrency 1, 4, 8, 16 (all requests admitted at once, wall
  time until the last one is done);
* TTFT of a request on an idle engine, and of a *late* request arriving while 8 long
  generations (4 x n_predict tokens) are running (admitted once each of the 8 has
  streamed a few tokens).

Goals on CPU: tok/s at concurrency 8 >= 4x concurrency 1; late TTFT <= 2x idle TTFT with
continuous batching (>= 5x with static, where the late request waits for the batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from llmproxy.backend.protocol import Done, Prompt, SamplingParams, Submit, Token

CONCURRENCY = (1, 4, 8, 16)
PROMPTS = [
    'def quicksort(items):\n    """Sort a list with quicksort."""\n    if len(items) <= 1:\n',
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n"
    "        self.capacity = capacity\n",
    "// Parse a CSV line into fields, honouring quotes.\nfunction parseCsvLine(line) {\n",
    "SELECT customers.name, COUNT(orders.id) AS n\nFROM customers\nJOIN orders ON\n",
    "Once upon a time, in a small village at the edge of a forest, there lived",
]


class Driver:
    """The worker loop's contract in-process: admit between steps, step while busy.

    Records per request the first-token and done times (``perf_counter``) and the tokens
    generated. A ``Failed`` event raises (``strict``) or is kept in ``failed``.
    """

    def __init__(self, engine: Any, strict: bool = True) -> None:
        self.e = engine
        self.strict = strict
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done_at: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.done: set[str] = set()
        self.failed: list[Any] = []
        self.n = 0

    def submit(self, n_predict: int, text: str | None = None) -> str:
        self.n += 1
        rid = f"b{self.n}"
        params = SamplingParams(n_predict=n_predict, temperature=0, ignore_eos=True, seed=1)
        prompt = Prompt(
            kind="completion", text=text if text is not None else PROMPTS[self.n % len(PROMPTS)]
        )
        self.sent[rid] = time.perf_counter()
        self._feed(self.e.admit(Submit(rid, 0, prompt, params)))
        return rid

    def _feed(self, events: list[Any]) -> None:
        now = time.perf_counter()
        for ev in events:
            if isinstance(ev, Token):
                self.first.setdefault(ev.request_id, now)
                self.tokens[ev.request_id] = ev.n_decoded
            elif isinstance(ev, Done):
                self.done.add(ev.request_id)
                self.done_at[ev.request_id] = now
                self.tokens[ev.request_id] = ev.n_predicted
            elif self.strict:
                raise RuntimeError(f"bench request failed: {ev}")
            else:
                self.failed.append(ev)
                self.done.add(ev.request_id)

    def step(self) -> None:
        self._feed(self.e.step())

    def until(self, pred: Any) -> None:
        while not pred():
            if not self.e.active():
                raise RuntimeError("engine idle before the condition held")
            self.step()

    def drain(self) -> None:
        while self.e.active():
            self.step()


def sweep(d: Driver, conc: int, n_predict: int) -> dict[str, float]:
    """``conc`` requests admitted at once, run to the end: aggregate tok/s (all tokens over
    the wall time), median per-sequence decode tok/s (first token excluded) and median TTFT."""
    t0 = time.perf_counter()
    ids = [d.submit(n_predict) for _ in range(conc)]
    d.drain()
    wall = time.perf_counter() - t0
    per_seq = [
        (d.tokens[i] - 1) / (d.done_at[i] - d.first[i])
        for i in ids
        if i in d.first and i in d.done_at and d.tokens.get(i, 0) > 1 and d.done_at[i] > d.first[i]
    ]
    ttfts = [(d.first[i] - d.sent[i]) * 1000.0 for i in ids if i in d.first]
    return {
        "tok_s": sum(d.tokens.get(i, 0) for i in ids) / wall,
        "per_seq_tok_s": statistics.median(per_seq) if per_seq else float("nan"),
        "ttft_ms": statistics.median(ttfts) if ttfts else float("nan"),
        "tokens": float(sum(d.tokens.get(i, 0) for i in ids)),
    }


def throughput(d: Driver, conc: int, n_predict: int) -> float:
    return sweep(d, conc, n_predict)["tok_s"]


def ttft(d: Driver, n_predict: int, background: int, background_tokens: int | None = None) -> float:
    """ms to the first token of an 8-token request admitted once ``background`` running
    requests (``background_tokens`` each, default 4 x ``n_predict``) streamed 3 tokens."""
    long = [d.submit(background_tokens or 4 * n_predict) for _ in range(background)]
    d.until(lambda: all(d.tokens.get(i, 0) >= 3 for i in long))
    t0 = time.perf_counter()
    rid = d.submit(8)
    d.until(lambda: rid in d.first)
    dt = (d.first[rid] - t0) * 1000.0
    d.drain()
    return dt


def bench_mode(args: argparse.Namespace, mode: str) -> dict[str, float | str]:
    from llmproxy.backend.engines.torch.engine import create_engine
    from llmproxy.backend.settings import BackendSettings

    fields: dict[str, Any] = dict(
        engine="torch", batching=mode, max_batch_size=16, n_ctx=args.n_ctx
    )
    for name in ("model", "n_threads", "cache_dir", "prefill_chunk", "max_batch_wait_ms"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    engine = create_engine(BackendSettings(**fields))
    info = engine.load(lambda _p: None)
    try:
        d = Driver(engine)
        throughput(d, 2, 4)  # warm the batched path
        res: dict[str, float | str] = {
            f"tps_c{c}": throughput(d, c, args.n_predict) for c in CONCURRENCY
        }
        idle = [ttft(d, args.n_predict, 0) for _ in range(3)]
        res["ttft_idle_ms"] = sorted(idle)[1]
        res["ttft_late_ms"] = ttft(d, args.n_predict, 8)
        res["device"] = dict(info.extra)["device"]
        return res
    finally:
        engine.close()


def main(args: argparse.Namespace) -> int:
    import torch

    args.n_predict = int(getattr(args, "n_predict", None) or 64)
    args.n_ctx = int(getattr(args, "n_ctx", None) or 2048)
    threads = getattr(args, "n_threads", None) or os.cpu_count() or 1
    args.n_threads = threads
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    res = {mode: bench_mode(args, mode) for mode in ("continuous", "static")}
    c, s = res["continuous"], res["static"]
    rows: list[tuple[str, str, str, str]] = []
    for n in CONCURRENCY:
        goal = "goal c8 >= 4x c1" if n == 8 else ""
        rows.append(
            (f"tok/s @ concurrency {n}", f"{c[f'tps_c{n}']:.1f}", f"{s[f'tps_c{n}']:.1f}", goal)
        )
    for r in (c, s):
        r["c8_over_c1"] = float(r["tps_c8"]) / float(r["tps_c1"])
        r["late_over_idle"] = float(r["ttft_late_ms"]) / float(r["ttft_idle_ms"])
    rows += [
        ("c8 / c1 speed-up", f"{c['c8_over_c1']:.2f}x", f"{s['c8_over_c1']:.2f}x", ">= 4x"),
        ("TTFT idle ms", f"{c['ttft_idle_ms']:.1f}", f"{s['ttft_idle_ms']:.1f}", ""),
        ("TTFT late (8 running) ms", f"{c['ttft_late_ms']:.1f}", f"{s['ttft_late_ms']:.1f}", ""),
        ("late / idle TTFT", f"{c['late_over_idle']:.2f}x", f"{s['late_over_idle']:.2f}x",
         "continuous <= 2x, static >= 5x"),
    ]  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    out = [f"torch engine, device {c['device']}, {threads} threads, n_predict {args.n_predict}, "
           f"load average at start {load:.2f} (shared CPU: numbers include contention)",
           f"{'metric':<{w0}}  {'continuous':>12}  {'static':>12}  goal"]  # fmt: skip
    out += [f"{r[0]:<{w0}}  {r[1]:>12}  {r[2]:>12}  {r[3]}" for r in rows]
    sys.stdout.write("\n".join(out) + "\n")
    if getattr(args, "json", None) is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0
