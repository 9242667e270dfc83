"""``llmproxy serve``: the gateway (flags generated from ProxySettings)."""

from __future__ import annotations

import argparse

import structlog

from llmproxy.common import loops
from llmproxy.common.config import (
    SettingsError,
    add_settings_arguments,
    describe,
    settings_from_args,
)
from llmproxy.common.logs import configure_logging
from llmproxy.proxy.app import build_app
from llmproxy.proxy.server import serve
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.embedded import BackendMistake


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(ProxySettings, args)
    configure_logging(settings.log_level, settings.log_json)
    loop_name, loop_factory = loops.choose(settings.loop, "llmproxy")
    log = structlog.get_logger("llmproxy")
    log.info("starting llmproxy", loop=loop_name)
    log.debug("settings", settings=describe(settings))  # every one: --log-level debug
    try:
        app = build_app(settings)
        return loops.run(
            serve(settings, app, lambda: settings_from_args(ProxySettings, args)), loop_factory
        )
    except BackendMistake as exc:  # the backend's own line on stderr says why
        raise SettingsError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="Run the gating proxy (starts the embedded backend when no --upstream is given)",
        description="Run the gating proxy. "
        "Every option can also be set as LLMPROXY_<NAME> or in --config TOML.",
    )
    add_settings_arguments(parser, ProxySettings)
    parser.set_defaults(func=run)
