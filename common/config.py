"""Settings loading shared by every llmproxy process.

One frozen pydantic-settings class per process is built exactly once, in the CLI, from
(lowest to highest precedence) field defaults, an optional TOML file (``--config``),
``LLMPROXY_*`` environment variables and command-line flags. The argparse parser is
generated from the settings class, so ``--help`` documents every field with its
``Field(description=...)`` and nothing can drift.

A start-up mistake (a bad value from any layer, a flag given more than once, a config file
that is missing or not valid TOML, an environment value that cannot be parsed) ends the
process with exit status 2 and ``llmproxy: invalid settings:`` followed by one line per
mistake, never a traceback (``SettingsError``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
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
from pydantic_settings import (
    SettingsError as SourceError,
)

from llmproxy.common.redact import redact_urls, redact_values

S = TypeVar("S", bound=BaseSettings)
EXIT_USAGE = 2  # what argparse exits with for a bad command line
_REPEATED = "_llmproxy_repeated"  # namespace attribute: [(dest, values), ...] of flags given twice


class SettingsError(SystemExit):
    """A start-up mistake: exit status 2; ``str()`` is the message (already on stderr)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def usage_exit(message: str) -> typing.NoReturn:
    """Write ``message`` to stderr and raise ``SettingsError`` (exit status 2)."""
    print(message, file=sys.stderr, flush=True)
    raise SettingsError(message)


def fail(lines: list[str]) -> typing.NoReturn:
    """``usage_exit`` with ``llmproxy: invalid settings:`` and ``lines``, one per mistake."""
    usage_exit("\n".join(["llmproxy: invalid settings:", *(f"  {ln}" for ln in lines)]))


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


def _note_repeat(ns: argparse.Namespace, dest: str, values: Any) -> None:
    """Record a flag given again (an earlier occurrence already set ``dest``)."""
    if hasattr(ns, dest):
        setattr(ns, _REPEATED, [*getattr(ns, _REPEATED, []), (dest, values)])


class _Once(argparse._StoreAction):
    """``store``, remembering a second occurrence for ``settings_from_args`` to reject."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        ns: argparse.Namespace,
        values: Any,
        option: Any = None,
    ) -> None:
        _note_repeat(ns, self.dest, values)
        super().__call__(parser, ns, values, option)


class _Joined(argparse.Action):
    """A flag that may be repeated: its values are joined with commas (a comma list)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        ns: argparse.Namespace,
        values: Any,
        option: Any = None,
    ) -> None:
        earlier = getattr(ns, self.dest, None)
        setattr(ns, self.dest, f"{earlier},{values}" if earlier else values)


class _BoolOnce(argparse.BooleanOptionalAction):
    """``--x/--no-x``, remembering a second occurrence of either for ``settings_from_args``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        ns: argparse.Namespace,
        values: Any,
        option: Any = None,
    ) -> None:
        _note_repeat(ns, self.dest, option)
        super().__call__(parser, ns, values, option)


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per settings field (defaults suppressed: unset means "not given").

    Each flag, ``--config`` included, may be given once: ``settings_from_args`` rejects a
    repeat (a list setting takes its items comma-separated in one flag), except a string
    field marked ``json_schema_extra={"repeatable": True}``, whose repeats make a comma list."""
    env_prefix = cls.model_config.get("env_prefix", "")
    for name, field in cls.model_fields.items():
        tp = _unwrap_optional(field.annotation)
        default = field.get_default(call_default_factory=True)
        if isinstance(default, SecretStr):
            default = "***"
        env = f"{env_prefix}{name}".upper()
        shown = "required" if field.is_required() else f"default: {default!r}"
        help_text = f"{field.description or ''} [env {env}; {shown}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if tp is bool:
            parser.add_argument(_flag(name), action=_BoolOnce, **kwargs)
            continue
        if _is_sequence(tp):
            kwargs["metavar"] = "A,B,..."
            kwargs["type"] = lambda s: [x.strip() for x in s.split(",") if x.strip()]
        elif typing.get_origin(tp) is typing.Literal:
            kwargs["choices"] = [str(c) for c in typing.get_args(tp)]
        extra = field.json_schema_extra
        repeatable = isinstance(extra, dict) and extra.get("repeatable") is True
        parser.add_argument(_flag(name), action=_Joined if repeatable else _Once, **kwargs)
    parser.add_argument(
        "--config",
        action=_Once,
        type=Path,
        default=argparse.SUPPRESS,
        help="TOML file with settings (same names as the flags, with underscores); "
        "env vars and flags override it",
    )


def settings_from_args(cls: type[S], ns: argparse.Namespace) -> S:
    """Build the settings object from parsed arguments (flags > env > TOML > defaults);
    a mistake ends the process (``fail``: exit status 2, no traceback)."""
    env_prefix = cls.model_config.get("env_prefix", "")
    repeated = getattr(ns, _REPEATED, [])
    if repeated:
        fail(
            [
                f"{_flag(dest)} is given more than once (again as {_shown(values)!r}); give it once"
                for dest, values in repeated
            ]
        )
    values = {k: v for k, v in vars(ns).items() if k in cls.model_fields}
    config: Path | None = getattr(ns, "config", None)
    target: type[S] = cls
    if config is not None:
        _check_toml(config)
        target = type(
            cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": config}}
        )
    try:
        return target(**values)
    except ValidationError as exc:
        fail(_invalid_lines(cls, exc))
    except SourceError as exc:  # an env value of a list setting that is not JSON
        m = re.search(r'field "(\w+)"', str(exc))
        name = m.group(1) if m else "?"
        raw = os.environ.get(f"{env_prefix}{name}".upper())
        fail(
            [
                f"env {env_prefix}{name.upper()}: cannot parse {raw!r} "
                f'({exc.__cause__ or exc}); a list from the environment is JSON, e.g. \'["a","b"]\''
            ]
        )


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _check_toml(config: Path) -> None:
    """``--config``: an existing file that is valid TOML (else ``fail`` names the problem)."""
    if not config.is_file():
        fail([f"--config: file not found: {config}"])
    try:
        tomllib.loads(config.read_bytes().decode("utf-8"))
    except OSError as exc:
        fail([f"--config: cannot read {config}: {exc.strerror or exc}"])
    except UnicodeDecodeError as exc:
        fail([f"--config: {config} is not UTF-8 text: {exc.reason} at byte {exc.start}"])
    except tomllib.TOMLDecodeError as exc:
        fail([f"--config: {config} is not valid TOML: {exc}"])


def _invalid_lines(cls: type[BaseSettings], exc: ValidationError) -> list[str]:
    """One line per invalid value, naming the flag and env var it can come from."""
    env_prefix = cls.model_config.get("env_prefix", "")
    lines = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        name = err["loc"][0] if err["loc"] else None
        inner = err["loc"][1:]  # inside a table or list: which entry, which key
        if inner and err["type"] == "extra_forbidden":
            entry = f" in entry {inner[0] + 1}" if isinstance(inner[0], int) else ""
            msg = f"unknown key {inner[-1]!r}{entry}"
        elif inner:
            where = ", ".join(f"entry {p + 1}" if isinstance(p, int) else str(p) for p in inner)
            msg = f"{where}: {msg}"
        if isinstance(name, str) and name in cls.model_fields:
            where = f"{_flag(name)} (env {env_prefix}{name.upper()}, config {name})"
            got = "" if _holds_secrets(cls, name) else f"; got {redact_urls(repr(err['input']))}"
            lines.append(f"{where}: {redact_urls(msg)}{got}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {name!r} in the config file")
        else:
            lines.append(redact_urls(msg))
    return lines


def _holds_secrets(cls: type[BaseSettings], name: str) -> bool:
    """Does field ``name`` hold keys (a ``SecretStr``, or a list of tables with one)? Its
    invalid value is then never echoed back."""
    text = repr(cls.model_fields[name].annotation)
    return "SecretStr" in text or any(
        "SecretStr" in repr(f.annotation)
        for tp in typing.get_args(cls.model_fields[name].annotation)
        for f in getattr(tp, "model_fields", {}).values()
    )


def describe(settings: BaseSettings) -> dict[str, Any]:
    """A JSON-safe view of settings with secrets redacted (for the startup log line): keys
    masked, and the credentials of every URL (``http://user:***@host``)."""
    shown: dict[str, Any] = redact_values(json.loads(settings.model_dump_json()))
    return shown
