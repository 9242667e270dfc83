"""A bench's child servers (bench/child.py) never outlive the bench."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from llmproxy.common.children import child_preexec

_PARENT = """
import asyncio, sys
from pathlib import Path
from llmproxy.bench.child import child

async def main():
    argv = [sys.executable, "-m", "llmproxy.bench.fake.upstream",
            "--port", "0", "--log-level", "warning"]
    async with child("fake", argv, Path(sys.argv[1]), 60) as (pid, _url):
        print(pid, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def test_bench_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A bench killed without cleanup (SIGKILL) leaves no orphan server behind."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=child_preexec(),
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        os.kill(pid, 0)  # the child runs
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + 20
    while (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2:3]
    ):
        assert time.monotonic() < deadline, "bench child outlived its parent"
        time.sleep(0.05)
