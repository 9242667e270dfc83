"""What an upstream the proxy fronts is: ``--upstream`` (one URL, a comma list, or the
flag repeated) and the TOML config's ``[[upstreams]]`` tables, each an ``UpstreamSpec``.

The settings' field types and their checks, read by the settings (settings.py) and by the
pool (pool/specs.py); imports nothing of the proxy. Pure values and functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from yarl import URL

Kind = Literal["auto", "llamacpp", "openai", "ollama"]
RoutePolicy = Literal["cache", "session", "least-busy", "round-robin"]


def check_base_url(url: str) -> str:
    """``url`` if it is an http(s) base URL with a host, else ValueError saying why."""
    try:
        parsed = URL(url)
    except ValueError as exc:
        raise ValueError(f"not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(
            f"{url!r} must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8012"
        )
    if parsed.query_string or parsed.fragment:
        raise ValueError(f"{url!r} must be a base URL without a query or fragment")
    return url


def split_urls(value: str) -> list[str]:
    """The URLs of an ``upstream`` value (one, or a comma list), each checked."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise ValueError("names no URL")
    return [check_base_url(u) for u in urls]


class UpstreamSpec(BaseModel):
    """One upstream: its URL and what may differ from the process-wide settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(description="Base URL")
    name: str | None = Field(
        default=None, description="Shown in logs and metrics; default host:port"
    )
    kind: Kind | None = Field(default=None, description="Adapter; default: upstream_kind")
    capacity: int | None = Field(default=None, ge=1, description="Permits; default: capacity")
    api_key: SecretStr | None = Field(default=None, description="Default: upstream_api_key")
    weight: float = Field(
        default=1.0, gt=0, description="Share of the load (least-busy, round-robin)"
    )
    models: list[str] | None = Field(
        default=None,
        description="The model names it serves (a request's `model`); stated, it serves "
        "only these; default: what its /v1/models reports (see Several models)",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_base_url(url)

    @field_validator("models")
    @classmethod
    def _models(cls, models: list[str] | None) -> list[str] | None:
        if models is None:
            return None
        if not models or any(not m.strip() for m in models):
            raise ValueError("models must name at least one model, each a non-empty name")
        if len(set(models)) != len(models):
            raise ValueError("models names a model twice")
        return models

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        u = URL(self.url)
        return f"{u.host}:{u.port}" if u.port is not None else str(u.host)


def coerce_spec(item: Any) -> Any:
    """A bare URL string in ``upstreams`` (a flag or env list) is ``{"url": ...}``."""
    return {"url": item} if isinstance(item, str) else item


def configured(upstream: str | None, upstreams: Iterable[UpstreamSpec]) -> list[UpstreamSpec]:
    """Every upstream that ``upstream`` (the flag's value) and ``upstreams`` (the tables)
    name, ``upstream``'s first; ValueError when two have one label."""
    urls = split_urls(upstream) if upstream else []
    specs = [UpstreamSpec(url=u) for u in urls] + list(upstreams)
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"upstream named twice: {', '.join(dup)} (give each its own name)")
    return specs
