"""Configuring several upstreams: ``--upstream`` as a comma list or repeated, TOML
``[[upstreams]]`` tables, and what each upstream's own settings become."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.proxy.pool.specs import settings_for, upstream_specs
from llmproxy.proxy.settings import ProxySettings


def load(argv: list[str]) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ProxySettings)
    return settings_from_args(ProxySettings, parser.parse_args(argv))


def urls(s: ProxySettings) -> list[str]:
    return [spec.url for spec in upstream_specs(s)]


def test_one_upstream_stays_one() -> None:
    s = load(["--upstream", "http://127.0.0.1:8012"])
    assert s.upstream == "http://127.0.0.1:8012" and urls(s) == ["http://127.0.0.1:8012"]
    assert upstream_specs(ProxySettings()) == []  # none: the embedded backend


def test_a_comma_list_or_the_flag_repeated() -> None:
    listed = load(["--upstream", "http://a:1, http://b:2"])
    repeated = load(["--upstream", "http://a:1", "--upstream", "http://b:2"])
    assert urls(listed) == urls(repeated) == ["http://a:1", "http://b:2"]
    assert [spec.label for spec in upstream_specs(listed)] == ["a:1", "b:2"]


def test_toml_tables_with_their_own_settings(tmp_path: Path) -> None:
    cfg = tmp_path / "llmproxy.toml"
    cfg.write_text(
        'upstream = "http://gpu0:8012"\ncapacity = 2\nupstream_kind = "llamacpp"\n'
        '[[upstreams]]\nurl = "http://gpu1:8012"\nname = "gpu1"\ncapacity = 4\n'
        'kind = "openai"\napi_key = "k1"\nweight = 2\n'
    )
    s = load(["--config", str(cfg)])
    first, second = upstream_specs(s)
    assert (first.label, second.label, second.weight) == ("gpu0:8012", "gpu1", 2)
    own = settings_for(s, second)
    assert (own.upstream, own.capacity, own.upstream_kind) == ("http://gpu1:8012", 4, "openai")
    assert own.upstream_api_key is not None and own.upstream_api_key.get_secret_value() == "k1"
    assert own.max_queue == s.max_queue and own.upstreams == []
    inherited = settings_for(s, first)  # what a table does not say comes from the process's
    assert (inherited.capacity, inherited.upstream_kind) == (2, "llamacpp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"upstream": "http://a:1,ftp://b"}, "'ftp://b' must be an http:// or https:// URL"),
        ({"upstream": " , "}, "names no URL"),
        ({"upstream": "http://a:1", "upstreams": ["http://a:1"]}, "upstream named twice: a:1"),
        ({"upstreams": [{"url": "http://a:1", "colour": "red"}]}, "Extra inputs"),
        ({"upstreams": [{"url": "http://u:p@a:1", "api_key": "k"}]}, "either credentials"),
        ({"upstreams": [{"url": "http://a:1", "weight": 0}]}, "greater than 0"),
    ],
)
def test_mistakes_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ProxySettings(**kwargs)  # type: ignore[arg-type]
