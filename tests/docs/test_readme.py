"""README.md: the generated configuration reference is current; links and commands are real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from llmproxy.backend.settings import BackendSettings
from llmproxy.proxy.cli import build_parser
from llmproxy.proxy.reference import BEGIN, END, config_markdown, splice
from llmproxy.proxy.settings import ProxySettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_config_reference_is_current() -> None:
    assert README.count(BEGIN) == 1 and README.count(END) == 1
    assert splice(README) == README, "run: python -m llmproxy.proxy.reference --write"
    for cls in (ProxySettings, BackendSettings):
        for name in cls.model_fields:
            assert f"`--{name.replace('_', '-')}`" in config_markdown()


def test_docs_ref_check_detects_a_stale_reference(tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    stale = README.replace("| `--max-queue` |", "| `--max-queue-old` |")
    (tmp_path / "README.md").write_text(stale)
    (tmp_path / "examples" / "llmproxy.toml").write_text(
        (ROOT / "examples" / "llmproxy.toml").read_text()
    )
    run = [sys.executable, "-m", "llmproxy.proxy.reference"]
    assert subprocess.run([*run, "--check"], cwd=tmp_path, capture_output=True).returncode == 1
    assert subprocess.run([*run, "--write"], cwd=tmp_path).returncode == 0
    assert (tmp_path / "README.md").read_text() == README


def test_quick_start_is_the_two_make_targets() -> None:
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.search(r"```sh\n(.*?)```", quick, re.S)
    assert commands is not None
    assert [ln.split()[:2] for ln in commands.group(1).splitlines()] == [
        ["make", "serve"],
        ["make", "test"],
    ]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_relative_links_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_editor_table_links_every_example() -> None:
    for path in (ROOT / "examples").iterdir():
        if path.name not in ("README.md", "llmproxy.toml"):
            assert f"(examples/{path.name})" in README, path.name


def test_llmproxy_commands_in_readme_parse() -> None:
    parser = build_parser()
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", README, re.S))
    lines = [
        ln.split("#")[0].split("&")[0].split("2>")[0]
        for ln in blocks.splitlines()
        if ln.startswith("llmproxy ")
    ]
    assert len(lines) >= 4
    for line in lines:
        argv = line.replace('"$BACKEND"', "http://127.0.0.1:1").split()[1:]
        parser.parse_args(argv)
