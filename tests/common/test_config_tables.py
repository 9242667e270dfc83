"""A mistake inside a config table (``[[upstreams]]``, ``[[keys]]``) names the entry and key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.proxy.settings import ProxySettings


def load_config(tmp_path: Path, text: str) -> ProxySettings:
    cfg = tmp_path / "llmproxy.toml"
    cfg.write_text(text)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ProxySettings)
    return settings_from_args(ProxySettings, parser.parse_args(["--config", str(cfg)]))


def test_a_misspelled_key_in_an_upstream_table_is_named(tmp_path: Path) -> None:
    tables = '[[upstreams]]\nurl = "http://127.0.0.1:8012"\n' * 2 + 'nmae = "gpu-b"\n'
    with pytest.raises(
        SystemExit, match=r"--upstreams \(.*config upstreams\): unknown key 'nmae' in entry 2$"
    ):
        load_config(tmp_path, tables)


def test_a_bad_value_in_an_upstream_table_names_entry_and_key(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"config upstreams\): entry 1, capacity: .*integer"):
        load_config(tmp_path, '[[upstreams]]\nurl = "http://127.0.0.1:8012"\ncapacity = "x"\n')
