"""``llmproxy bench SUB``: registers each benchmark's own module."""

from __future__ import annotations

import argparse
import importlib

_BENCHES = (
    "llmproxy.proxy.bench.overhead",
    "llmproxy.backend.bench_engine",
    "llmproxy.proxy.bench.burst",
    "llmproxy.proxy.bench.backends",
    "llmproxy.proxy.bench.soak",
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="Run a benchmark and print a table")
    bench_sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in _BENCHES:
        importlib.import_module(name).register(bench_sub)
