"""How ``llmproxy serve`` starts its embedded backend: the command line the backend really
parses (slots per engine, its drain and stop)."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmproxy.backend.cli import add_arguments
from llmproxy.backend.settings import BackendSettings, stop_budget_s
from llmproxy.common.config import settings_from_args
from llmproxy.proxy.gating.registry import DRAIN_GRACE_S
from llmproxy.proxy.server import _WRITE_GRACE_S
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.systemd import render
from llmproxy.proxy.upstream.embedded import BACKEND_DRAIN_S, BACKEND_STOP_S, backend_command


def backend_settings(tmp_path: Path, **proxy: object) -> BackendSettings:
    """The settings ``llmproxy backend`` builds from the command the proxy would run."""
    cmd = backend_command(ProxySettings(**proxy), tmp_path / "port")
    assert cmd[1:3] == ["-m", "llmproxy.backend"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(BackendSettings, parser.parse_args(cmd[3:]))


def test_parallel_is_the_backends_slot_count_on_both_engines(tmp_path: Path) -> None:
    assert backend_settings(tmp_path, parallel=3).slot_layout() == [1, 1, 1]  # a worker per slot
    # one batch of 3
    assert backend_settings(tmp_path, engine="torch", parallel=3).slot_layout() == [3]
    # unset: each engine's own default
    assert backend_settings(tmp_path).slot_layout() == [1]
    assert backend_settings(tmp_path, engine="torch").slot_layout() == [
        BackendSettings().max_batch_size
    ]


def test_n_ctx_reaches_the_backend(tmp_path: Path) -> None:
    assert backend_settings(tmp_path, n_ctx=8192).n_ctx == 8192
    # unset: the backend's default
    assert backend_settings(tmp_path).n_ctx == BackendSettings().n_ctx


def test_backend_stop_fits_the_proxys_budget(tmp_path: Path) -> None:
    """The proxy stops the backend after its own drain (no client left): the backend's
    longest stop fits in the proxy's wait before SIGKILL, and the proxy's whole stop in
    the systemd unit's TimeoutStopSec."""
    s = backend_settings(tmp_path)
    assert s.shutdown_timeout_s == BACKEND_DRAIN_S
    assert s.sigint is False  # Ctrl-C is the proxy's: it drains first, then stops the backend
    assert stop_budget_s(s.shutdown_timeout_s) < BACKEND_STOP_S
    proxy = ProxySettings()
    worst = proxy.shutdown_timeout_s + DRAIN_GRACE_S + 2 * _WRITE_GRACE_S + BACKEND_STOP_S
    unit = render(
        exec_start="x",
        config="c",
        user=True,
        socket_listen=None,
        shutdown_timeout_s=proxy.shutdown_timeout_s,
    )
    stop = int(proxy.shutdown_timeout_s) + 15
    assert f"TimeoutStopSec={stop}s" in unit.service and worst < stop
