"""Settings loading shared by every llmproxy process.

One frozen pydantic-settings class per process is built exactly once, in the CLI, from
(lowest to highest precedence) field defaults, an optional TOML file (``--config``),
``LLMPROXY_*`` environment variables and command-line flags. The argparse parser is
generated from the settings class, so ``--help`` documents every field with its
``Field(description=...)`` and nothing can drift.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

S = TypeVar("S", bound=BaseSettings)


class LayeredSettings(BaseSettings):
    """Base for process settings: CLI (init kwargs) > env > TOML file > defaults."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if settings_cls.model_config.get("toml_file"):
            sources.append(TomlConfigSettingsSource(settings_cls))
        return tuple(sources)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_sequence(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple, set, frozenset)


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per settings field (defaults suppressed: unset means "not given")."""
    env_prefix = cls.model_config.get("env_prefix", "")
    for name, field in cls.model_fields.items():
        tp = _unwrap_optional(field.annotation)
        default = field.default if field.default_factory is None else field.default_factory()
        if isinstance(default, SecretStr):
            default = "***"
        env = f"{env_prefix}{name}".upper()
        shown = "required" if field.is_required() else f"default: {default!r}"
        help_text = f"{field.description or ''} [env {env}; {shown}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if tp is bool:
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if _is_sequence(tp):
            kwargs["metavar"] = "A,B,..."
            kwargs["type"] = lambda s: [x.strip() for x in s.split(",") if x.strip()]
        elif typing.get_origin(tp) is typing.Literal:
            kwargs["choices"] = [str(c) for c in typing.get_args(tp)]
        parser.add_argument(_flag(name), **kwargs)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML file with settings (same names as the flags, with underscores); "
        "env vars and flags override it",
    )


def settings_from_args(cls: type[S], ns: argparse.Namespace) -> S:
    """Build the settings object from parsed arguments (flags > env > TOML > defaults)."""
    values = {k: v for k, v in vars(ns).items() if k in cls.model_fields}
    config: Path | None = getattr(ns, "config", None)
    target: type[S] = cls
    if config is not None:
        if not config.is_file():
            raise SystemExit(f"llmproxy: config file not found: {config}")
        target = type(cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": config}})
    try:
        return target(**values)
    except ValidationError as exc:
        raise SystemExit(invalid_settings_message(cls, exc)) from None


def invalid_settings_message(cls: type[BaseSettings], exc: ValidationError) -> str:
    """One line per invalid value, naming the flag and env var it can come from (no traceback)."""
    env_prefix = cls.model_config.get("env_prefix", "")
    lines = ["llmproxy: invalid settings:"]
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        name = err["loc"][0] if err["loc"] else None
        if isinstance(name, str) and name in cls.model_fields:
            where = f"{_flag(name)} (env {env_prefix}{name.upper()}, config {name})"
            lines.append(f"  {where}: {msg}; got {err['input']!r}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"  unknown setting {name!r} in the config file")
        else:
            lines.append(f"  {msg}")
    return "\n".join(lines)


def describe(settings: BaseSettings) -> dict[str, Any]:
    """A JSON-safe view of settings with secrets redacted (for the startup log line)."""
    return json.loads(settings.model_dump_json())
