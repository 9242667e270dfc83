"""One upstream of the scheduler's pool (of one or several): its adapter, permits (gate),
breaker, health and prompt index.

Everything an upstream has when it is the only one, built the same way from its own
settings (specs.py): its permits are its slots and its gate keeps its own session -> slot
affinity, stop confirmation and quarantine; only the queue is the pool's (pool.py).

Concurrency contract: event loop thread only. ``in_rotation`` is read at every grant;
``healthy`` is written by the health probe (health.py) and ``draining`` when the upstream
leaves the pool. The member owns its ClientSession and adapter: ``close`` (the pool's
teardown, after its gate is idle) closes both.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.prefix import PrefixIndex
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.upstreams import UpstreamSpec

#: prefill time per prompt character assumed before one is measured (a small model on CPUs)
PREFILL_S_PER_CHAR = 0.0005


class Member:
    def __init__(
        self,
        spec: UpstreamSpec,
        settings: ProxySettings,
        session: aiohttp.ClientSession,
        adapter: Adapter,
        gate: Gate,
        model: str | None = None,
    ) -> None:
        self.model = model  # a router's model (upstream/adapters/router.py): its own member
        self.spec, self.name = spec, _label(spec, model)
        self.settings, self.session = settings, session
        self.adapter, self.gate = adapter, gate
        self.breaker = CircuitBreaker(settings.breaker_threshold, settings.breaker_cooldown_s)
        self.index = PrefixIndex()
        self.healthy = not adapter.undetected  # it answered detection
        self.draining = False
        self.prefill_s_per_char = PREFILL_S_PER_CHAR
        self.routed = 0  # requests granted here
        self.last_granted = 0.0  # when the last one was (monotonic)
        self.model_loads = 0  # ... of which waited for a router to load the model
        #: the pool's lifecycle, told when re-detection finds a router here (``learnt``)
        self.on_router: Callable[[Member], None] | None = None
        self.prompt_chars = 0  # their prompts' characters ...
        self.cached_chars = 0  # ... of which the index said it held

    @property
    def in_rotation(self) -> bool:
        """May it be granted requests now? Healthy, breaker not open, not leaving, and no
        router found late (its models' members take its place: ``learnt``)."""
        return self.healthy and not self.draining and self.breaker.admissible and not self.router

    @property
    def router(self) -> bool:
        """Is it a llama-server router as a whole (upstream/adapters/router.py)? Only until
        its models' members replace it (pool/lifecycle.py)."""
        return isinstance(self.adapter, LlamaCppAdapter) and self.adapter.router is not None

    @property
    def key(self) -> tuple[str, str | None]:
        """The server it is (its URL) and, on a router, the model: what a reload keeps."""
        return self.spec.url, self.model

    @property
    def models(self) -> tuple[str, ...]:
        """The model names it lists: a router's model, its own and its aliases; else its
        entry's ``models``,
        else the ids its ``/v1/models`` reported at detection (models.py says how the pool
        routes by them)."""
        if self.model is not None:
            return self.adapter.models  # its name first, then its aliases
        return tuple(self.spec.models) if self.spec.models is not None else self.adapter.models

    @property
    def any_model(self) -> bool:
        """Does it serve any model name? A single-model server that states none (models.py)."""
        return self.model is None and self.spec.models is None and len(self.adapter.models) <= 1

    def model_unloaded(self) -> None:
        """The router unloaded this member's model: its prompt caches are gone."""
        self.gate.forget_affinity()
        self.index.clear()

    def fits(self, permits: int) -> bool:
        return permits <= self.gate.total

    def has_room(self, permits: int) -> bool:
        """Are ``permits`` free here now?"""
        return self.gate.free >= permits

    def learnt(self) -> None:
        """Re-detection (upstream/watch.py) found the upstream answering: in rotation (the
        health probe agrees from its next round), and the queue may move."""
        self.healthy = True
        if self.router and self.on_router is not None:
            self.on_router(self)  # a router: its models join as members, and it leaves
        elif self.gate.on_advance is not None:
            self.gate.on_advance()

    def update(self, spec: UpstreamSpec, settings: ProxySettings) -> None:
        """A reload changed this server's entry (name, weight, capacity, models, ...): the member
        stays, with its live slot state; only more permits can be added while it serves
        (fewer need a restart: a permit granted now may name any slot it has)."""
        self.spec, self.name, self.settings = spec, _label(spec, self.model), settings
        self.breaker.threshold = settings.breaker_threshold
        self.breaker.cooldown_s = settings.breaker_cooldown_s

    def load(self) -> float:
        """Permits held per unit of weight (least-busy's measure)."""
        return self.gate.held / max(self.gate.capacity, 1) / self.spec.weight

    def learn_prefill(self, chars: int, ttfb_s: float) -> None:
        """A request prefilled ``chars`` uncached characters and answered after ``ttfb_s``."""
        if chars >= 256:
            rate = ttfb_s / chars
            self.prefill_s_per_char = 0.8 * self.prefill_s_per_char + 0.2 * rate

    def describe(self) -> dict[str, object]:
        gate = self.gate
        return {
            "name": self.name,
            "url": str(self.adapter.base_url),
            "kind": self.adapter.kind,
            "models": list(self.models),
            "models_from": "config" if self.spec.models is not None else "upstream",
            "model_status": self.adapter.describe().get("model_status"),  # a router's model
            "model_loads": self.model_loads,
            "any_model": self.any_model,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state,
            "permits": {"total": gate.capacity, "free": gate.free, "held": gate.held},
            "inflight": gate.inflight,
            "quarantine": gate.quarantined,
            "routed": self.routed,
            "cache_hit_estimate": round(self.cached_chars / self.prompt_chars, 3)
            if self.prompt_chars
            else None,
        }

    async def close(self) -> None:
        self.adapter.close()
        await self.session.close()


def _label(spec: UpstreamSpec, model: str | None) -> str:
    return spec.label if model is None else f"{spec.label}/{model}"
