"""Fixtures of the in-process torch engine tests: one continuous engine for the whole
folder, converting the GGUF once into a temporary weights cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.backend.engine import make_engine


@pytest.fixture(scope="package")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch-cache")


@pytest.fixture(scope="package")
def eng(cache_dir: Path) -> Iterator[Any]:
    e = make_engine(cache_dir)
    yield e
    e.close()
