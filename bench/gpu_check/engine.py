"""GPU check, in-process part: the torch engine driven as the worker loop drives it.

``measure_engine(opts, model_dir, dtype)`` loads one continuous-batching engine and
returns a dict (every value JSON-serializable) of:

* ``facts``: the engine facts that ``/props`` reports under ``engine`` (the memory
  profile: weights, activation peak, KV budget, bytes per KV token);
* ``tps``: per concurrency, aggregate tok/s, median per-sequence decode tok/s, TTFT;
* ``ttft_idle_ms`` / ``ttft_late_ms``: first token on an idle engine and for a request
  joining ``late_background`` running generations; ``long_prompt``: the longest step
  while a prompt of 4 prefill chunks joins a running batch, over its median decode step;
* ``kv``: the KV store's bytes vs ``kv_bytes_per_token`` x slots x columns, and vs budget;
* ``memory``: peak allocated/reserved (CUDA) vs weights + activation peak + KV store;
* ``sleep``: ``engine.sleep()`` (what ``idle_unload_s`` calls): memory before/after,
  whether the model and the KV store were freed, and the reload's time;
* ``failed``: requests that ended in ``Failed``.

``measure_static(opts, model_dir, dtype)``: idle and late TTFT with static batching.
The worker freezes the loaded engine out of the garbage collector (``gc.freeze``); so
does this, so that a reference cycle that would keep the model alive shows here too.
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmproxy.bench.engine.batching import PROMPTS, Driver, sweep, ttft

if TYPE_CHECKING:
    from llmproxy.backend.settings import BackendSettings
    from llmproxy.bench.gpu_check.cli import CheckSettings

MIB = 1024 * 1024


def engine_settings(
    opts: CheckSettings, model_dir: Path, dtype: str, batching: str
) -> BackendSettings:
    from llmproxy.backend.settings import BackendSettings

    assert opts.work_dir is not None  # set by cli.run
    # keyword values, validated by BackendSettings (its other fields keep their defaults)
    fields: dict[str, Any] = {
        "engine": "torch",
        "model": model_dir,
        "device": opts.device,
        "dtype": dtype,
        "batching": batching,
        "max_batch_size": max(opts.concurrency),
        "n_ctx": opts.n_ctx,
        "prefill_chunk": opts.prefill_chunk,
        "cache_dir": opts.work_dir / "cache",
        "n_threads": opts.n_threads,
        "idle_unload_s": opts.idle_unload_s,
    }
    return BackendSettings(**fields)


class Memory:
    """Memory readings of this process: the CUDA caching allocator's, or RSS on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def now(self) -> dict[str, float]:
        if not self.cuda:
            return {"rss_mib": rss_mib("self")}
        import torch

        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {
            "allocated_mib": torch.cuda.memory_allocated() / MIB,
            "reserved_mib": torch.cuda.memory_reserved() / MIB,
            "device_used_mib": (total - free) / MIB,
        }

    def peak(self) -> dict[str, float]:
        if not self.cuda:
            return {}
        import torch

        torch.cuda.synchronize()
        return {
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
        }


def rss_mib(pid: int | str) -> float:
    """Resident memory of a process (Linux ``/proc``), MiB; NaN where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _load(opts: CheckSettings, model_dir: Path, dtype: str, batching: str) -> tuple[Any, float]:
    from llmproxy.backend.engines.torch.engine import create_engine

    engine = create_engine(engine_settings(opts, model_dir, dtype, batching))
    t0 = time.perf_counter()
    engine.load(lambda _p: None)
    seconds = time.perf_counter() - t0
    gc.freeze()  # as the worker does after loading
    return engine, seconds


def _close(engine: Any, device: str) -> None:
    engine.close()
    gc.unfreeze()
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def warm(d: Driver, opts: CheckSettings) -> None:
    """First calls of the batched path at the smallest and largest batch (not measured)."""
    sweep(d, 1, 4)
    sweep(d, max(opts.concurrency), 4)


def ttfts(d: Driver, opts: CheckSettings) -> dict[str, Any]:
    """Median of 3: first token on an idle engine, and for an 8-token request admitted
    while ``late_background`` generations of ``n_predict`` tokens run (after 3 tokens)."""
    idle = [ttft(d, opts.n_predict, 0) for _ in range(3)]
    late = [ttft(d, opts.n_predict, opts.late_background, opts.n_predict) for _ in range(3)]
    return {"ttft_idle_ms": statistics.median(idle), "ttft_late_ms": statistics.median(late),
            "ttft_idle_samples_ms": idle, "ttft_late_samples_ms": late}  # fmt: skip


def long_prompt(d: Driver, opts: CheckSettings) -> dict[str, float]:
    """Step times while a prompt of 4 prefill chunks (at most half the context) joins
    ``late_background`` running rows."""
    tok = d.e.tokenizer
    n = min(4 * opts.prefill_chunk, opts.n_ctx // 2)
    text = "\n".join(PROMPTS)
    while len(tok(text).input_ids) < n:
        text += "\n" + text
    ids = tok(text).input_ids[:n]
    text = tok.decode(ids)
    bg = [d.submit(max(opts.n_predict, 32)) for _ in range(opts.late_background)]
    d.until(lambda: all(d.tokens.get(i, 0) >= 3 for i in bg))
    steps: list[float] = []
    for _ in range(8):  # the running batch's plain decode steps
        t0 = time.perf_counter()
        d.step()
        steps.append(time.perf_counter() - t0)
    rid = d.submit(8, text)
    t_admit = time.perf_counter()
    during: list[float] = []
    while rid not in d.first:
        t0 = time.perf_counter()
        d.step()
        during.append(time.perf_counter() - t0)
    ttft_ms = (d.first[rid] - t_admit) * 1000.0
    d.drain()
    base = statistics.median(steps)
    return {
        "prompt_tokens": float(len(ids)), "ttft_ms": ttft_ms, "steps": float(len(during)),
        "decode_step_ms": base * 1000.0, "max_step_ms": max(during) * 1000.0,
        "max_step_over_decode": max(during) / base,
    }  # fmt: skip


def _kv(engine: Any, facts: dict[str, str]) -> dict[str, Any]:
    from llmproxy.backend.engines.torch.batch import INITIAL_COLUMNS

    kv = engine.batch.kv
    per_tok = int(facts["kv_bytes_per_token"])
    slots, cap = int(kv.store.shape[2]), int(kv.cap)
    initial = min(INITIAL_COLUMNS, engine.n_ctx + 1)
    store = kv.store.numel() * kv.store.element_size()
    out: dict[str, Any] = {
        "slots": slots,
        "columns": cap,
        "initial_columns": initial,
        "store_mib": store / MIB,
        "initial_store_mib": per_tok * slots * initial / MIB,
        "predicted_mib": per_tok * slots * cap / MIB,
        "store_over_predicted": store / (per_tok * slots * cap),
    }
    budget = facts.get("kv_budget_tokens")
    if budget is not None:
        out["budget_tokens"] = int(budget)
        out["within_budget"] = slots * cap <= int(budget)
    return out


def _sleep(engine: Any, d: Driver, mem: Memory, idle_ms: float) -> dict[str, Any]:
    before = mem.now()
    model, store = weakref.ref(engine.batch.model), weakref.ref(engine.batch.kv.store)
    engine.sleep()
    gc.collect()
    after = mem.now()
    released, kv_released = model() is None, store() is None
    t0 = time.perf_counter()
    rid = d.submit(8)  # admit() reloads the model
    d.until(lambda: rid in d.first)
    first_ms = (d.first[rid] - t0) * 1000.0
    d.drain()
    out: dict[str, Any] = {
        "before": before, "after": after, "reloaded": mem.now(), "model_released": released,
        "kv_store_released": kv_released,
        "reload_first_token_ms": first_ms, "reload_s": max(0.0, first_ms - idle_ms) / 1000.0,
        "reload_load_s": float(engine.last_load.get("seconds", float("nan"))),
    }  # fmt: skip
    key = "reserved_mib" if mem.cuda else "rss_mib"
    if before[key] > 0:
        out["freed_share"] = 1.0 - after[key] / before[key]
    return out


def measure_engine(opts: CheckSettings, model_dir: Path, dtype: str) -> dict[str, Any]:
    import torch

    mem = Memory(opts.device)
    mem.reset_peak()
    engine, load_s = _load(opts, model_dir, dtype, "continuous")
    try:
        facts = dict(engine.info.extra)
        facts.pop("chat_template", None)
        params = list(engine.batch.model.parameters())
        res: dict[str, Any] = {
            "load_s": load_s,
            "facts": facts,
            "after_load": mem.now(),
            "param_mib": sum(p.numel() * p.element_size() for p in params) / MIB,
            "dtype_ok": all(p.dtype == getattr(torch, dtype) for p in params),
            "pinned_host_buffers": bool(engine.batch.buffers.host.is_pinned())
            if opts.device == "cuda"
            else None,
        }
        del params  # no reference to the model may outlive the engine's (see _sleep)
        d = Driver(engine, strict=False)
        warm(d, opts)
        res["tps"] = {str(c): sweep(d, c, opts.n_predict) for c in opts.concurrency}
        res.update(ttfts(d, opts))
        res["long_prompt"] = long_prompt(d, opts)
        res["kv"] = _kv(engine, facts)
        res["memory"] = mem.peak() | mem.now()
        if mem.cuda:
            res["memory"]["predicted_peak_mib"] = _predicted_peak(facts, res["kv"])
        res["sleep"] = _sleep(engine, d, mem, res["ttft_idle_ms"])
        res["requests"] = d.n
        res["failed"] = [str(ev) for ev in d.failed]
        return res
    finally:
        _close(engine, opts.device)


def _predicted_peak(facts: dict[str, str], kv: dict[str, Any]) -> float:
    """What the load-time profile implies for this run: its ``weights_mib`` (measured with
    the initial KV store in place) + its activation peak + the store's growth since (the
    last doubling x1.5: old and new stores coexist while it copies)."""
    grew = kv["columns"] > kv["initial_columns"]
    peak_store = 1.5 * kv["store_mib"] if grew else kv["store_mib"]
    growth = max(0.0, peak_store - kv["initial_store_mib"])
    return float(facts["weights_mib"]) + float(facts["activation_peak_mib"]) + growth


def measure_static(opts: CheckSettings, model_dir: Path, dtype: str) -> dict[str, Any]:
    engine, load_s = _load(opts, model_dir, dtype, "static")
    try:
        d = Driver(engine, strict=False)
        warm(d, opts)
        res: dict[str, Any] = {"load_s": load_s, **ttfts(d, opts)}
        res["requests"] = d.n
        res["failed"] = [str(ev) for ev in d.failed]
        return res
    finally:
        _close(engine, opts.device)
