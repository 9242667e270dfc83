"""Child server processes never outlive the process that started them (Linux).

Shared by every llmproxy process that starts another (the proxy's embedded backend, the
bench's children) and by the tests: ``child_preexec()`` is a ``preexec_fn`` that gives the
child PR_SET_PDEATHSIG (SIGTERM when its parent dies, even by SIGKILL). A process that
cannot set it on its child, such as a shell script, can ask for the same on itself with
``llmproxy backend --exit-with-parent`` (``exit_with_parent``). Elsewhere (not glibc or
not Linux) both are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc/Linux
        return None


def child_preexec(cloexec: bool = True) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when this process dies (PR_SET_PDEATHSIG)
    and, with ``cloexec``, keeps no file descriptor beyond 0-2 across exec.

    The second is what asyncio's subprocesses do (``close_fds=True``) and uvloop's do not
    (it spawns with every inheritable fd, e.g. one this process inherited from its own
    parent): every fd from 3 up is marked close-on-exec (``close_range`` with
    CLOSE_RANGE_CLOEXEC, Linux >= 5.11 and glibc >= 2.34; skipped where missing). Marking
    rather than closing leaves the loop's own exec-status pipe working. Pass
    ``cloexec=False`` with ``pass_fds``, which this would close.

    The signal is tied to the thread that starts the child: start it from one that lives as
    long as the process (the event loop's). libc is resolved here, in the parent, so the
    child does no dynamic loading between fork and exec; if the parent died before
    ``prctl`` took effect, the child exits at once.
    """
    parent = os.getpid()
    libc = _libc()
    if libc is None:
        return lambda: None
    prctl = libc.prctl
    close_range = getattr(libc, "close_range", None) if cloexec else None
    if close_range is not None:
        close_range.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_int)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
        if close_range is not None:
            close_range(3, 0xFFFFFFFF, 4)  # CLOSE_RANGE_CLOEXEC; an old kernel's ENOSYS is ignored

    return preexec


def exit_with_parent(parent: int) -> bool:
    """This process gets SIGTERM when its parent dies (PR_SET_PDEATHSIG on itself).

    ``parent``: the parent's pid as read at start-up. False when the parent is already
    gone (this process was reparented before the signal was set up: the caller should
    stop); True otherwise, also where the signal is not available."""
    libc = _libc()
    if libc is None:
        return True
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == parent
