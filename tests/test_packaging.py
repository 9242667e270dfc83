"""The wheel holds every module of every package folder, and nothing else of the tree.

setup.py derives the package list from the folders; this builds the wheel from a copy of
the sources (the working tree is left alone) and compares its modules with the files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("common", "proxy", "backend", "bench")


def modules_on_disk() -> set[str]:
    return {
        "llmproxy/" + path.relative_to(ROOT).as_posix()
        for root in ROOTS
        for path in (ROOT / root).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_every_folder_with_modules_is_a_package() -> None:
    """A folder of modules without ``__init__.py`` would be left out of the wheel."""
    missing = sorted(
        str(folder.relative_to(ROOT))
        for root in ROOTS
        for folder in [ROOT / root, *(ROOT / root).rglob("*")]
        if folder.is_dir()
        and folder.name != "__pycache__"
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
    )
    assert not missing


@pytest.mark.slow
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for root in ROOTS:
        shutil.copytree(ROOT / root, src / root, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("llmproxy-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    packaged = {n for n in names if n.endswith(".py")}
    assert packaged == modules_on_disk()
    page = ROOT / "proxy" / "http" / "page"
    files = {f"llmproxy/proxy/http/page/{p.name}" for p in page.glob("*.*") if p.suffix != ".py"}
    assert len(files) == 3 and files <= names  # the live page's files ship
