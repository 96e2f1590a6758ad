"""Layouts: an arena's memory carved into named, aligned tensors, in a fixed order.

A :class:`Layout` maps tensor names to byte ranges (:class:`Slot`) of one arena; it travels as plain
lists inside every arena handle (``to_wire`` / ``from_wire``). Every kind of arena
(``transport.shm``, ``transport.cuda_ipc``) is carved by one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from transport.wire import dtype_from_name, dtype_name

ALIGN = 256  # every tensor starts on a 256-byte boundary (vector loads, fp32 scales)


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a ``dtype`` tensor of ``shape``: ``dtype.itemsize`` and a Python product (a plan of
    DeepSeek-V3's size lays out ~100k tensors; a torch allocation and a NumPy reduction for each
    took seconds)."""
    return dtype.itemsize * math.prod(int(d) for d in shape)


def _checked_shape(name: str, shape: Iterable[Any]) -> tuple[int, ...]:
    """``shape`` as ints; ValueError naming ``name`` for a dim that is not a whole number >= 0. A
    layout made from a peer's rows (a forwarded step) would otherwise carve negative or
    wrapped-round sizes that every reader's views then overrun."""
    dims = tuple(shape)
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0]
    if bad:
        raise ValueError(f"tensor {name!r} has shape {list(dims)}: every dim must be an integer >= 0")
    return tuple(int(d) for d in dims)


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Layout:
    """Names to aligned byte ranges of one arena, in a fixed order; travels as plain lists."""

    def __init__(self, slots: Iterable[Slot]):
        self.slots: dict[str, Slot] = {s.name: s for s in slots}
        self.size = max((s.offset + s.nbytes for s in self.slots.values()), default=0)
        self._wire: list[list[Any]] | None = None

    @classmethod
    def build(cls, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], align: int = ALIGN) -> Layout:
        slots, offset, names = [], 0, set()
        for name, dtype, shape in specs:
            if name in names:
                raise ValueError(f"tensor {name!r} is listed twice: a layout names each tensor once")
            names.add(name)
            shape = _checked_shape(name, shape)
            nbytes = nbytes_of(dtype, shape)
            slots.append(Slot(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // align) * align
        return cls(slots)

    def to_wire(self) -> list[list[Any]]:
        """The rows of every arena handle: made once (a layout never changes; a plan's lists every
        tensor, and each READY and GENERATION carries it). Treat the result as read-only."""
        if self._wire is None:
            self._wire = [
                [s.name, dtype_name(s.dtype), list(s.shape), s.offset, s.nbytes] for s in self.slots.values()
            ]
        return self._wire

    @classmethod
    def from_wire(cls, rows: list[list[Any]]) -> Layout:
        return cls(Slot(n, dtype_from_name(d), tuple(shape), int(o), int(b)) for n, d, shape, o, b in rows)

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots.values())
