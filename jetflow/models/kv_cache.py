"""A KV cache that appends in place instead of re-concatenating every step.

transformers' ``DynamicCache`` grows each layer with ``torch.cat``, which copies the whole cache on
every forward: at a batch of 48 and 500 cached tokens that is ~1 GB of copying per decode step for
SmolLM2, as much time as the matmuls. Here each layer owns a buffer with spare room; ``keys`` and
``values`` are views of its prefix, so the rest of the code (masks, in-place commit, truncation by
slicing, row selection) treats them exactly like a ``DynamicCache``'s tensors.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _is_buffer_view(self) -> bool:
        # Truncation by slicing keeps the view; row selection or a reset replaces ``keys``.
        buf = self._key_buffer
        return (buf is not None and self.keys.dim() == 4 and self.keys.data_ptr() == buf.data_ptr()
                and self.keys.shape[:2] == buf.shape[:2] and self.keys.stride() == buf.stride())

    def _reallocate(self, needed: int, like: torch.Tensor, like_values: torch.Tensor) -> None:
        size = max(needed, self.capacity)
        if self._key_buffer is not None:  # keep the room already paid for; double when it ran out
            old = self._key_buffer.shape[2]
            size = max(size, old if needed <= old else 2 * old)
        batch, heads = like.shape[:2]
        old_k = self.keys if self.keys.dim() == 4 else None
        old_v = self.values if self.values.dim() == 4 else None
        self._key_buffer = like.new_empty(batch, heads, size, like.shape[-1])
        self._value_buffer = like_values.new_empty(batch, heads, size, like_values.shape[-1])
        length = 0
        if old_k is not None:
            length = old_k.shape[2]
            self._key_buffer[:, :, :length] = old_k
            self._value_buffer[:, :, :length] = old_v
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[2] if self.keys.dim() == 4 else 0
        end = start + key_states.shape[2]
        if not self._is_buffer_view() or end > self._key_buffer.shape[2]:
            self._reallocate(end, key_states, value_states)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


class PreallocatedCache(Cache):
    """Drop-in for ``DynamicCache()``; ``capacity`` pre-sizes every layer (tokens), it grows by
    doubling when exceeded."""

    def __init__(self, capacity: int = 0):
        super().__init__(layer_class_to_replicate=lambda: PreallocatedLayer(capacity))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished sequences leave a batch)."""
        for layer in self.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
