"""Real model servers for the benches: llama.cpp's ``llama-server`` and llama-cpp-python's.

``backend_argv`` is the command line of either on a loopback port, with the path that
answers 200 once it is ready (also the interop suite's, through ``tests/helpers/interop.py``);
``model_server`` runs one as a child (``child.child_server``) until its block ends and
yields its base URL. ``default_llama_server`` finds the binary `make interop` built.

``llama-server-router`` is llama-server in router mode (``--models-dir``): it serves every
``NAME.gguf`` of a directory as model ``NAME``, starting a llama-server child per model on
its first request (at most ``--models-max`` at once) and passing ``-np``/``-c``/``-t`` on to
each. ``model_server`` gives it a directory of its own beside ``log`` with two links to the
GGUF, models ``fim`` and ``chat`` (``ROUTER_MODELS``); every generation request must name one.

Concurrency contract: ``model_server`` owns its child; it is stopped (SIGTERM, then
SIGKILL) when the block ends, and dies with this process. The router owns its model
children: it stops them when it is stopped with SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from llmproxy.bench.child import child_server

ServerName = Literal["llama-server", "llama-server-router", "llama-cpp-python"]
ROUTER_MODELS = ("fim", "chat")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_llama_server() -> Path:
    """``$LLMPROXY_LLAMA_SERVER``, else the newest llama-server `make interop` built
    (``SystemExit`` when there is none)."""
    from_env = os.environ.get("LLMPROXY_LLAMA_SERVER")
    if from_env:
        return Path(from_env)
    found = sorted((Path.home() / ".cache" / "llmproxy").glob("llama-server-*/llama-server"))
    if not found:
        raise SystemExit(
            "llmproxy bench: no llama-server: run `make interop` once, or pass --llama-server"
        )
    return found[-1]


def llama_server_argv(
    binary: Path, model: Path, port: int, parallel: int, threads: int, ctx_per_slot: int = 2048
) -> list[str]:
    """llama-server on 127.0.0.1:``port`` with ``parallel`` slots (also the interop suite's)."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)] + [
        "-np", str(parallel), "-c", str(ctx_per_slot * parallel), "-t", str(threads),
        "--no-webui",
    ]  # fmt: skip


def llama_server_router_argv(
    binary: Path,
    models_dir: Path,
    port: int,
    parallel: int,
    threads: int,
    ctx_per_slot: int = 2048,
    models_max: int = len(ROUTER_MODELS),
) -> list[str]:
    """llama-server in router mode on 127.0.0.1:``port``, serving ``models_dir``'s GGUFs, at
    most ``models_max`` loaded at once (default: both of ``ROUTER_MODELS``); each model's
    child gets ``parallel`` slots and ``threads`` threads (also the interop suite's)."""
    return [str(binary), "--models-dir", str(models_dir)] + [
        "--models-max", str(models_max), "-np", str(parallel),
        "-c", str(ctx_per_slot * parallel), "-t", str(threads),
        "--host", "127.0.0.1", "--port", str(port), "--no-webui",
    ]  # fmt: skip


def router_models_dir(model: Path, dest: Path) -> Path:
    """``dest`` with a link ``NAME.gguf`` to ``model`` per name of ``ROUTER_MODELS``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ROUTER_MODELS:
        link = dest / f"{name}.gguf"
        if not link.is_symlink():
            link.symlink_to(model.resolve())
    return dest


def llama_cpp_python_argv(model: Path, port: int, threads: int) -> list[str]:
    """llama-cpp-python's server on 127.0.0.1:``port`` (also the interop suite's)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model)] + [
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
        "--n_threads", str(threads),
    ]  # fmt: skip


def backend_argv(
    server: ServerName, binary: Path | None, model: Path, port: int, parallel: int, threads: int
) -> tuple[list[str], str]:
    """(command line, ready path) of ``server``; ``binary``: llama-server's (None: the
    default one); ``model``: the router's models directory for ``llama-server-router``."""
    if server == "llama-server":
        exe = binary or default_llama_server()
        return llama_server_argv(exe, model, port, parallel, threads), "/health"
    if server == "llama-server-router":
        exe = binary or default_llama_server()
        return llama_server_router_argv(exe, model, port, parallel, threads), "/health"
    return llama_cpp_python_argv(model, port, threads), "/v1/models"


@contextlib.asynccontextmanager
async def model_server(
    server: ServerName,
    binary: Path | None,
    model: Path,
    parallel: int,
    threads: int,
    log: Path,
) -> AsyncIterator[str]:
    """Run ``server`` until the block ends; yields its base URL once it is ready (the
    router's: once it answers; its models load on their first request)."""
    port = free_port()
    if server == "llama-server-router":
        model = router_models_dir(model, log.with_suffix(".models"))
    argv, ready = backend_argv(server, binary, model, port, parallel, threads)
    url = f"http://127.0.0.1:{port}"
    async with child_server(argv, log, url, ready):
        yield url
