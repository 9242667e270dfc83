"""Real backends for the interop suite (tests/interop/): llama-server, llama-cpp-python.

``llama_server_binary`` finds the binary tests/interop/build_llama_server.sh built
(``make interop`` builds it once and passes its path in ``LLMPROXY_LLAMA_SERVER``). ``fim_model``
writes a copy of the SmolLM2 GGUF whose metadata names three unused special tokens as the
FIM prefix/suffix/middle tokens, so that llama-server serves ``/infill`` with it (its text
is meaningless; the wire behaviour is what is tested). ``running`` starts a server as a
child that dies with the test process, waits until it answers, and stops it at the end
(``llmproxy.bench.child.child_server``); its output goes to a log file the tests read.
``LlamaServer`` is the type of the ``llama_server`` fixture (tests/interop/conftest.py), and
of ``llama_router``'s (llama-server in router mode, ``llama_router_argv``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

from llmproxy.backend.model_path import default_model_path
from llmproxy.bench.child import child_server
from llmproxy.bench.servers import llama_cpp_python_argv as bench_llama_cpp_python_argv
from llmproxy.bench.servers import llama_server_argv as bench_llama_server_argv
from llmproxy.bench.servers import (
    llama_server_router_argv as bench_llama_server_router_argv,
)

THREADS = os.cpu_count() or 2

VERSION = "11434.0.0"  # tests/interop/build_llama_server.sh's default
FIM_TOKENS = {
    "tokenizer.ggml.fim_pre_token_id": 8,
    "tokenizer.ggml.fim_suf_token_id": 9,
    "tokenizer.ggml.fim_mid_token_id": 10,
}


def llama_server_binary() -> Path | None:
    given = os.environ.get("LLMPROXY_LLAMA_SERVER")
    if given:
        return Path(given)
    cache = Path(os.environ.get("LLMPROXY_CACHE", Path.home() / ".cache" / "llmproxy"))
    path = cache / f"llama-server-{VERSION}" / "llama-server"
    return path if path.is_file() else None


def fim_model(dest: Path) -> Path:
    """A copy of the default GGUF with FIM token ids in its metadata (written with the
    ``gguf`` package)."""
    import gguf

    out = dest / "smollm2-fim.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(default_model_path())
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(out), str(bytes(arch.parts[arch.data[0]]), "utf-8"))
    for field in reader.fields.values():
        if (
            field.name.startswith("GGUF.")
            or field.name == "general.architecture"
            or field.name in FIM_TOKENS
        ):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for name, token in FIM_TOKENS.items():
        writer.add_uint32(name, token)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    log: Path
    proc: asyncio.subprocess.Process

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stopped_tasks(self) -> int:
        """How many times llama-server logged that it cancelled a task (a dropped client seen)."""
        return self.log_text().count("stop: cancel task")


LlamaServer = Callable[..., AbstractAsyncContextManager[Server]]


@contextlib.asynccontextmanager
async def running(
    argv: Sequence[str], log: Path, ready_path: str, port: int
) -> AsyncIterator[Server]:
    """Run ``argv`` (a server listening on ``port``) until the block ends."""
    url = f"http://127.0.0.1:{port}"
    async with child_server(argv, log, url, ready_path, timeout_s=120) as proc:
        yield Server(url, log, proc)


def llama_server_argv(
    binary: Path, model: Path, port: int, parallel: int, ctx_per_slot: int = 2048
) -> list[str]:
    return bench_llama_server_argv(binary, model, port, parallel, THREADS, ctx_per_slot)


def llama_router_argv(
    binary: Path, models_dir: Path, port: int, parallel: int, models_max: int
) -> list[str]:
    """llama-server in router mode: each ``NAME.gguf`` of ``models_dir`` a model, loaded on
    demand as a child with ``parallel`` slots and one thread (two children share the CPUs)."""
    return bench_llama_server_router_argv(
        binary, models_dir, port, parallel, 1, models_max=models_max
    )


def llama_cpp_python_argv(model: Path, port: int) -> list[str]:
    return bench_llama_cpp_python_argv(model, port, THREADS)
