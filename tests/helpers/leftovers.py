"""The end-of-session check: no process a test started may still run when pytest ends.

Every server a test starts gets ``llmproxy.common.children.child_preexec()`` (it dies with
the test process, a killed ``make test`` included), and every test stops what it starts.
This check (hooks imported by tests/conftest.py) makes a miss loud: pytest becomes a
child subreaper when the session starts, so a process orphaned by a test (its own parent
stopped, it did not) is reparented to pytest rather than to init and stays in view; when
the session ends, every live descendant of pytest is listed on the terminal and killed,
and the run fails (exit status 1) even when every test passed. Descendants get
``GRACE_S`` to finish exiting first (a server told to stop by a test's last teardown).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

import pytest

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 10.0


def _become_subreaper() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:  # not glibc/Linux: orphans go to init, direct children are still seen
        pass


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def live_descendants(root: int) -> list[int]:
    """Pids of the running (not zombie) descendants of ``root``, from /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            states[int(entry.name)] = st[0]
            children.setdefault(st[1], []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            if states[pid] not in ("Z", "X"):
                found.append(pid)
    return sorted(found)


def _describe(pid: int) -> str:
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()
        )
    except OSError:
        cmd = "?"
    st = _stat(pid)
    return f"pid {pid} (parent {st[1] if st else '?'}): {cmd[:300]}"


def pytest_configure(config: pytest.Config) -> None:
    _become_subreaper()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    deadline = time.monotonic() + GRACE_S
    while (left := live_descendants(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not left:
        return
    lines = [_describe(pid) for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    header = (
        f"{len(left)} process(es) started by the tests still running at the end of the session "
        "(killed now)"
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "LEFTOVER PROCESSES", red=True, bold=True)
        reporter.write_line(header, red=True)
        for line in lines:
            reporter.write_line("  " + line, red=True)
    else:
        print(header, *lines, sep="\n  ", flush=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
