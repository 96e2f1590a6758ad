"""The kernels' caches of prepared launches (pointer tables by output-tensor identity): LRUs shared
by every per-GPU quantization thread, so each ``get`` (lookup, identity check, move to the end) and
``put`` (insert, evict the oldest) is one step under a lock. Unlocked, a thread's lookup racing
another thread's eviction raised KeyError in ``move_to_end``.

Sized for the largest plans: a daemon touches about 2 generations x 2 slabs per MoE layer x its
publish regions, per GPU; DeepSeek-V3 (58 MoE layers) on 8 lanes is 1,856 entries, and a cache
smaller than the entries in use rebuilds (and host-syncs) a pointer table on every launch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import torch

#: entries kept by each cache: every output set of a DeepSeek-size plan on 8 GPUs, with room;
#: an entry is two int64 tables of 2E pointers (8 KiB for E = 256)
CACHE_ENTRIES = 4096


class _Entry(Protocol):
    def same(self, tensors: Sequence[torch.Tensor]) -> bool: ...


E = TypeVar("E", bound=_Entry)


class IdentityLru(Generic[E]):
    """``key -> entry`` (LRU, ``capacity`` entries); an entry counts as a hit only while it was made
    for these very tensor objects (``entry.same(tensors)``)."""

    def __init__(self, capacity: int = CACHE_ENTRIES):
        self.capacity = capacity
        self._data: OrderedDict[tuple, E] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, tensors: Sequence[torch.Tensor]) -> E | None:
        with self._lock:
            hit = self._data.get(key)
            if hit is None or not hit.same(tensors):
                return None
            self._data.move_to_end(key)
            return hit

    def put(self, key: tuple, entry: E) -> None:
        with self._lock:
            self._data[key] = entry
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
