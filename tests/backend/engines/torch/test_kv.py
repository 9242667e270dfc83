"""KV store sizing for the torch engine: growth stops at the context, admission fits the budget.

Pure logic over small stand-in objects (no model load): the store's shape comes from the
model config only, and the scheduler's budget check reads the store and the sequences.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]


def _model(layers: int = 2, heads: int = 2, head_dim: int = 4) -> SimpleNamespace:
    cfg = SimpleNamespace(
        num_hidden_layers=layers,
        num_key_value_heads=heads,
        num_attention_heads=heads,
        head_dim=head_dim,
        hidden_size=heads * head_dim,
    )
    return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder=True: cfg))


def test_store_grows_by_doubling_and_stops_at_the_context() -> None:
    import torch

    from llmproxy.backend.engines.torch.kv import SlotCache

    kv = SlotCache(_model(), 4, torch.device("cpu"), torch.float32, cap=8, max_cap=20)
    assert tuple(kv.store.shape) == (2, 2, 4, 2, 8, 4)
    with torch.inference_mode():  # the store is an inference tensor (as in the engine)
        kv.store[0, 0, 1, 0, 3, 0] = 7.0
    kv.reserve(9)
    assert kv.cap == 16 and kv.store[0, 0, 1, 0, 3, 0] == 7.0  # doubled, contents kept
    kv.reserve(17)
    assert kv.cap == 20  # not 32: the context (n_ctx + 1) is the most a slot can need
    kv.reserve(25)
    assert kv.cap == 25  # a forward that needs more still gets it


def _seq(prompt: int, n_predict: int) -> SimpleNamespace:
    return SimpleNamespace(tokens=[0] * prompt, n_predict=n_predict)


def test_admission_counts_every_slot_at_the_width_it_will_have() -> None:
    import torch

    from llmproxy.backend.engines.torch.kv import SlotCache
    from llmproxy.backend.engines.torch.steps import _kv_fits

    kv = SlotCache(_model(), 4, torch.device("cpu"), torch.float32, cap=16, max_cap=1000)
    running = _seq(10, 5)  # needs 16 columns: fits the current store
    engine = SimpleNamespace(kv_budget=4 * 32, max_batch=4, prefilling=[],
                             batch=SimpleNamespace(rows=[running], kv=kv))  # fmt: skip
    assert _kv_fits(engine, _seq(10, 5))  # 4 slots x 16 columns = 64 <= 128
    assert _kv_fits(engine, _seq(20, 10))  # widens to 32 (doubling): 4 x 32 = 128 <= 128
    assert not _kv_fits(engine, _seq(20, 20))  # needs 41 -> 41 columns: 4 x 41 > 128
    engine.kv_budget = None
    assert _kv_fits(engine, _seq(500, 500))  # CPU: no budget
    engine.kv_budget, engine.batch.rows = 1, []
    assert _kv_fits(engine, _seq(500, 500))  # an idle engine always runs one sequence


def test_cache_keyword_follows_the_model_signature() -> None:
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (the old name
    warns, and the suite turns warnings into errors); older releases only know the old one.
    The engine tests run the installed release; this covers the other branch."""
    from transformers.utils.deprecation import deprecate_kwarg

    from llmproxy.backend.engines.torch.kv import cache_keyword

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):  # type: ignore[no-untyped-def]
            return None

    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None):  # type: ignore[no-untyped-def]
            return None

    class Renamed:  # as transformers 5.24 declares it: the new name, the old one deprecated
        @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
        def forward(self, input_ids=None, cache=None, use_cache=None):  # type: ignore[no-untyped-def]
            return None

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Renamed()) == "cache"
