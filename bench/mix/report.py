"""The table and goals of ``llmproxy bench mix`` (run.py)."""

from __future__ import annotations

import math
from typing import Any

from llmproxy.bench.mix.settings import MixSettings


def _ratio(ms: float, t_ms: float) -> float:
    return ms / t_ms if t_ms and not math.isnan(ms) else math.nan


def format_table(rows: list[dict[str, Any]], s: MixSettings) -> str:
    head = (
        f"bench mix: {s.editors} editors ({s.profile}), {s.agents} agents "
        f"({s.agent_tokens}-token chat streams), {s.slots} slots, {s.bursts} bursts\n\n"
        "| target | T ms | editor last p50 ms | x T | last p95 ms | x T | agent tokens/s "
        "| errors (editors / agents) | deferred at the server |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['target']} | {r['T_ms']:.0f} | {r['last_p50_ms']:.0f} "
        f"| {_ratio(r['last_p50_ms'], r['T_ms']):.2f} | {r['last_p95_ms']:.0f} "
        f"| {_ratio(r['last_p95_ms'], r['T_ms']):.2f} | {r['agent_tokens_per_s']:.0f} "
        f"| {r['editor_errors']} / {r['agent_errors']} | {r['deferred_at_server']} |\n"
        for r in rows
    ]
    verdicts = goals(rows)
    tail = "".join(
        f"\n{goal}: {value} ({'PASS' if ok else 'FAIL' if ok is False else 'n/a'})"
        for goal, value, ok in verdicts
    )
    return head + "".join(lines) + tail + "\n"


def goals(rows: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    by = {r["target"]: r for r in rows}
    out: list[tuple[str, str, bool | None]] = []
    if "classes" in by:
        c = by["classes"]
        ratio = _ratio(c["last_p50_ms"], c["T_ms"])
        out.append(("classes: editor last p50 <= 1.2 x T", f"{ratio:.2f} x T", ratio <= 1.2))
        if "fifo" in by and by["fifo"]["agent_tokens_per_s"] > 0:
            share = c["agent_tokens_per_s"] / by["fifo"]["agent_tokens_per_s"]
            out.append(("classes: agent tokens/s >= 0.8 x fifo's", f"{share:.2f}", share >= 0.8))
    errors = sum(r["editor_errors"] + r["agent_errors"] for r in rows if r["target"] != "direct")
    out.append(("no errors through the proxy", str(errors), errors == 0))
    return out
