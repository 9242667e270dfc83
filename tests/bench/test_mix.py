"""``llmproxy bench mix`` end to end on a tiny script: real proxies (``llmproxy serve``
children) in front of a real loopback fake; every target's row, and the agents held off
the reserved slot with classes on; the callers scenario with a client key per caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from llmproxy.bench.mix.report import goals
from llmproxy.bench.mix.settings import MixSettings
from llmproxy.common.children import child_preexec

LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))


def _mix(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "mix.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    argv = [LLMPROXY, "bench", "mix", *args, "--json-out", str(out)]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=90, preexec_fn=child_preexec()
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: a goal failed (timing: not judged here)
    return proc, json.loads(out.read_text())


def test_cli_runs_direct_fifo_and_classes(tmp_path: Path) -> None:
    proc, data = _mix(
        tmp_path,
        *("--editors", "1", "--agents", "2", "--slots", "2"),
        *("--keystrokes", "4", "--bursts", "1", "--agent-tokens", "40"),
        *("--idle-bursts", "2"),
        *("--logs-dir", str(tmp_path / "logs"), "--proxy-log-level", "info"),
    )
    rows = {r["target"]: r for r in data["targets"]}
    assert list(rows) == ["direct", "fifo", "classes", "preempt"], proc.stdout
    for name, row in rows.items():
        assert row["editor_errors"] == row["agent_errors"] == 0, name
        assert row["agent_answers"] >= 1 and row["T_ms"] > 0 and row["one_request_ms"] > 0, name
        assert row["last_p95_ms"] >= row["last_p50_ms"] > 0, name
    # through the proxy nothing waits inside the server; direct, the agents' chats fill it
    assert {rows[t]["deferred_at_server"] for t in ("fifo", "classes", "preempt")} == {0}
    goals = {g["goal"]: g for g in data["goals"]}
    assert goals["no errors through the proxy"]["pass"] is True
    assert "| classes |" in proc.stdout and "last p95 ms" in proc.stdout
    assert "| one request ms | T ms |" in proc.stdout
    for target in ("fifo", "classes"):  # kept, a line per request
        lines = (tmp_path / "logs" / f"proxy-{target}.log").read_text().splitlines()
        logged = [json.loads(line) for line in lines if line.startswith("{")]
        assert {r.get("class") for r in logged} >= {"complete", "chat"}, target


def test_one_slot_preempt_target_counts_its_preemptions(tmp_path: Path) -> None:
    """One slot, one agent: the preempt target stops the chat for keystrokes (counted by
    the proxy's status), and every answer still comes whole; the others never preempt."""
    proc, data = _mix(
        tmp_path,
        *("--editors", "1", "--agents", "1", "--slots", "1", "--targets", "fifo,classes,preempt"),
        *("--keystrokes", "4", "--bursts", "2", "--agent-tokens", "200"),
        *("--idle-bursts", "1"),
    )
    rows = {r["target"]: r for r in data["targets"]}
    assert rows["fifo"]["preemptions"] == rows["classes"]["preemptions"] == 0
    assert rows["preempt"]["preemptions"] >= 1, proc.stdout
    for name, row in rows.items():
        assert row["editor_errors"] == row["agent_errors"] == 0, name
    assert "| preemptions |" in proc.stdout


def test_solo_target_pauses_the_chats_beside_a_free_slot(tmp_path: Path) -> None:
    """Two slots, one agent: the reserve leaves a slot free, so the preempt target never
    stops the chat; solo pauses it while a burst's last completion runs (the count is the
    proxy's status, so a chat still running at the end counts), and every answer still
    comes whole."""
    proc, data = _mix(
        tmp_path,
        *("--editors", "1", "--agents", "1", "--slots", "2", "--targets", "preempt,solo"),
        # 48 tokens (240 ms): a burst's last completion outlives preempt_after_ms (100)
        *("--keystrokes", "4", "--bursts", "2", "--agent-tokens", "400", "--n-predict", "48"),
        *("--idle-bursts", "1"),
    )
    rows = {r["target"]: r for r in data["targets"]}
    assert rows["preempt"]["preemptions"] == 0
    assert rows["solo"]["preemptions"] >= 1, proc.stdout
    for name, row in rows.items():
        assert row["editor_errors"] == row["agent_errors"] == 0, name


def test_bursts_on_a_schedule_measure_the_agents_over_it(tmp_path: Path) -> None:
    """``--burst-every-s``: a burst starts every period whatever the answers, and the agents'
    tokens/s is over the whole schedule (bursts x period), the same on every target."""
    proc, data = _mix(
        tmp_path,
        *("--editors", "1", "--agents", "1", "--slots", "1", "--targets", "fifo,preempt"),
        *("--keystrokes", "3", "--bursts", "2", "--burst-every-s", "1.5"),
        *("--idle-bursts", "1"),
    )
    assert "2 bursts, one every 1.5 s" in proc.stdout
    for row in data["targets"]:
        assert row["editor_errors"] == row["agent_errors"] == 0, row
        assert row["measured_s"] >= 3.0, row  # 2 bursts x 1.5 s
        assert row["agent_tokens_per_s"] > 0, row


def test_callers_share_the_generations_fairly_with_classes(tmp_path: Path) -> None:
    """Caller A's 8 agents and B's 1, each with its key, on 2 slots: in one FIFO queue B
    gets about one generation in nine; with fair shares far more."""
    proc, data = _mix(
        tmp_path,
        *("--callers", "8,1", "--slots", "2", "--agent-tokens", "20"),
        *("--duration-s", "3", "--targets", "fifo,classes"),
    )
    rows = {r["target"]: r for r in data["targets"]}
    assert list(rows) == ["fifo", "classes"], proc.stdout
    share = {}
    for name, row in rows.items():
        assert row["agent_errors"] == 0, name  # every key was accepted
        callers = {c["caller"]: c for c in row["callers"]}
        assert [(c, callers[c]["agents"]) for c in callers] == [("A", 8), ("B", 1)]
        assert sum(c["generations"] for c in callers.values()) == row["agent_answers"] > 0
        share[name] = callers["B"]["share"]
    assert share["fifo"] < 0.25 and share["classes"] >= 0.4, share
    assert "| classes | B | 1 |" in proc.stdout


def test_unknown_target_and_a_lone_caller_are_refused() -> None:
    with pytest.raises(ValidationError, match="unknown targets"):
        MixSettings(targets=["direct", "nope"])
    with pytest.raises(ValidationError, match="two or more callers"):
        MixSettings(callers=[3])


def _row(target: str, last_ms: float, tokens_per_s: float) -> dict[str, Any]:
    return {
        "target": target,
        "T_ms": 100.0,
        "last_p50_ms": last_ms,
        "agent_tokens_per_s": tokens_per_s,
        "agent_errors": 0,
        "editor_errors": 0,
    }


@pytest.mark.parametrize(
    ("slots", "asked"),
    [
        (1, {"preempt: editor last p50 <= 1.5 x T", "solo: editor last p50 <= 1.5 x T"}),
        (4, {"classes: editor last p50 <= 1.2 x T", "solo: editor last p50 <= 1.2 x T"}),
    ],
)
def test_each_latency_goal_is_asked_where_it_applies(slots: int, asked: set[str]) -> None:
    """The reserve's 1.2 x T where a slot can be kept for completions; preemption's
    1.5 x T on one slot; the agents' share of FIFO's tokens/s for every proxied target."""
    rows = [
        _row("fifo", 800.0, 50.0),
        _row("classes", 115.0, 50.0),
        _row("preempt", 140.0, 39.0),
        _row("solo", 110.0, 41.0),
    ]
    verdicts = {g: ok for g, _v, ok in goals(rows, MixSettings(slots=slots))}
    assert {g for g in verdicts if "editor last" in g} == asked
    assert verdicts["preempt: agent tokens/s >= 0.8 x fifo's"] is False  # 0.78
    assert verdicts["solo: agent tokens/s >= 0.8 x fifo's"] is True  # 0.82
    assert all(ok for g, ok in verdicts.items() if "editor last" in g)
