"""Every command block (```sh) in README.md and docs/ runs as written.

Each line is one of: a ``make`` target the Makefile has; an ``llmproxy`` command whose
arguments parse; a command run here for real (``RUN``: against a proxy in front of the fake
upstream, its URL put in place of ``http://127.0.0.1:8080``, and ``LLMPROXY_URL`` set for
``llmproxy status``); or a command that needs what this machine lacks (``ELSEWHERE``, with
the reason). A line of none of these kinds fails: a new block must say how it is checked.
The benchmark how-to (docs/benchmarks.md) runs whole, as written, in the slow test below.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.proxy.cli import build_parser
from tests.helpers.proxy import run_proxy

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
DEFAULT = "http://127.0.0.1:8080"

#: commands run here, for real
RUN = (
    "curl -s http://127.0.0.1:8080/",
    ".venv/bin/llmproxy status",
    ".venv/bin/llmproxy serve --help",
)
#: first words of commands that need what this machine lacks
ELSEWHERE = {
    "CUDA_VISIBLE_DEVICES=0": "a GPU and llama-server",
    "CUDA_VISIBLE_DEVICES=1": "a GPU and llama-server",
    "systemctl": "a systemd user session",
    "journalctl": "a systemd user session",
    "until": "part of the benchmark how-to (test_benchmark_how_to_runs_as_written)",
    "kill": "part of the benchmark how-to (test_benchmark_how_to_runs_as_written)",
}


def blocks(page: Path) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", page.read_text(), re.S)


def lines() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in blocks(page):
            for line in block.splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    found.append((page.name, line))
    return found


def argv(line: str) -> list[str]:
    """The words of a command line, without its comment, redirections and ``&``."""
    words = shlex.split(line, comments=True)
    return [w for w in words if w != "&" and not re.match(r"^\d?>", w)]


def test_every_command_line_is_checked_one_way() -> None:
    parser = build_parser()
    makefile = (ROOT / "Makefile").read_text()
    found = lines()
    assert len(found) >= 15
    for page, line in found:
        words = argv(line)
        if words[0] == "make":
            target = words[1] if len(words) > 1 else "serve"
            assert re.search(rf"^{target}:", makefile, re.M), f"{page}: {line}"
        elif words[0] in (".venv/bin/llmproxy", "llmproxy") and "--help" not in words:
            parser.parse_args(words[1:])  # exits (fails the test) on a mistake
        elif not line.startswith(RUN):
            assert words[0] in ELSEWHERE, f"{page}: how is this line checked? {line}"


async def test_runnable_commands_run_as_written(tmp_path: Path) -> None:
    runnable = [(page, line) for page, line in lines() if line.startswith(RUN)]
    assert {line.split("#")[0].split()[1] for _, line in runnable} >= {"-s", "status", "serve"}
    async with FakeUpstream() as fake, run_proxy(fake.url) as px:
        env = {**os.environ, "LLMPROXY_URL": px.url}
        env.pop("LLMPROXY_API_KEY", None)
        for page, line in runnable:
            command = line.replace(DEFAULT, px.url).replace(".venv/bin/", f"{BIN}/")
            proc = await asyncio.create_subprocess_exec(
                "bash", "-euo", "pipefail", "-c", command, cwd=tmp_path, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, f"{page}: {line}\n{err.decode()}"
            assert out, f"{page}: {line} printed nothing"
            if "curl" in command:
                assert b'"content"' in out, out  # the fake's completion, through the proxy


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_benchmark_how_to_runs_as_written(tmp_path: Path) -> None:
    """docs/benchmarks.md's bench burst example, whole: the real model on ports 8012, 8081."""
    how_to = next(b for b in blocks(ROOT / "docs" / "benchmarks.md") if "bench burst" in b)
    if not (_free(8012) and _free(8081)):
        pytest.skip("ports 8012 and 8081, which the how-to uses, are taken on this machine")
    script = how_to.replace(".venv/bin/", f"{BIN}/")
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "http://127.0.0.1:8081" in out and "http://127.0.0.1:8012" in out  # both columns
    assert "bench burst: done in" in err  # its progress, on stderr
