"""The ``llmproxy`` command: parses the subcommand and hands off to its module.

Each subcommand lives in its own module exposing ``register(subparsers)`` (adds its
parser and sets ``func``); this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# subcommand module -> registered in this order in --help
_COMMANDS = (
    "llmproxy.proxy.serve",
    "llmproxy.proxy.status_cmd",
    "llmproxy.backend.cli",
    "llmproxy.bench.cli",
    "llmproxy.proxy.systemd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmproxy",
        description="Gating proxy and local model server for editor autocomplete.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
