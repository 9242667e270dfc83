"""Listening sockets, bound before a server loads anything, with start-up mistakes in one line.

``bind(host, port, backlog)`` resolves ``host`` and binds every address it names (both
loopbacks for ``localhost``) on one port: ``port``, or for 0 the one the first address
got. A port already in use, a name that does not resolve or an address this machine does
not have is a start-up mistake (``SettingsError``: one line on stderr, exit status 2), found
before the embedded backend loads its model. Sockets are non-inheritable (children never
hold the port) and set ``SO_REUSEADDR`` as aiohttp's own sites do.
"""

from __future__ import annotations

import errno
import socket

import structlog

from llmproxy.common.config import usage_exit

log = structlog.get_logger("llmproxy.server")


def _explain(host: str, port: int, exc: OSError) -> str:
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"llmproxy: cannot listen on {where}: the port is already in use (another "
            f"llmproxy or llama-server?); choose another with --port, or stop that process"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"llmproxy: cannot listen on {where}: this machine has no such address (--host)"
    if exc.errno == errno.EACCES:
        return f"llmproxy: cannot listen on {where}: permission denied (a port below 1024?)"
    return f"llmproxy: cannot listen on {where}: {exc.strerror or exc}"


def _addresses(
    host: str, port: int
) -> list[tuple[int, tuple[str, int] | tuple[str, int, int, int]]]:
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        usage_exit(
            f"llmproxy: cannot listen on {host!r}: the name does not resolve ({exc.strerror})"
        )
    seen: list[tuple[int, tuple[str, int] | tuple[str, int, int, int]]] = []
    for family, _type, _proto, _name, addr in infos:
        item = (int(family), addr)
        if item not in seen and family in (socket.AF_INET, socket.AF_INET6):
            seen.append(item)  # type: ignore[arg-type]
    return seen


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address of ``host`` on one port (see the module
    docstring); the caller closes them (aiohttp's sites do, at cleanup)."""
    found = _addresses(host, port)
    socks: list[socket.socket] = []
    for family, addr in found:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            chosen = socks[0].getsockname()[1] if socks else addr[1]
            sock.bind((addr[0], chosen, *addr[2:]))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            if socks:  # a second address (::1 beside 127.0.0.1) this machine may lack
                log.debug("not listening on one address", address=addr[0], error=str(exc))
                continue
            usage_exit(_explain(addr[0], addr[1], exc))
        sock.set_inheritable(False)
        sock.setblocking(False)
        socks.append(sock)
    if not socks:
        usage_exit(f"llmproxy: cannot listen on {host!r}: it names no address")
    return socks
