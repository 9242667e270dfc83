"""The end-of-session check (tests/helpers/leftovers.py), run on an inner pytest session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmproxy.common.children import child_preexec
from tests.helpers.leftovers import live_descendants

SLEEPER = "import time; time.sleep(300)"
INNER = f"""
import os, subprocess, sys
from pathlib import Path

def test_starts_processes():
    direct = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}])
    # its parent exits at once: the orphan is pytest's (a subreaper), not init's
    spawn = ("import subprocess, sys; print(subprocess.Popen("
             "[sys.executable, '-c', {SLEEPER!r}], stdout=subprocess.DEVNULL).pid)")
    middle = subprocess.run([sys.executable, "-c", spawn],
                            stdout=subprocess.PIPE, text=True, check=True)
    Path(os.environ["PIDS"]).write_text(f"{{direct.pid}} {{middle.stdout.strip()}}")
    if os.environ["LEAK"] == "no":
        for pid in (direct.pid, int(middle.stdout)):
            os.kill(pid, 9)
        direct.wait()
"""


@pytest.mark.parametrize("leak", [True, False])
def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path: Path, leak: bool) -> None:
    """An inner session whose test passes but leaves a child and an orphaned grandchild
    running fails (exit status 1), names both and kills them; stopping them passes."""
    (tmp_path / "test_inner.py").write_text(INNER)
    pids_file = tmp_path / "pids"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent / "helpers"),
        "PIDS": str(pids_file),
        "LEAK": "yes" if leak else "no",
    }
    inner = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "leftovers",
            "-p",
            "no:cacheprovider",
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "-q",
            "test_inner.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=child_preexec(),
    )
    pids = [int(p) for p in pids_file.read_text().split()]
    try:
        out = inner.stdout + inner.stderr
        assert "1 passed" in out, out
        if leak:
            assert inner.returncode == 1, out
            assert (
                "LEFTOVER PROCESSES" in out
                and "2 process(es) started by the tests still running" in out
            ), out
            assert all(f"pid {pid} (parent " in out for pid in pids), (pids, out)
        else:
            assert inner.returncode == 0 and "LEFTOVER" not in out, out
        assert not set(pids) & set(live_descendants(1)), "a leftover process still runs"
    finally:
        for pid in set(pids) & set(live_descendants(1)):
            os.kill(pid, signal.SIGKILL)
