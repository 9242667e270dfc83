"""Fixtures of the interop suite (``make interop``): real llama-server and llama-cpp-python
servers (tests/helpers/interop.py).

Every test here is marked ``interop`` (deselected by ``make test``); without a built
llama-server (tests/interop/build_llama_server.sh) the llama-server tests skip.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from llmproxy.backend.model_path import default_model_path
from tests.helpers.interop import (
    LlamaServer,
    Server,
    fim_model,
    free_port,
    llama_cpp_python_argv,
    llama_router_argv,
    llama_server_argv,
    llama_server_binary,
    running,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    binary = llama_server_binary()
    if binary is None or not binary.is_file():
        pytest.skip("llama-server is not built: run `make interop`")
    return binary


@pytest.fixture(scope="session")
def fim_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fim_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def llama_server(llama_bin: Path, tmp_path: Path) -> LlamaServer:
    """``async with llama_server(parallel=1, model=None, ctx_per_slot=2048, extra=()) as srv``:
    a llama-server of its own (``extra``: more flags)."""

    def start(
        parallel: int = 1,
        model: Path | None = None,
        ctx_per_slot: int = 2048,
        extra: tuple[str, ...] = (),
    ) -> AbstractAsyncContextManager[Server]:
        port = free_port()
        argv = llama_server_argv(
            llama_bin, model or default_model_path(), port, parallel, ctx_per_slot
        ) + list(extra)
        return running(argv, tmp_path / f"llama-server-{port}.log", "/health", port)

    return start


@pytest.fixture
def llama_router(llama_bin: Path, tmp_path: Path) -> LlamaServer:
    """``async with llama_router(models=("fim", "chat"), parallel=1, models_max=2) as srv``:
    llama-server in router mode, each model the default GGUF under its own name."""

    def start(
        models: tuple[str, ...] = ("fim", "chat"), parallel: int = 1, models_max: int = 2
    ) -> AbstractAsyncContextManager[Server]:
        port = free_port()
        folder = tmp_path / f"models-{port}"
        folder.mkdir()
        for name in models:
            (folder / f"{name}.gguf").symlink_to(default_model_path())
        argv = llama_router_argv(llama_bin, folder, port, parallel, models_max)
        return running(argv, tmp_path / f"llama-router-{port}.log", "/health", port)

    return start


@pytest.fixture
async def llama_cpp_python(tmp_path: Path) -> AsyncIterator[Server]:
    pytest.importorskip(
        "uvicorn", reason="llama-cpp-python's server extra is not installed: run `make interop`"
    )
    port = free_port()
    async with running(
        llama_cpp_python_argv(default_model_path(), port),
        tmp_path / "llama-cpp-python.log",
        "/v1/models",
        port,
    ) as srv:
        yield srv
