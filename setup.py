"""Packaging: the package list is derived from the folders, never kept by hand.

Every folder with an ``__init__.py`` under one of ``ROOTS`` is installed as
``llmproxy.<root>.<folder>``; tests/test_packaging.py builds the wheel and checks that every
module made it. The rest of the metadata is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOTS = ("common", "proxy", "backend", "bench")
HERE = Path(__file__).resolve().parent


def packages() -> list[str]:
    found = []
    for root in ROOTS:
        for init in sorted((HERE / root).rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                found.append(".".join(("llmproxy", *init.parent.relative_to(HERE).parts)))
    return found


setup(package_dir={f"llmproxy.{root}": root for root in ROOTS}, packages=packages())
