"""The ``--port-file`` handshake of every llmproxy server process (proxy, backend, bench children).

A server started with ``--port 0`` writes the port it bound to a file once it listens;
whoever started it waits for the file and reads the number. ``write_port_file`` writes a
temporary file next to it and renames it into place, so a reader never sees half a number.
A server clears the file when it starts (``clear_port_file``: a file left by an earlier run
would name a port nothing listens on, or someone else's, while this one still starts up)
and removes it when it stops (``remove_port_file``: only if it still holds its own port).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` (one line) to ``path`` atomically, creating its directory if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def clear_port_file(path: Path | None) -> None:
    """Remove a port file left by an earlier run (before this server listens)."""
    if path is not None:
        Path(path).unlink(missing_ok=True)


def remove_port_file(path: Path | None, port: int | None) -> None:
    """Remove the port file at stop, unless another process has written its own port since."""
    if path is None or port is None:
        return
    try:
        if Path(path).read_text().strip() == str(port):
            Path(path).unlink()
    except OSError:
        pass
