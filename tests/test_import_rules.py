"""The import rules of docs/design.md, read from the source with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUMBING = {"config", "logs", "loops", "portfile", "children"}  # process plumbing both servers use
HTTP = {
    "aiohttp",
    "llmproxy.proxy.http.handlers",
    "llmproxy.proxy.http.middleware",
    "llmproxy.proxy.upstream.responder",
    "llmproxy.proxy.upstream.forward",
    "llmproxy.proxy.upstream.client",
}


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as a dotted name (``from a import b`` gives ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(folder: str) -> list[Path]:
    found = sorted((ROOT / folder).rglob("*.py"))
    assert found, folder
    return found


def test_the_backend_imports_only_the_process_plumbing_from_the_proxy() -> None:
    wrong = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources("backend")
        for name in imports(path)
        if name.startswith("llmproxy.proxy.") and name.split(".")[2] not in PLUMBING
    }
    assert not wrong, sorted(wrong)


def test_the_product_does_not_import_the_benches() -> None:
    product = [p for p in sources("proxy") if "bench" not in p.relative_to(ROOT / "proxy").parts]
    product += [p for p in sources("backend") if not p.name.startswith(("bench_", "gpu_check"))]
    allowed = {ROOT / "proxy" / "cli.py"}  # registers the bench commands
    wrong = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in product
        if path not in allowed
        for name in imports(path)
        if name.startswith("llmproxy.bench")
    }
    assert not wrong, sorted(wrong)


def test_the_gate_imports_no_http_code() -> None:
    assert not imports(ROOT / "proxy" / "gate.py") & HTTP
