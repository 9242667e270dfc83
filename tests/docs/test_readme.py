"""README.md and docs/: the generated configuration reference is current, links are real, and
the README fits a screen (its commands run: test_commands.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from llmproxy.backend.settings import BackendSettings
from llmproxy.proxy.reference import BEGIN, DOC, END, config_markdown, splice
from llmproxy.proxy.settings import ProxySettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIG = (ROOT / DOC).read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_config_reference_is_current() -> None:
    assert CONFIG.count(BEGIN) == 1 and CONFIG.count(END) == 1
    assert BEGIN not in README  # it moved to docs/configuration.md
    assert splice(CONFIG) == CONFIG, "run: python -m llmproxy.proxy.reference --write"
    for cls in (ProxySettings, BackendSettings):
        for name in cls.model_fields:
            assert f"`--{name.replace('_', '-')}`" in config_markdown()


def test_docs_ref_check_detects_a_stale_reference(tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "docs").mkdir()
    stale = CONFIG.replace("| `--max-queue` |", "| `--max-queue-old` |")
    assert stale != CONFIG
    (tmp_path / DOC).write_text(stale)
    (tmp_path / "examples" / "llmproxy.toml").write_text(
        (ROOT / "examples" / "llmproxy.toml").read_text()
    )
    run = [sys.executable, "-m", "llmproxy.proxy.reference"]
    assert subprocess.run([*run, "--check"], cwd=tmp_path, capture_output=True).returncode == 1
    assert subprocess.run([*run, "--write"], cwd=tmp_path).returncode == 0
    assert (tmp_path / DOC).read_text() == CONFIG


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


def test_readme_fits_a_screen_and_keeps_its_sections() -> None:
    assert len(README.splitlines()) <= 125
    headings = re.findall(r"^## (.+)$", README, re.M)
    for needed in ("Quick start", "Editor setup", "Use a real code model", "How it works",
                   "See it work", "Who can use it", "Where next"):  # fmt: skip
        assert needed in headings, needed
    assert "![" in README and "(docs/page.png)" in README  # the live page's screenshot
    who = README.split("## Who can use it", 1)[1].split("\n## ", 1)[0]
    assert [ln.split(":**")[0] for ln in who.splitlines() if ln.startswith("- **")] == [
        "- **Who reaches it",
        "- **Web pages are kept out",
        "- **What it protects",
        "- **What it does not",
    ]


def test_relative_links_exist() -> None:
    for page in PAGES:
        links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
        for link in links:
            if not link.startswith("http"):
                assert (page.parent / link).exists(), f"{page.name}: {link}"
    assert "docs/configuration.md" in README and "docs/troubleshooting.md" in README


def test_editor_table_links_every_example() -> None:
    for path in (ROOT / "examples").iterdir():
        if path.name not in ("README.md", "llmproxy.toml"):
            assert f"(examples/{path.name})" in README, path.name
