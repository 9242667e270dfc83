"""``llmproxy bench SUB``: registers each benchmark's own module."""

from __future__ import annotations

import argparse
import importlib

_BENCHES = (
    "llmproxy.bench.overhead.run",
    "llmproxy.bench.engine.run",
    "llmproxy.bench.burst.run",
    "llmproxy.bench.backends",
    "llmproxy.bench.soak.run",
    "llmproxy.bench.pool.run",
    "llmproxy.bench.mix.run",
    "llmproxy.bench.tokenize",
    "llmproxy.bench.match",
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="Run a benchmark and print a table")
    bench_sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in _BENCHES:
        importlib.import_module(name).register(bench_sub)
