"""The ``--port-file`` handshake of every llmproxy server process (proxy, backend, bench children).

A server started with ``--port 0`` writes the port it bound to a file once it listens;
whoever started it waits for the file and reads the number. ``write_port_file`` writes a
temporary file next to it and renames it into place, so a reader never sees half a number.
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
