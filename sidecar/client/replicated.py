"""``push_step(..., replicated=True)``: every rank hands over the same whole tensors and refitd sends
each from exactly one rank.

A gathered export (Megatron-Bridge's ``export_hf_weights`` on every TP/EP/PP rank, verl's
``get_per_tensor_param`` on every FSDP rank) yields every tensor whole on every rank, and its
collectives need every rank to read it in lockstep. So every rank makes the same call with the
same stream; each tensor name gets one owner, and a rank declares (BEGIN) and writes only the
tensors it owns, discarding the others as they come.

The owner is the rank with the fewest bytes so far, over the names in sorted order (ties: the lower
rank): the same on every rank from the same declaration, whatever order each rank lists it in, and
the bytes of every stretch of the model (a layer group) spread across the ranks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sidecar.client.dtensor import is_dtensor
from sidecar.client.pieces import Piece

__all__ = ["owned_items", "owners", "piece_owners"]


def owners(sizes: Iterable[tuple[str, int]], world_size: int) -> dict[str, int]:
    """name -> the rank that sends it, given each name's bytes (a name listed twice counts once per
    listing: the pieces of one tensor go to one rank)."""
    total: dict[str, int] = {}
    for name, size in sizes:
        total[name] = total.get(name, 0) + int(size)
    heap = [(0, rank) for rank in range(world_size)]  # (bytes so far, rank): the lightest pops first
    owner: dict[str, int] = {}
    for name in sorted(total):
        load, rank = heapq.heappop(heap)
        owner[name] = rank
        heapq.heappush(heap, (load + total[name], rank))
    return owner


def piece_owners(declared: list[Piece], world_size: int) -> dict[str, int]:
    """:func:`owners` of a declaration's pieces (meta tensors: their bytes as declared)."""
    return owners(((p.name, p.tensor.numel() * p.tensor.element_size()) for p in declared), world_size)


def owned_items(
    named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], rank: int, world_size: int
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of ``named_tensors`` that ``rank`` sends (whole tensors held alike
    on every rank, not a stream: ``declare=`` streams)."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    for name, value in items:
        if not isinstance(value, torch.Tensor) or is_dtensor(value):
            raise ValueError(
                f"replicated=True takes whole tensors alike on every rank, but {name!r} is a "
                f"{type(value).__name__}; push shards (Shard, DTensor) without replicated=True"
            )
    owner = owners(((n, v.numel() * v.element_size()) for n, v in items), world_size)
    return [(n, v) for n, v in items if owner[n] == rank]
