"""Where the proxy's CPU per request goes: ``llmproxy bench overhead --cprofile FILE``.

With ``--cprofile`` the bench runs its proxy child under ``cProfile`` (``python -m cProfile
-o FILE -m llmproxy.proxy serve ...``), which writes the statistics when the child stops at
the end of the bench. ``split`` reads them back and sums each function's own time by the
part of the stack it belongs to (a folder of ``proxy/``, each third-party package,
asyncio, the event loop, the rest of the standard library, the built-ins: C functions
such as a socket's send or orjson's parser), per gated request the proxy
served (the calls of the gated handler's request reader). The import machinery
(compiling and loading modules at start) is left out: it is paid once, not per request.

The figures are taken under the profiler, which about doubles them; compare parts with one
another and one build with another, not with the CPU per request of the bench's table.
"""

from __future__ import annotations

import pstats
from collections import Counter
from pathlib import Path

#: the function whose calls count the gated requests served
_REQUEST = ("proxy/http/handlers.py", "gated_request")
#: own time that is the import machinery's, paid at start
_STARTUP = ("importlib", "builtins.compile", "marshal.loads", "builtins.exec", "posix.stat")


def _part(filename: str, function: str) -> str:
    """The part a profiled function belongs to (see the module's docstring)."""
    path = filename.replace("\\", "/")
    for root in ("/proxy/", "/common/", "/bench/"):
        if root in path and "site-packages" not in path:
            rest = path.split(root, 1)[1]
            folder = rest.split("/", 1)[0] if "/" in rest else "(top level)"
            return root.strip("/") + ("/" + folder if root == "/proxy/" else "")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if path == "~":  # a built-in (C): isinstance, dict.get, a socket's send, orjson, ...
        return "startup" if any(s in function for s in _STARTUP) else "built-ins"
    if "importlib" in path:
        return "startup"
    if path.endswith("/asyncio/runners.py") and function == "run":
        return "the event loop"  # what runs under it in C: uvloop's callbacks and I/O
    if "/asyncio/" in path:
        return "asyncio"
    return "stdlib"


def split(path: Path) -> tuple[int, list[tuple[str, float]]]:
    """(gated requests served, [(part, own µs per request)], largest first)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    requests = sum(
        calls
        for (filename, _line, function), (_primitive, calls, *_rest) in stats.items()
        if filename.replace("\\", "/").endswith(_REQUEST[0]) and function == _REQUEST[1]
    )
    own: Counter[str] = Counter()
    for (filename, _line, function), (_primitive, _calls, tottime, *_rest) in stats.items():
        own[_part(filename, function)] += tottime
    own.pop("startup", None)
    per = max(requests, 1)
    return requests, [(part, seconds * 1e6 / per) for part, seconds in own.most_common()]


def format_split(path: Path, top: int = 16) -> str:
    """A table of ``split``: the ``top`` parts, then the rest together."""
    requests, parts = split(path)
    lines = [
        f"Proxy CPU by part, own time per gated request under cProfile ({requests} requests; "
        f"the profiler about doubles it): {path}",
        "",
        "| part | µs/request |",
        "|---|---:|",
    ]
    shown, rest = parts[:top], parts[top:]
    lines += [f"| {part} | {us:.1f} |" for part, us in shown]
    if rest:
        lines.append(f"| {len(rest)} others | {sum(us for _p, us in rest):.1f} |")
    lines.append(f"| all | {sum(us for _p, us in parts):.1f} |")
    return "\n".join(lines) + "\n"
