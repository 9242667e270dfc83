"""The tables and goals of ``llmproxy bench mix`` (run.py).

Editors beside agents: the editors' last completion of a burst (p50, p95) over T (the
same bursts' on the idle target; beside it, one request repeated on the idle target), the
agents' tokens/s, the preemptions and the prompt tokens their resumes evaluated again;
goals: on two slots or more, with ``classes`` (and ``solo``) the last p50 <= 1.2 x T; on
one, where no slot can be kept for completions, with ``preempt`` (and ``solo``) <= 1.5 x T;
and the agents' tokens/s >= 0.8 x ``fifo``'s. Callers (``--callers``):
each caller's share of the generations; goal: with ``classes`` the caller with the
fewest agents gets >= 0.8 of an equal share (40% of the generations for two callers).
"""

from __future__ import annotations

import math
from typing import Any

from llmproxy.bench.mix.settings import MixSettings

Verdict = tuple[str, str, bool | None]


def _ratio(ms: float, t_ms: float) -> float:
    return ms / t_ms if t_ms and not math.isnan(ms) else math.nan


def _deferred(r: dict[str, Any]) -> str:
    return "-" if r["deferred_at_server"] is None else str(r["deferred_at_server"])


def _count(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f}"


def _server(s: MixSettings) -> str:
    if s.server == "fake":
        return f"the fake llama-server, {s.slots} slots"
    return f"llama-server -np {s.slots} -t {s.threads}"


def format_table(rows: list[dict[str, Any]], s: MixSettings) -> str:
    body = _callers_table(rows, s) if s.callers else _editors_table(rows, s)
    failed = "".join(
        f"\n{r['target']}: agents' failed requests: "
        + ", ".join(f"{why} x{n}" for why, n in r["agent_failures"].items())
        for r in rows
        if r.get("agent_failures")
    )
    tail = (
        failed
        + "\n" * bool(failed)
        + "".join(
            f"\n{goal}: {value} ({'PASS' if ok else 'FAIL' if ok is False else 'n/a'})"
            for goal, value, ok in goals(rows, s)
        )
    )
    return body + tail + "\n"


def _editors_table(rows: list[dict[str, Any]], s: MixSettings) -> str:
    head = (
        f"bench mix: {s.editors} editors ({s.profile}, {s.n_predict} tokens), {s.agents} agents "
        f"({s.agent_tokens}-token chat streams), {_server(s)}, {s.bursts} bursts{_every(s)}\n\n"
        "| target | one request ms | T ms | editor last p50 ms | x T | last p95 ms | x T "
        "| agent tokens/s | preemptions | prompt tokens re-read | errors (editors / agents) "
        "| deferred at the server |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['target']} | {r.get('one_request_ms', math.nan):.0f} | {r['T_ms']:.0f} "
        f"| {r['last_p50_ms']:.0f} "
        f"| {_ratio(r['last_p50_ms'], r['T_ms']):.2f} | {r['last_p95_ms']:.0f} "
        f"| {_ratio(r['last_p95_ms'], r['T_ms']):.2f} | {r['agent_tokens_per_s']:.0f} "
        f"| {_count(r.get('preemptions'))} | {_count(r.get('resume_prompt_tokens'))} "
        f"| {r['editor_errors']} / {r['agent_errors']} | {_deferred(r)} |\n"
        for r in rows
    ]
    return head + "".join(lines)


def _callers_table(rows: list[dict[str, Any]], s: MixSettings) -> str:
    agents = ", ".join(f"{chr(ord('A') + i)} {n}" for i, n in enumerate(s.callers))
    head = (
        f"bench mix: callers' agents ({agents}; {s.agent_tokens}-token chat streams), "
        f"{_server(s)}, {s.duration_s:g} s\n\n"
        "| target | caller | agents | generations | share | tokens/s "
        "| all agents' tokens/s | errors | deferred at the server |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['target']} | {c['caller']} | {c['agents']} | {c['generations']} "
        f"| {c['share']:.0%} | {c['tokens_per_s']:.0f} | {r['agent_tokens_per_s']:.0f} "
        f"| {r['agent_errors']} | {_deferred(r)} |\n"
        for r in rows
        for c in r["callers"]
    ]
    return head + "".join(lines)


def goals(rows: list[dict[str, Any]], s: MixSettings) -> list[Verdict]:
    by = {r["target"]: r for r in rows}
    out: list[Verdict] = []
    if s.callers:
        out += _share_goals(by)
    else:  # the reserve's goal where a slot can be kept, preemption's on one slot
        bound, targets = (1.2, ("classes", "solo")) if s.slots > 1 else (1.5, ("preempt", "solo"))
        for target in targets:
            if target in by:
                c = by[target]
                ratio = _ratio(c["last_p50_ms"], c["T_ms"])
                goal = f"{target}: editor last p50 <= {bound} x T"
                out.append((goal, f"{ratio:.2f} x T", ratio <= bound))
    for target in ("classes", "preempt", "solo"):
        if target in by and "fifo" in by and by["fifo"]["agent_tokens_per_s"] > 0:
            share = by[target]["agent_tokens_per_s"] / by["fifo"]["agent_tokens_per_s"]
            goal = f"{target}: agent tokens/s >= 0.8 x fifo's"
            out.append((goal, f"{share:.2f}", share >= 0.8))
    errors = sum(
        r.get("editor_errors", 0) + r["agent_errors"] for r in rows if r["target"] != "direct"
    )
    out.append(("no errors through the proxy", str(errors), errors == 0))
    return out


def _every(s: MixSettings) -> str:
    if s.burst_every_s:
        return f", one every {s.burst_every_s:g} s"
    return f", each {s.pause_ms:g} ms after the last one's answer"


def _agents(n: int) -> str:
    return f"{n} agent" if n == 1 else f"{n} agents"


def _share_goals(by: dict[str, dict[str, Any]]) -> list[Verdict]:
    out: list[Verdict] = []
    for target in ("classes", "noreserve"):
        if target not in by:
            continue
        callers = by[target]["callers"]
        small = min(callers, key=lambda c: c["agents"])
        floor = 0.8 / len(callers)
        out.append(
            (
                f"{target}: caller {small['caller']} ({_agents(small['agents'])}) gets "
                f">= {floor:.0%} of the generations",
                f"{small['share']:.0%}",
                small["share"] >= floor,
            )
        )
    return out
