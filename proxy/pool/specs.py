"""Which upstreams the pool runs, and each one's settings.

``upstream_specs`` lists the configured upstreams (proxy/upstreams.py: the spec type). An
upstream's own settings are the process settings with its spec's fields put in
(``settings_for``): its adapter, gate and breaker are built from those exactly as the one
upstream's are, so one upstream runs as it always has. Pure functions.
"""

from __future__ import annotations

from typing import Any

from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstreams import UpstreamSpec, configured


def upstream_specs(settings: ProxySettings) -> list[UpstreamSpec]:
    """Every configured upstream, ``upstream``'s first; none: the embedded backend runs."""
    return configured(settings.upstream, settings.upstreams)


def settings_for(settings: ProxySettings, spec: UpstreamSpec) -> ProxySettings:
    """``settings`` as the one upstream ``spec`` would run with."""
    update: dict[str, Any] = {"upstream": spec.url, "upstreams": []}
    if spec.kind is not None:
        update["upstream_kind"] = spec.kind
    if spec.capacity is not None:
        update["capacity"] = spec.capacity
    if spec.api_key is not None:
        update["upstream_api_key"] = spec.api_key
    return settings.model_copy(update=update)
