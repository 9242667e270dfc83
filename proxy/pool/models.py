"""Which upstreams serve a request's model: the first step of admission (pool.py), before
``--route`` picks among them (router.py).

The model a request asks for (``asked``): the ``model`` field of its JSON body; without one,
``default_model`` of its route's class (gating/classes.py ``route_class``: ``/infill`` is
``complete``, ``/v1/chat/completions`` ``chat``); without that, the first model an upstream
states (its ``models``, or a router's model: upstream/adapters/router.py, in the pool's
order: the config's, a router's in its listing's, an upstream a reload adds after);
with none stated, no model: any upstream serves the request, as one upstream always did.

An upstream's models (``Member.models``): the ``models`` its entry states, else the ids its
``/v1/models`` reported at detection (learnt; upstream/detect.py), else none. Which names
it serves:

- one that states its models serves exactly those;
- one that states none and reported at most one model is a single-model server that
  ignores the name (llama-server, llama-cpp-python, llmproxy's backend): it serves any name
  (``Member.any_model``);
- one that states none and reported several (Ollama, vLLM with adapters, a llama-server
  router) serves exactly those.

A name some upstream lists (stated or learnt) goes only to the upstreams that list it,
the single-model servers that take any name included only if they list it too; a name none
lists goes to those that take any name; with none of those, it is refused with 404
(``UnknownModel``) naming the models the upstreams list. So a learnt model id steers the
requests that name it, but never makes a name unknown while any upstream is a single-model
server that states nothing: names are refused only once every upstream states its models
(or lists several). Draining upstreams count for nothing.

Pure functions of the members and the settings; event loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmproxy.proxy.errors import UnknownModel
from llmproxy.proxy.gating.classes import route_class
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.request import Body
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter


def asked(
    route: str, parsed: Body, defaults: Mapping[str, str], members: Iterable[Member]
) -> str | None:
    """The model a request on ``route`` with body ``parsed`` asks for (see the module's
    docstring); None: any upstream."""
    name = parsed.get("model") if isinstance(parsed, dict) else None
    if isinstance(name, str) and name:
        return name
    default = defaults.get(route_class(route))
    if default:
        return default
    return next((m.models[0] for m in members if _states(m) and not m.draining), None)


def _states(m: Member) -> bool:
    """Does ``m`` state its models: its entry lists them, or it is a router's model?"""
    return bool(m.spec.models) or m.model is not None


def serving(members: Sequence[Member], name: str | None) -> list[Member]:
    """The upstreams of ``members`` (draining ones aside) that serve ``name`` (None: all),
    in rotation or not; ``UnknownModel`` if none does and none takes any name."""
    present = [m for m in members if not m.draining]
    if name is None:
        return present
    listed = [m for m in present if name in m.models]
    if listed:
        return listed
    anyone = [m for m in present if m.any_model]
    if anyone or not present:
        return anyone
    known = sorted({model for m in present for model in m.models})
    raise UnknownModel(f"model {name!r} is not served here; models: {', '.join(known)}")


class Held:
    """The upstreams kept, during one pass over the queue (grant.py), for waiters that
    could not be granted yet: a waiter behind them is granted only on another upstream
    that serves its model, so no one overtakes a waiter on the upstreams it waits for, and
    a model's waiters never wait for another model's upstreams."""

    def __init__(self) -> None:
        self.passed: set[Any] = set()  # the waiters held (pool.Entry)
        self._members: set[int] = set()  # id() of the members kept for them

    def __contains__(self, member: Member) -> bool:
        return id(member) in self._members

    def hold(self, waiter: Any, members: Iterable[Member], rotation: Iterable[Member]) -> bool:
        """``waiter`` waits for ``members``: keep them; True once every upstream in
        ``rotation`` is kept (nobody behind can be granted: the pass ends)."""
        self.passed.add(waiter)
        self._members.update(id(m) for m in members)
        return all(id(m) in self._members for m in rotation)


def may_load(m: Member, members: Sequence[Member]) -> bool:
    """May a request be granted on ``m`` now without making its router unload a model that
    runs requests? No only when ``m`` is a router's model it does not run, the router runs
    as many models as it may (``max_instances``) and every one of them holds requests: the
    request then waits until one is idle (the router unloads its least recently used), and
    never cuts another model's generations. Requests for the loaded models go on meanwhile."""
    a = m.adapter
    if not isinstance(a, RouterModelAdapter) or not a.cold() or not a.max_instances:
        return True
    if m.gate.inflight:
        return True  # its load is under way already
    running = [o for o in _siblings(m, members) if _runs(o)]
    return len(running) < a.max_instances or any(not o.gate.inflight for o in running)


def loading(m: Member, members: Sequence[Member]) -> None:
    """A request was granted on ``m``, a router's model it does not run: the router loads
    it now, and unloads its least recently used model if it runs as many as it may. Said
    here at once (the next health round reads what the router says)."""
    a = m.adapter
    if not isinstance(a, RouterModelAdapter) or a.status != "unloaded":
        return  # loaded, or its load under way already
    a.status = "loading"
    running = [o for o in _siblings(m, members) if _runs(o)]
    if a.max_instances and len(running) >= a.max_instances:
        idle = [o for o in running if not o.gate.inflight] or running
        lru = min(idle, key=lambda o: o.last_granted)
        assert isinstance(lru.adapter, RouterModelAdapter)
        if lru.adapter.noted("unloaded"):
            lru.model_unloaded()


def _siblings(m: Member, members: Sequence[Member]) -> list[Member]:
    """The other models of ``m``'s router."""
    return [
        o
        for o in members
        if o is not m
        and isinstance(o.adapter, RouterModelAdapter)
        and o.adapter.base_url == m.adapter.base_url
    ]


def _runs(m: Member) -> bool:
    return isinstance(m.adapter, RouterModelAdapter) and m.adapter.status != "unloaded"
