"""Shared fixtures: real backend servers (subprocesses, real model) per engine.

``engine`` is parametrized over ["llama-cpp", "torch"]; torch is skipped while torch or
``llmproxy.backend.engines.torch.engine`` cannot be imported. Servers are started as
``python -m llmproxy.backend --port 0 --port-file F`` and are session/module scoped;
``start_backend`` stops every server it started at the end of the session.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.backend.server import Backend, parallel_flags

ENGINES = ["llama-cpp", "torch"]


def engine_skip_reason(name: str) -> str | None:
    if name == "llama-cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed"
        return None
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        importlib.import_module("llmproxy.backend.engines.torch.engine")
    except Exception as exc:
        return f"llmproxy.backend.engines.torch.engine cannot be imported: {exc!r}"
    return None


@pytest.fixture(scope="session", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    reason = engine_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(scope="session")
def start_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Factory: ``start_backend(engine, *flags)`` -> a ready Backend, stopped at session end."""
    started: list[Backend] = []
    tmp = tmp_path_factory.mktemp("backend")

    def start(engine: str, *args: str, wait: bool = True, cwd: Path | None = None) -> Backend:
        b = Backend(tmp, engine, *args, cwd=cwd)
        started.append(b)
        return b.wait_ready() if wait else b

    yield start
    for b in started:
        b.stop()


@pytest.fixture(scope="session")
def backend(engine: str, start_backend: Any) -> Backend:
    """The shared server (one slot) for API tests; do not kill or stop it in a test."""
    return start_backend(engine, *parallel_flags(engine, 1))
