"""GPU check report: the goals (PASS/FAIL) and the Markdown tables, from the results dict.

``goals(doc)`` returns one row per (shape, dtype, goal): a stable ``id``, the ``goal``
in words, ``value`` (text), ``pass`` (True/False, or None where the goal cannot be
judged: a part missing, or a GPU goal on CPU). ``markdown(doc)`` renders a measurements
table per shape (one column per dtype) and the goals table. Both only read ``doc`` (the
layout cli.py writes) and accept partial results: a missing value shows as ``-``.
"""

from __future__ import annotations

from typing import Any

SPEEDUP_GOAL = {"1.7b": 10.0}  # c16 / c1 aggregate tok/s; other shapes: DEFAULT_SPEEDUP
DEFAULT_SPEEDUP = 8.0
LATE_GOAL = 2.0  # late TTFT (continuous) <= 2x idle
PEAK_SLACK = 1.10  # peak reserved <= 1.1 x what the profile implies
FREED_GOAL = 0.90  # idle unload frees >= 90 % of the model's memory


def _get(node: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _row(
    shape: str, dtype: str, gid: str, goal: str, value: str, ok: bool | None
) -> dict[str, Any]:
    return {"id": gid, "shape": shape, "dtype": dtype, "goal": goal, "value": value, "pass": ok}


def _goals_one(shape: str, dtype: str, r: dict[str, Any], cuda: bool) -> list[dict[str, Any]]:
    e, srv = r.get("engine") or {}, r.get("server") or {}
    out = []
    c1, c16 = _get(e, "tps", "1", "tok_s"), _get(e, "tps", "16", "tok_s")
    want = SPEEDUP_GOAL.get(shape, DEFAULT_SPEEDUP)
    ratio = c16 / c1 if c1 and c16 else None
    out.append(
        _row(
            shape,
            dtype,
            "speedup",
            f"tok/s c16 >= {want:g}x c1",
            f"{ratio:.2f}x" if ratio else "-",
            ratio >= want if ratio else None,
        )
    )
    idle, late = e.get("ttft_idle_ms"), e.get("ttft_late_ms")
    lr = late / idle if idle and late else None
    out.append(_row(shape, dtype, "late_ttft", f"late TTFT <= {LATE_GOAL:g}x idle (continuous)",
                    f"{lr:.2f}x" if lr else "-", lr <= LATE_GOAL if lr else None))  # fmt: skip
    store = _get(e, "kv", "store_over_predicted")
    out.append(
        _row(
            shape,
            dtype,
            "kv_store",
            "KV store = /props bytes/token x slots x columns (1%)",
            f"{store:.3f}" if store else "-",
            abs(store - 1) <= 0.01 if store else None,
        )
    )
    peak, pred = _get(e, "memory", "peak_reserved_mib"), _get(e, "memory", "predicted_peak_mib")
    pr = peak / pred if cuda and peak and pred else None
    out.append(_row(shape, dtype, "peak_memory", f"peak reserved <= {PEAK_SLACK:g}x profiled",
                    f"{pr:.2f}x" if pr else "-", pr <= PEAK_SLACK if pr else None))  # fmt: skip
    share = _get(e, "sleep", "freed_share")
    out.append(_row(shape, dtype, "sleep_freed", f"sleep frees >= {FREED_GOAL:.0%} (in-process)",
                    f"{share:.1%}" if share is not None else "-",
                    share >= FREED_GOAL if cuda and share is not None else None))  # fmt: skip
    freed, weights = _get(srv, "idle_unload", "freed_mib"), _get(srv, "props", "weights_mib")
    fr = freed / float(weights) if cuda and freed is not None and weights else None
    out.append(
        _row(
            shape,
            dtype,
            "idle_unload_freed",
            f"idle_unload_s frees >= {FREED_GOAL:.0%} of weights (server)",
            f"{fr:.1%}" if fr is not None else "-",
            fr >= FREED_GOAL if fr is not None else None,
        )
    )
    parts = [p for p in (e, r.get("static") or {}, srv) if "failed" in p]
    n = sum(len(p["failed"]) for p in parts)
    reqs = sum(int(p.get("requests", 0)) for p in parts)
    out.append(
        _row(
            shape,
            dtype,
            "no_failures",
            "no request fails",
            f"{n} of {reqs} failed" if parts else "-",
            n == 0 if parts else None,
        )
    )
    return out


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    cuda = _get(doc, "meta", "device") == "cuda"
    rows: list[dict[str, Any]] = []
    for shape, by_dtype in (doc.get("runs") or {}).items():
        for dtype, r in by_dtype.items():
            rows += _goals_one(shape, dtype, r, cuda)
    return rows


def _f(v: Any, fmt: str = ".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        try:
            return format(int(v) if fmt == "d" and float(v).is_integer() else v, fmt)
        except ValueError:  # NaN (or a float) under "d"
            return format(float(v), ".1f")
    return str(v)


def _at(part: dict[str, Any], paths: str, fmt: str = ".1f") -> str:
    """``part``'s values at the dotted ``paths`` (space-separated), formatted, joined by `` / ``."""
    return " / ".join(_f(_get(part, *p.split(".")), fmt) for p in paths.split())


def _metrics(r: dict[str, Any], conc: list[int]) -> list[tuple[str, str]]:
    e, st, srv = r.get("engine") or {}, r.get("static") or {}, r.get("server") or {}
    rows = [
        (f"c={c}: tok/s aggregate / per seq", _at(e, f"tps.{c}.tok_s tps.{c}.per_seq_tok_s"))
        for c in conc
    ]
    rows += [
        ("TTFT idle / late ms (continuous)", _at(e, "ttft_idle_ms ttft_late_ms")),
        ("TTFT idle / late ms (static)", _at(st, "ttft_idle_ms ttft_late_ms")),
        ("long prompt joining: TTFT ms", _at(e, "long_prompt.ttft_ms")),
        (
            "long prompt joining: longest step / decode step",
            _at(e, "long_prompt.max_step_over_decode", ".2f") + "x",
        ),
        ("KV store MiB / predicted", _at(e, "kv.store_mib kv.predicted_mib")),
        ("KV columns / budget tokens (/props)", _at(e, "kv.columns kv.budget_tokens", "d")),
        ("KV store within budget", _at(e, "kv.within_budget")),
        ("weights MiB: /props / parameters", _at(e, "facts.weights_mib param_mib")),
        ("activation peak MiB (/props)", _at(e, "facts.activation_peak_mib")),
        (
            "peak allocated / reserved MiB",
            _at(e, "memory.peak_allocated_mib memory.peak_reserved_mib"),
        ),
        ("predicted peak MiB", _at(e, "memory.predicted_peak_mib")),
        ("dtype as asked / pinned host buffers", _at(e, "dtype_ok pinned_host_buffers")),
        ("sleep: model / KV store freed", _at(e, "sleep.model_released sleep.kv_store_released")),
        ("sleep: reload s", _at(e, "sleep.reload_load_s", ".2f")),
        ("sleep: memory before / after (reserved or RSS MiB)", _sleep_mem(e)),
        ("server: ms/token / TTFT ms", _at(srv, "ms_per_token ttft_ms", ".2f")),
        ("server: cancel -> idle ms p50 / max", _at(srv, "cancel.p50_ms cancel.max_ms", ".2f")),
        (
            "server: cancel -> idle tokens p50 / max",
            _at(srv, "cancel.p50_tokens cancel.max_tokens", ".2f"),
        ),
        ("server: burst streams completed / sent", _at(srv, "burst.completed burst.streams", "d")),
        (
            "server idle unload: awake / asleep / reloaded MiB",
            _at(srv, "idle_unload.awake_mib idle_unload.asleep_mib idle_unload.reloaded_mib"),
        ),
        (
            "server idle unload: asleep after s / reload s",
            _at(srv, "idle_unload.sleeping_after_s idle_unload.reload_s", ".2f"),
        ),
    ]
    for name, part in (("engine", e), ("static", st), ("server", srv)):
        for k in ("error", "skipped"):
            if k in part:
                rows.append((f"{name} part {k}", str(part[k])[:120].replace("|", "/")))
    return rows


def _sleep_mem(e: dict[str, Any]) -> str:
    key = "reserved_mib" if _get(e, "sleep", "before", "reserved_mib") is not None else "rss_mib"
    return _at(e, f"sleep.before.{key} sleep.after.{key}")


def markdown(doc: dict[str, Any]) -> str:
    meta = doc.get("meta", {})
    conc = _get(meta, "settings", "concurrency") or []
    st = meta.get("settings", {})
    lines = [
        f"## GPU check: {meta.get('gpu', meta.get('device'))}, torch {meta.get('torch')}, "
        f"transformers {meta.get('transformers')}",
        "",
        f"n_predict {st.get('n_predict')}, n_ctx {st.get('n_ctx')}, "
        f"prefill_chunk {st.get('prefill_chunk')}, "
        f"late request joins {st.get('late_background')} running, "
        f"idle_unload_s {st.get('idle_unload_s')}; "
        f"{doc.get('elapsed_s', 0):.0f} s, complete: {_f(doc.get('complete'))}, "
        f"failed requests: {doc.get('failed_requests', '-')}, errors: {doc.get('errors', '-')}",
    ]
    for shape, by_dtype in (doc.get("runs") or {}).items():
        params = _get(doc, "models", shape, "params")
        dtypes = list(by_dtype)
        lines += [
            "",
            f"### {shape} ({_f(params / 1e6 if params else None, '.0f')}M parameters, "
            "random weights)",
            "",
        ]
        lines += ["| metric | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
        cols = [dict(_metrics(by_dtype[d], conc)) for d in dtypes]
        for name in dict.fromkeys(k for c in cols for k in c):
            lines.append(f"| {name} | " + " | ".join(c.get(name, "-") for c in cols) + " |")
    for shape, err in (
        (s, m["error"]) for s, m in (doc.get("models") or {}).items() if "error" in m
    ):
        lines += ["", f"model {shape}: {err}"]
    lines += ["", "### Goals", ""]
    if meta.get("device") != "cuda":
        lines += [
            "Set for a GPU: on a CPU the memory goals are n/a "
            "and the speed verdicts are not the judged ones.",
            "",
        ]
    lines += ["| shape | dtype | goal | value | verdict |", "|---|---|---|---|---|"]
    for g in doc.get("goals", []):
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        lines.append(f"| {g['shape']} | {g['dtype']} | {g['goal']} | {g['value']} | {verdict} |")
    return "\n".join(lines) + "\n"
