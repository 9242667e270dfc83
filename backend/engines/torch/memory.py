"""Torch engine: GPU memory profiling at load time -> the KV-cache budget.

On CUDA, after the weights are loaded: run the largest forward passes the scheduler will
ever issue (one prompt chunk of ``prefill_chunk`` tokens, one decode step of
``max_batch_size`` rows over a full-context cache) and record the activation peak; what
is left of the free memory (minus a safety margin) is the KV budget, expressed in
tokens (columns x slots of the store in kv.py). The store grows by doubling, and
while it copies the old and the new store coexist (1.5x the new size); the budget counts
that. On CPU there is no budget (``None``): the batch size alone bounds memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MIB = 1024 * 1024
SAFETY = 0.90  # use at most this share of the free memory
GROWTH_PEAK = 1.5  # KV store doubling: old (n) + new (2n) = 1.5x the new size at once


@dataclass(frozen=True)
class MemoryPlan:
    kv_bytes_per_token: int
    kv_budget_tokens: int | None  # None: unbounded (CPU)
    facts: tuple[tuple[str, str], ...]  # for EngineInfo.extra (/props)


def kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


@torch.inference_mode()
def plan_memory(
    model: Any, device: torch.device, dtype: torch.dtype, max_batch: int, chunk: int, n_ctx: int
) -> MemoryPlan:
    per_tok = kv_bytes_per_token(model, dtype)
    if device.type != "cuda":
        return MemoryPlan(per_tok, None, (("kv_bytes_per_token", str(per_tok)),))
    from transformers import DynamicCache

    from llmproxy.backend.engines.torch.kv import cache_keyword

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    free_before, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (1, chunk), device=device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): DynamicCache()})
    prefill_peak = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.reset_peak_memory_stats(device)
    # decode over a short stand-in cache; the attention part scales with n_ctx, counted below
    ids = torch.randint(0, vocab, (max_batch, 1), device=device)
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    decode_peak = torch.cuda.max_memory_allocated(device) - weights
    cfg = model.config.get_text_config(decoder=True)
    scores = max_batch * cfg.num_attention_heads * (n_ctx + 1) * 4  # one layer's fp32 attention row
    activations = max(prefill_peak, decode_peak + scores)
    torch.cuda.empty_cache()
    budget_bytes = max(0, int(free_before * SAFETY) - activations)
    tokens = int(budget_bytes / (GROWTH_PEAK * per_tok))
    facts = (
        ("gpu_total_mib", f"{total / MIB:.0f}"),
        ("gpu_free_after_weights_mib", f"{free_before / MIB:.0f}"),
        ("weights_mib", f"{weights / MIB:.0f}"),
        ("activation_peak_mib", f"{activations / MIB:.0f}"),
        ("kv_budget_mib", f"{budget_bytes / MIB:.0f}"),
        ("kv_bytes_per_token", str(per_tok)),
        ("kv_budget_tokens", str(tokens)),
    )
    return MemoryPlan(per_tok, int(tokens), facts)
