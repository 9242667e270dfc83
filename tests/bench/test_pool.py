"""``llmproxy bench pool`` end to end on a tiny script, and its editors against the fake.

The end-to-end run starts real proxies (``llmproxy serve`` children) in front of real
loopback fakes with the prompt-cache model; its counters must add up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llmproxy.bench.burst.report import Req
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.fake.prompts import prompt_text
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.pool.editors import PoolClient, editor_profile, file_text, prompt_counts
from llmproxy.common.children import child_preexec

LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))
TARGETS = ["cache", "session", "least-busy", "round-robin", "single"]


def test_cli_runs_every_policy_and_single(tmp_path: Path) -> None:
    out = tmp_path / "pool.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    # 2 editors, 4 keystrokes, 1 burst, 2 fakes: every row, each counter checkable
    argv = [LLMPROXY, "bench", "pool", "--editors", "2", "--keystrokes", "4", "--bursts", "1"]
    argv += ["--prefix-chars", "400", "--fakes", "2", "--fake-slots", "1", "--json-out", str(out)]
    argv += ["--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=60, preexec_fn=child_preexec()
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: a goal failed, judged below
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert [r.split("|")[1].strip() for r in rows[1:]] == TARGETS, proc.stdout
    data = json.loads(out.read_text())
    sums = {t["target"]: t for t in data["targets"]}
    assert list(sums) == TARGETS
    for name, s in sums.items():
        assert s["errors"] == 0, name
        assert s["completed"] == 2, name  # each editor's final completion
        assert s["requests"] == s["completed"] + s["aborted"] == 2 * 4, name
        assert s["prompt_unit"] == "chars"
        # every generation that reached a fake evaluated or found cached all of its prompt
        assert s["prompt_evaluated"] + s["prompt_cached"] == s["prompt_sent"] > 0, name
        assert s["generations"] >= 2, name
        # one slot each, never more; session may hash both editors to one upstream
        assert len(s["max_concurrent"]) == (1 if name == "single" else 2), name
        assert max(s["max_concurrent"]) == 1, name
        assert s["oversubscribed"] == 0
        assert s["routed"] is not None, name  # one upstream is a pool of one: routed too
        assert len(s["routed"]) == (1 if name == "single" else 2), name
        assert sum(s["routed"]) == s["generations"], name
        assert sum(s["decisions"].values()) == s["generations"], name
    assert sums["round-robin"]["decisions"] == {"round_robin": sums["round-robin"]["generations"]}
    goals = {g["goal"]: g for g in data["goals"]}
    assert goals["no errors"]["pass"] is True
    assert goals["no upstream above its slots"]["pass"] is True
    assert proc.returncode == (0 if all(g["pass"] for g in data["goals"]) else 1)


async def test_editor_prompts_carry_the_file_and_answers_are_counted() -> None:
    head = file_text(3, 700)
    settings = BurstSettings(profile="continue", editors=2, n_predict=4)
    script = lambda _p, _b: Script(tokens=4, token_delay_s=0.001)  # noqa: E731
    async with FakeUpstream(slots=1, prefill_s_per_char=1e-5, script=script) as fake:
        client = PoolClient(fake.url, editor_profile("continue", head), settings, 3)
        try:
            for k in range(3):
                req = Req(3, 0, k, 0.0)
                await client.send(req, k)
                assert req.outcome == "ok"
        finally:
            await client.http.close()
        gens = fake.generations
        assert len(gens) == 3
        assert all((prompt_text(g.path, g.body or {}) or "").find(head) == 12 for g in gens)
        assert client.answers == 3
        assert client.evaluated == fake.prompt_chars_evaluated
        assert client.cached == fake.prompt_chars_cached
        assert gens[1].prompt_chars_cached > len(head)  # the next keystroke: the file is cached


def test_files_differ_from_their_first_line() -> None:
    texts = [file_text(e, 3000) for e in range(8)]
    assert all(len(t) == 3000 for t in texts)
    assert texts[0] == file_text(0, 3000)
    assert len({t[:20] for t in texts}) == 8


def test_prompt_counts_read_each_backend_shape() -> None:
    llama = b'data: {"content":"a"}\n\ndata: {"timings":{"prompt_n":5,"cache_n":7}}\n\n'
    assert prompt_counts(llama) == (5, 7)
    backend = json.dumps({"timings": {"prompt_n": 5}, "tokens_evaluated": 12}).encode()
    assert prompt_counts(backend) == (5, 7)
    fields = json.dumps({"timings": {"prompt_n": 5, "predicted_n": 4}, "tokens_cached": 16})
    assert prompt_counts(fields.encode()) == (5, 7)
    assert prompt_counts(b'{"content":"a"}') is None
