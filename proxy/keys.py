"""Client keys: ``api_key``, ``api_key_file`` and the TOML config's ``[[keys]]`` tables.

Every key has a name (the caller it identifies: ``default`` for ``api_key`` and
``api_key_file``). A key file holds the key on its first line; it is read when the settings
are built (start-up, SIGHUP), so a key never appears on a command line where ``ps`` shows
it. Ground: imports none of the proxy's parts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

DEFAULT_NAME = "default"


def read_key_file(path: Path) -> SecretStr:
    """The key on the first line of ``path``; ValueError saying why when there is none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read key file {str(path)!r}: {exc}") from None
    key = text.splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ValueError(f"key file {str(path)!r} is empty")
    return SecretStr(key)


class KeySpec(BaseModel):
    """One client key: ``key`` or ``key_file``, the caller's ``name``, and what the scheduler
    grants that caller (``classes``, ``weight``, ``max_inflight``, ``max_queued``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64, description="The caller this key identifies")
    key: SecretStr | None = Field(default=None, description="The key itself")
    key_file: Path | None = Field(default=None, description="A file whose first line is the key")
    classes: list[Literal["complete", "chat", "bulk"]] | None = Field(
        default=None,
        description="Request classes this caller may use (its best one is the highest its "
        "requests get); default: all",
    )
    weight: float = Field(default=1.0, gt=0, description="Its share among callers in one class")
    max_inflight: int | None = Field(
        default=None, ge=1, description="At most this many of its requests run at once"
    )
    max_queued: int | None = Field(
        default=None, ge=0, description="At most this many of its requests wait; more get 429"
    )

    @model_validator(mode="after")
    def _one_source(self) -> KeySpec:
        if (self.key is None) == (self.key_file is None):
            raise ValueError(f"key {self.name!r}: give exactly one of key and key_file")
        if self.key is not None and not self.key.get_secret_value().strip():
            raise ValueError(f"key {self.name!r} is empty")
        return self

    def secret(self) -> SecretStr:
        if self.key is not None:
            return SecretStr(self.key.get_secret_value().strip())
        assert self.key_file is not None
        return read_key_file(self.key_file)


def client_keys(
    api_key: SecretStr | None, api_key_file: Path | None, specs: list[KeySpec]
) -> tuple[tuple[str, bytes], ...]:
    """(name, key) for every configured client key; ValueError for a name or key twice."""
    named: list[tuple[str, SecretStr]] = []
    if api_key is not None:
        named.append((DEFAULT_NAME, api_key))
    if api_key_file is not None:
        named.append((DEFAULT_NAME, read_key_file(api_key_file)))
    named += [(spec.name, spec.secret()) for spec in specs]
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(
            "each key needs a name of its own (api_key and api_key_file are both 'default')"
        )
    values = [k.get_secret_value() for _, k in named]
    if len(set(values)) != len(values):
        raise ValueError("the same key is configured twice")
    if any(not v for v in values):
        raise ValueError("a configured key is empty")
    return tuple((n, v.encode()) for n, v in zip(names, values, strict=True))
