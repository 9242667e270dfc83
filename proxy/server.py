"""Running the proxy app: the shared lifecycle (common/server.py) plus the proxy's part.

The proxy's part: a listening socket inherited from systemd socket activation (refused
beyond loopback without a client key, as the settings refuse such a ``host``), a backlog
sized for a full queue, the parser-error envelope.

Shutdown contract: the first SIGTERM/SIGINT stops accepting connections, answers queued
requests with 503 and lets in-flight requests finish for up to ``shutdown_timeout_s`` in
all (app.py's on_shutdown: the gate closes, then upstream jobs and request handlers are
drained and stragglers cut, a started stream ending with an error event;
gating/registry.py). aiohttp's own connection shutdown comes after that and finds nothing
left to wait for; its timeout (``_WRITE_GRACE_S``, counted twice: wait, then cancel and
wait) is only a backstop. Cleanup then stops the embedded backend
(upstream/embedded.py: at most ``BACKEND_STOP_S``); exit 0. The embedded backend dying on
its own starts the same stop with exit status 1 (a service manager's
``Restart=on-failure`` then restarts both). So a stop takes at most
``shutdown_timeout_s`` + 1 s (handlers' grace) + 2 x ``_WRITE_GRACE_S`` +
``BACKEND_STOP_S`` = ``shutdown_timeout_s`` + 14 s, inside the systemd unit's
``TimeoutStopSec`` (+ 15 s). A second signal exits at once (status 1); the embedded
backend dies with us (PDEATHSIG).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import structlog
from aiohttp import web

from llmproxy.common import loops
from llmproxy.common.config import SettingsError, usage_exit
from llmproxy.common.net import is_loopback
from llmproxy.common.server import Listen, StopRequest
from llmproxy.common.server import serve as run
from llmproxy.proxy.http import parse_errors
from llmproxy.proxy.pool.specs import upstream_specs
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import RELOAD, STOP

log = structlog.get_logger("llmproxy.server")
SD_LISTEN_FDS_START = 3
_WRITE_GRACE_S = 2.0  # aiohttp's part, after our drain (a backstop: nothing should be left)


def inherited_socket() -> socket.socket | None:
    """The listening socket passed by systemd socket activation (LISTEN_FDS), if any.

    Taken before the embedded backend starts, so that neither the socket nor the
    ``LISTEN_*`` variables reach it: the socket is made non-inheritable (uvloop spawns
    children without ``close_fds``, so an inheritable fd would be passed on).
    """
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    if int(os.environ.get("LISTEN_FDS", "0")) < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not inherited by the embedded backend
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.set_inheritable(False)
    return sock


async def serve(
    settings: ProxySettings,
    app: web.Application,
    reread: Callable[[], ProxySettings] | None = None,
) -> int:
    """Serve ``app`` until stopped. ``reread``: SIGHUP builds the settings again with it
    (flags, env and the config file as they are now) and hands them to the app's ``RELOAD``;
    settings with a mistake are refused (logged), and nothing changes."""
    sock = inherited_socket()  # before runner.setup() starts the embedded backend
    stop = app[STOP] = StopRequest()  # signals, and the embedded backend's death

    if sock is not None and not is_loopback(str(sock.getsockname()[0])):
        if not settings.client_keys():  # as the settings refuse for --host
            usage_exit(
                "llmproxy: the socket systemd passed listens beyond loopback: set api_key, "
                "api_key_file or [[keys]], or listen on 127.0.0.1"
            )

    def on_listening(host: str, port: int) -> None:
        url = f"http://{host}:{port}"
        log.info(
            "listening",
            url=url,
            llama_vim=f"{url}/infill",  # what to paste into each editor (README's table)
            continue_dev=f"{url}/",
            page=f"{url}/llmproxy/",
            model=_served(settings),
            socket_activated=sock is not None,
            loop=loops.running(),
        )

    def on_reload() -> None:
        if reread is None or RELOAD not in app:
            log.warning("reload: nothing to reload yet")
            return
        try:
            new = reread()
        except SettingsError as exc:
            log.error("reload refused: invalid settings", error=str(exc))
            return
        app[RELOAD](new)

    listen = Listen(
        host=settings.host,
        port=settings.port,
        port_file=settings.port_file,
        sock=sock,
        # A backlog that holds a full queue's worth of simultaneous connects (the default 128
        # would drop SYNs, stalling new clients, /llmproxy/status probes included, until their
        # SYN is retransmitted); also for systemd's socket, which aiohttp listen()s on again
        # with its own backlog.
        backlog=max(1024, settings.max_queue + 64),
        # aiohttp's: 0 would mean no limit
        shutdown_timeout_s=max(min(settings.shutdown_timeout_s, _WRITE_GRACE_S), 0.01),
        keepalive_timeout_s=settings.idle_timeout_s,  # also bounds slow (slowloris) request headers
        on_reload=on_reload,
    )
    return await run(app, listen, stop, on_ready=parse_errors.install, on_listening=on_listening)


def _served(settings: ProxySettings) -> str:
    """What the start banner says is served: the embedded backend's model, or the upstreams."""
    specs = upstream_specs(settings)
    if specs:
        return "from " + ", ".join(spec.label for spec in specs)
    if settings.model is not None:
        return settings.model.name
    return "SmolLM2-135M-Instruct (the small demo model; --model PATH.gguf for a real one)"
