"""llama-server in router mode: one port, several models, each a child server with its own
slots, loaded on demand (at most ``--models-max`` at once, the least recently used
unloaded first).

Detection (detect.py) knows a router by its ``/props`` (``"role": "router"``) and reads
its models and their state from ``/v1/models`` (``router_models``). The pool
(pool/lifecycle.py) runs a router as a pool of its models: one member per model, each with
a ``RouterModelAdapter``, so every model has its own permits (its child's slots), slot
affinity, quarantine and stop confirmation, exactly as a plain llama-server has:

- the proxy's probes name the model, and never load one: ``/slots?model=NAME&autoload=false``
  and ``/props?model=...``. A model that is not loaded answers 400 "model is not loaded":
  nothing of it runs, so a stop there is confirmed (``gone``);
- every gated body names the model (its dialect sets ``model`` when the client sent none:
  the router refuses a request without one);
- a model not loaded at detection has no slot count yet: its gate has one permit (watch.py's
  rule for a capacity still to learn). The first request makes the router load it and waits
  for the load in the upstream (its record says so: ``model_loading``); the first health
  round that finds it loaded reads its ``/props`` and the gate grows to its slots;
- ``status`` follows the router's ``/v1/models`` (``unloaded``, ``loading``, ``loaded``),
  read at detection and at every health round (pool/health.py). A model the router unloaded
  keeps its slot count (the same preset loads it again) but loses its prompt caches: the
  member forgets its slot affinity and prefix index then (pool/member.py).

Stops work as on a plain llama-server because the proxy streams the completion routes
upstream (assemble.py): the router drops its child's stream when the proxy drops its own,
while a non-streaming request's child would run to its end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import aiohttp
from yarl import URL

from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import AdapterInfo, get_json
from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.upstream.dialects.llamacpp import LlamaCppDialect


def _not_loaded(status: int, body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return status == 400 and isinstance(message, str) and "not loaded" in message


class RouterModelAdapter(LlamaCppAdapter):
    """One model of a router (see the module's docstring); its relay client talks to the
    router's own URL."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        settings: ProxySettings,
        *,
        model: str,
        status: str,
        aliases: tuple[str, ...] = (),
        max_instances: int | None = None,
    ) -> None:
        self.model = model  # before the base's init, which asks for the first dialect
        super().__init__(base_url, session, settings)
        self.max_instances = max_instances  # models the router runs at once (--models-max)
        self.models = (model, *aliases)  # the names requests may ask it by
        self.status = status
        self.props_pending = True  # its slot count: its /props, once it is loaded

    def probe_url(self, name: str) -> URL:
        return (self.base_url / name).with_query(model=self.model, autoload="false")

    def cold(self) -> bool:
        return self.status != "loaded"

    def gone(self, status: int, body: Any) -> bool:
        """A model the router does not run now (400 "model is not loaded"): nothing of it
        runs, so every slot of it is idle."""
        return _not_loaded(status, body)

    def initial_dialect(self) -> LlamaCppDialect:
        return self.dialect_for(False)

    def dialect_for(self, own: bool) -> LlamaCppDialect:
        """A llama-server child's (never llmproxy's own backend), naming the model."""
        return replace(super().dialect_for(False), model=self.model)

    async def learn(self) -> None:
        """Read the model's ``/props`` and ``/slots`` if it is loaded (detection, and the
        watcher's ``refresh`` until it is)."""
        try:
            status, props = await get_json(self.session, self.probe_url("props"))
        except (aiohttp.ClientError, TimeoutError):
            return
        if status == 200 and isinstance(props, dict):
            self.status = "loaded"
            self.props_pending = False
            self.learn_props(props)
            await self.probe_slots()
        elif not _not_loaded(status, props) and status < 500:
            self.props_pending = False  # a router without per-model /props: one permit
            self.slots_pending = False
        else:
            self.can_confirm = True  # not loaded: its /slots says "nothing runs" (``gone``)

    def pending(self) -> bool:
        """Something to learn by probing, while the model is loaded (watch.py); a model the
        router does not run is looked at only in the health rounds' ``/v1/models`` (a
        router may list hundreds of models: no poll each)."""
        return self.status == "loaded" and super().pending()

    async def refresh(self) -> None:
        if self.props_pending:
            await self.learn()
        elif self.slots_pending and not self.can_confirm:
            await self.probe_slots()

    def noted(self, status: str) -> bool:
        """The router's ``/v1/models`` says ``status`` now: True when it unloaded the model
        since the last look (its prompt caches are gone)."""
        before, self.status = self.status, status
        return before in ("loaded", "loading") and status == "unloaded"

    def describe(self) -> AdapterInfo:
        info = super().describe()
        info["model"], info["model_status"] = self.model, self.status
        return info
