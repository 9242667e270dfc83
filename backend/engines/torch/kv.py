"""Torch engine: the pre-allocated KV store every sequence's cache lives in ("slots").

One tensor ``(layers, 2, max_batch, kv_heads, cap, head_dim)`` holds the keys and values
of every slot; slot ``s`` keeps its tokens *left-aligned* in columns ``0 .. len-1``. A
forward pass writes its new keys/values in place (one ``index_put_`` per layer, at
per-row columns) instead of concatenating the whole cache every step the way
``DynamicCache`` does; the columns grow by doubling (one copy per doubling), so a decode
step's cost does not scale with the batch's KV size. Columns that no row owns hold
zeros or keys/values that the attention mask hides (never NaN: the store starts zeroed).

``SlotCache`` is the ``transformers`` ``Cache`` the model sees for one forward: ``plan``
says which slots the input rows are, which column each input token is written to and
how many columns attention reads. Decode rows are slots ``0 .. B-1`` (attention reads a
view, no copy); a prefill may name any slots (attention reads a gathered copy).

Single-threaded: owned by ``batch.Batch``, used from the worker loop's thread.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def cache_keyword(model: Any) -> str:
    """The forward keyword by which ``model`` takes its KV cache: ``cache`` from
    transformers 5.24 on, ``past_key_values`` before (5.24 still accepts it, with a
    FutureWarning, until 5.40). Read once per model, not per forward."""
    params = inspect.signature(type(model).forward).parameters  # follows functools.wraps
    if "cache" in params or "past_key_values" in params:
        return "cache" if "cache" in params else "past_key_values"
    import transformers  # a forward that names neither (a wrapper): go by the release
    from packaging.version import Version  # a dependency of transformers

    return (
        "cache" if Version(transformers.__version__).release[:2] >= (5, 24) else "past_key_values"
    )


class SlotLayer(CacheLayerMixin):
    """One layer's view of the store; ``update`` writes at the planned columns."""

    is_sliding = False

    def __init__(self, owner: SlotCache, index: int) -> None:
        super().__init__()
        # A weak proxy: the cache holds its layers, and a strong reference back would make a
        # cycle that only the garbage collector frees; the worker freezes the loaded engine
        # out of it (gc.freeze), so sleep() would never give the store back.
        self.owner, self.index = weakref.proxy(owner), index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """KV store of ``slots`` sequences; see the module docstring for the layout."""

    def __init__(
        self,
        model: Any,
        slots: int,
        device: torch.device,
        dtype: torch.dtype,
        cap: int = 256,
        max_cap: int | None = None,
    ) -> None:
        cfg = model.config.get_text_config(decoder=True)
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_layers = cfg.num_hidden_layers
        super().__init__(layers=[SlotLayer(self, i) for i in range(n_layers)])
        # an inference tensor: every in-place write runs in inference mode
        with torch.inference_mode():
            self.store = torch.zeros(
                (n_layers, 2, slots, heads, cap, head_dim), dtype=dtype, device=device
            )
        self.width = 0  # columns attention reads in the planned forward
        self.max_cap = max_cap  # growth stops here (the context size) unless a forward needs more
        self._rows: slice | torch.Tensor = slice(0, 0)
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cap(self) -> int:
        return self.store.shape[4]

    @torch.inference_mode()
    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns per slot (grows by doubling up to ``max_cap``,
        copying once; while it copies, old and new stores coexist: at most 1.5x the new size)."""
        if columns <= self.cap:
            return
        cap = max(columns, 2 * self.cap)
        if self.max_cap is not None:
            cap = max(columns, min(cap, self.max_cap))
        grown = torch.zeros(
            (*self.store.shape[:4], cap, self.store.shape[5]),
            dtype=self.store.dtype,
            device=self.store.device,
        )
        grown[:, :, :, :, : self.cap].copy_(self.store)
        self.store = grown

    def plan(self, slots: torch.Tensor, cols: torch.Tensor, width: int, contiguous: bool) -> None:
        """Next forward: input row r is slot ``slots[r]``; its token t goes to column ``cols[r, t]``
        (every column < ``width``); attention reads columns ``0 .. width-1``.

        ``contiguous``: ``slots`` is ``0 .. n-1`` (attention reads a view of the store).
        """
        self.reserve(width)
        self.width = width
        n = slots.shape[0]
        self._rows = slice(0, n) if contiguous else slots
        self._index = (slots.view(n, 1), cols)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._index is not None, "SlotCache.plan() must precede a forward"
        kv = self.store[layer]
        # (n, heads, T, dim) -> rows of (T, heads, dim) at (slot, column) pairs
        rows, cols = self._index
        kv[0][rows, :, cols] = k.transpose(1, 2)
        kv[1][rows, :, cols] = v.transpose(1, 2)
        w = self.width
        if isinstance(self._rows, slice):
            return kv[0, self._rows, :, :w], kv[1, self._rows, :, :w]
        return kv[0].index_select(0, self._rows)[:, :, :w], kv[1].index_select(0, self._rows)[
            :, :, :w
        ]

    @torch.inference_mode()
    def move(self, dst: int, src: int, columns: int) -> None:
        """Copy slot ``src``'s first ``columns`` columns into slot ``dst`` (all layers, K and V)."""
        if columns > 0 and dst != src:
            self.store[:, :, dst, :, :columns] = self.store[:, :, src, :, :columns]

    @torch.inference_mode()
    def swap(self, a: int, b: int, columns: int) -> None:
        """Exchange the first ``columns`` columns of slots ``a`` and ``b``."""
        if columns > 0 and a != b:
            both = torch.tensor([a, b], device=self.store.device)
            self.store[:, :, both, :, :columns] = self.store[:, :, both.flip(0), :, :columns]
