"""The torch engine's prompt rules over its tokenizer alone, for tokenizer threads.

``load_prompts`` loads the Hugging Face tokenizer of the directory the worker loaded its
weights from (``weights_dir`` of its ``EngineInfo``: a GGUF is converted by the worker
first, so the tokenizer is read only once the worker is ready) into the engine's own
``PromptBuilder``: the token ids are the ones the worker would have made. Built once per
server on a thread of the runtime's tokenizer pool; ``PromptBuilder.tokens`` is then
called from several of those threads (a fast tokenizer is safe to share for encoding).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmproxy.backend.engines.torch.loader import load_tokenizer, require_torch
from llmproxy.backend.engines.torch.text import PromptBuilder

if TYPE_CHECKING:
    from llmproxy.backend.settings import BackendSettings


def load_prompts(settings: BackendSettings, weights_dir: str) -> PromptBuilder:
    require_torch()
    tok, add_bos = load_tokenizer(Path(weights_dir))
    return PromptBuilder(tok, add_bos, int(settings.n_ctx), int(settings.n_predict_max))
