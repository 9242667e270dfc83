"""``llmproxy backend``: run the local model server alone (llama-server compatible API)."""

from __future__ import annotations

import argparse
import os

from llmproxy.backend.settings import BackendSettings
from llmproxy.common.config import add_settings_arguments, settings_from_args, usage_exit

HELP = "Run the local model server (llama-server compatible API)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, BackendSettings)
    parser.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("backend", help=HELP, description=HELP)
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    parent = os.getppid()  # read first: a parent that dies before this line goes unnoticed
    from llmproxy.backend.model_path import ModelNotFound
    from llmproxy.backend.server import serve
    from llmproxy.common import loops
    from llmproxy.common.children import exit_with_parent
    from llmproxy.common.logs import configure_logging

    settings = settings_from_args(BackendSettings, args)
    if settings.exit_with_parent and not exit_with_parent(parent):
        raise SystemExit("llmproxy backend: --exit-with-parent: the parent process is gone already")
    configure_logging(settings.log_level, settings.log_json)
    factory = loops.choose(settings.loop, "llmproxy backend")[1]
    try:
        return loops.run(serve(settings), factory)
    except ModelNotFound as exc:  # a start-up mistake: status 2, as a bad flag
        usage_exit(f"llmproxy backend: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmproxy.backend", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
