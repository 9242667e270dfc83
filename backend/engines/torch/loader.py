"""Torch engine: import check, device/dtype choice, model loading and the converted-weights cache.

Runs only inside the torch worker process. A GGUF file is de-quantized once with
transformers' GGUF reader and saved with ``save_pretrained`` under
``cache_dir/torch/<stem>-<key>`` where the key hashes the GGUF's resolved path, size,
mtime and the target dtype, so a restart loads the cached safetensors directly (seconds)
instead of de-quantizing again. A local Hugging Face model directory (with
``config.json``) is loaded as it is. The cache entry is written to a temporary directory
and renamed into place, so a crash mid-conversion never leaves a half-written entry.
No network: ``HF_HUB_OFFLINE=1`` is set before transformers is imported.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'llmproxy[torch]'"
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class TorchUnavailable(RuntimeError):
    """torch or transformers is missing (message names the install command)."""


def require_torch() -> None:
    """Fail with a clear message when the torch extra is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    missing = []
    for name in ("torch", "transformers", "gguf", "numpy"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise TorchUnavailable(
            f"the torch engine needs {', '.join(missing)}, which is not installed: {INSTALL_HINT}"
        )


@dataclass(frozen=True)
class Placement:
    device: Any  # torch.device
    dtype: Any  # torch.dtype


def choose_placement(device: str, dtype: str) -> Placement:
    """cuda when available (bf16 if supported else fp16), else CPU fp32; explicit settings win."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but torch.cuda.is_available() is False")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if dtype != "auto":
        dt = getattr(torch, _DTYPES[dtype])
    elif use_cuda:
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dt = torch.float32
    return Placement(dev, dt)


def cache_key(gguf: Path, dtype_name: str) -> str:
    st = gguf.stat()
    raw = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype_name}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def converted_dir(gguf: Path, cache_dir: Path, dtype_name: str) -> Path:
    return Path(cache_dir).expanduser() / "torch" / f"{gguf.stem}-{cache_key(gguf, dtype_name)}"


def _gguf_add_bos(gguf: Path) -> bool:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.parts[field.data[0]][0]) if field is not None and field.data else False


def convert_gguf(gguf: Path, target: Path, dtype: Any) -> None:
    """De-quantize ``gguf`` into a Hugging Face directory at ``target`` (atomic rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) would need `accelerate`; load the tensors ourselves.
    folder, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    missing = [
        k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if missing:
        raise RuntimeError(f"GGUF conversion left weights unset: {missing[:5]}")
    model.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {"source": str(gguf.resolve()), "add_bos": _gguf_add_bos(gguf)}
        (tmp / "llmproxy.json").write_text(json.dumps(meta, separators=(",", ":")))
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "llmproxy.json").exists():  # lost a race with another converter: fine
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    source_dir: Path
    converted: bool  # True: converted now; False: loaded from the cache or an HF dir
    add_bos: bool


def load_model(
    model_path: Path, cache_dir: Path, placement: Placement, progress: Callable[[float], None]
) -> Loaded:
    """Load (converting and caching a GGUF first if needed) the model onto the placement."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # tqdm bars on a worker's stderr are noise in the logs
    dtype_name = str(placement.dtype).removeprefix("torch.")
    converted = False
    if model_path.is_dir():
        src = model_path
    else:
        src = converted_dir(model_path, cache_dir, dtype_name)
        if not (src / "llmproxy.json").exists():
            progress(0.15)
            convert_gguf(model_path, src, placement.dtype)
            converted = True
    progress(0.5)
    tok, add_bos = load_tokenizer(src)
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=placement.dtype, attn_implementation="sdpa"
    )
    model.to(placement.device)
    model.eval()
    progress(0.8)
    return Loaded(model, tok, src, converted, add_bos)


def load_tokenizer(src: Path) -> tuple[Any, bool]:
    """The tokenizer of a loaded (or converted) model directory, and whether it adds BOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    meta_file = src / "llmproxy.json"
    if meta_file.exists():
        add_bos = bool(json.loads(meta_file.read_text()).get("add_bos"))
    else:
        add_bos = tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id]
    return tok, add_bos
