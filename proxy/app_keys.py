"""The app's typed keys for what the process gives it: its settings, the stop request and
the upstream's URL. Apart from state.py (which re-exports them) so that a part the app
state is built from, such as the embedded backend's context (upstream/embedded.py), reads
them without importing the state. Immutable keys only; the values live in the app.
"""

from __future__ import annotations

from aiohttp import web

from llmproxy.common.server import StopRequest
from llmproxy.proxy.settings import ProxySettings

SETTINGS = web.AppKey("settings", ProxySettings)
STOP = web.AppKey("stop", StopRequest)  # set by server.serve; absent when the app runs in tests
UPSTREAM_URL = web.AppKey("upstream_url", str)
