"""A ``torch.distributed.tensor.DTensor`` as the ``Shard`` pieces this rank sends, without any collective.

FSDP2, torchtitan, verl and NeMo-RL's DTensor policy hold ``model.state_dict()`` as DTensors. Each
rank holds ``dt.to_local()``; where those values lie in the global tensor follows from the global
shape, the device mesh and the placements alone, exactly as torch computes it
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``). So a rank sends what it
holds with its offsets and the daemon assembles the tensor: nothing is gathered (``full_tensor()``
would be one all-gather per tensor).

The placements, per mesh dim:

* ``Shard(d)``, uneven last shards included (FSDP2 splits dim 0 in ``ceil`` chunks; a rank past the
  end holds nothing and sends nothing);
* ``_StridedShard(d, split_factor)`` (FSDP2 over tensor parallelism: the TP mesh dim shards first).
  Its local rows are not one box of the global tensor: torch's own index arithmetic
  (``_get_shard_size_and_offsets``, the loop ``compute_local_shape_and_global_offset`` runs) gives the
  global index of every local row, and each run of consecutive indices is sent as one ``Shard``
  (a list of Shards under one name: the daemon takes several pieces of a tensor from one rank);
* ``Replicate()``: the ranks of a replica group hold the same values; only the one at coordinate 0 of
  every replicated mesh dim sends them (deterministic, no communication), the others send nothing;
* ``Partial`` (pending sums: each rank holds an addend, not the values) cannot be sent without a
  reduction: refused with an error naming the tensor and the placement.

A plain tensor in a state dict that holds DTensors is a replica too (FSDP2 leaves buffers unsharded):
sent by the rank at coordinate 0 of the first DTensor's mesh only (:func:`replica_sender`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: distinct (shape, mesh, coordinate, placements) layouts remembered; a model has a few hundred at most
LAYOUT_CACHE = 4096

__all__ = ["dtensor_boxes", "is_dtensor", "replica_sender"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed when it never was)."""
    cls = type(value)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def replica_sender(first: Any) -> bool:
    """Whether this rank sends the plain tensors of a state dict whose first DTensor is ``first``.

    Beside DTensors, a plain tensor is what every rank holds alike (FSDP2 shards parameters, not
    buffers: DeepSeek-V3's ``e_score_correction_bias`` is a plain tensor on every rank). Like a
    ``Replicate`` placement it is sent once: by the rank at coordinate 0 of ``first``'s mesh, on
    every mesh dim. True when there is no DTensor (a plain tensor is then this rank's to send)."""
    if first is None:
        return True
    coordinate = first.device_mesh.get_coordinate()
    return coordinate is not None and not any(coordinate)


def dtensor_boxes(name: str, value: Any) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """This rank's part of DTensor ``value`` as ``(local view, global shape, global offsets)`` boxes:
    empty when the rank sends nothing for it (a replica other than the first, an empty shard).

    Raises ValueError naming ``name`` for a placement refitd cannot express (``Partial``) and for a
    local tensor whose shape is not the one the placements give (a hand-made DTensor)."""
    from torch.distributed.tensor import Replicate

    mesh, placements = value.device_mesh, tuple(value.placements)
    global_shape = tuple(int(d) for d in value.shape)
    for mesh_dim, p in enumerate(placements):
        if not (_is_shard(p) or isinstance(p, Replicate)):
            raise ValueError(
                f"{name!r}: DTensor placement {p!r} on mesh dim {mesh_dim} cannot be sent as it lies (each "
                "rank holds an addend, not the values); reduce it first (dt.redistribute(mesh, "
                "[Replicate() or Shard(d) per mesh dim])) or push dt.full_tensor() from one rank"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh: it holds nothing of it
        return []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate) and coordinate[mesh_dim] != 0:
            return []  # another rank of this replica group sends it
    # the local shard itself: to_local() is an autograd Function (tens of microseconds per tensor)
    local = getattr(value, "_local_tensor", None)
    local = (value.to_local() if local is None else local).detach()
    shape, combos = _layout(global_shape, tuple(mesh.shape), tuple(coordinate), placements)
    if shape != tuple(local.shape):
        raise ValueError(
            f"{name!r}: the DTensor's local tensor is {list(local.shape)} but its placements {list(placements)} "
            f"on a mesh of {list(mesh.shape)} give this rank {list(shape)} of {list(global_shape)}; "
            "push a DTensor made by torch (distribute_tensor, fully_shard, parallelize_module)"
        )
    if local.numel() == 0:
        return []
    boxes = []
    for combo in combos:
        view = local
        for d, (local_start, _, length) in enumerate(combo):
            if length != local.shape[d]:
                view = view.narrow(d, local_start, length)
        boxes.append((view, global_shape, tuple(g for _, g, _ in combo)))
    return boxes


@functools.lru_cache(maxsize=LAYOUT_CACHE)
def _layout(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple
) -> tuple[tuple[int, ...], tuple[tuple[tuple[int, int, int], ...], ...]]:
    """(this rank's local shape, its boxes as per-dim ``(local start, global start, length)`` runs),
    made once per shape, mesh shape, coordinate and placements: a model's tensors share a few."""
    index = _global_indices(global_shape, mesh_shape, list(coordinate), placements)
    return tuple(len(ix) for ix in index), tuple(_product([_runs(ix) for ix in index]))


def _is_shard(placement: Any) -> bool:
    """``Shard(d)`` or ``_StridedShard(d, split_factor)`` (not a Shard subclass in every torch)."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def _global_indices(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: tuple
) -> list[list[int]]:
    """For every tensor dim, the global index of each of this rank's local positions: torch's own
    per-mesh-dim arithmetic (the loop of ``_compute_local_shape_and_global_offset``), keeping every
    index instead of the first."""
    from torch.distributed.tensor import Replicate

    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError:  # an older torch: one box per rank, as the public helper gives it
        return _boxed_indices(global_shape, mesh_shape, coordinate, placements)
    local = list(global_shape)
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        dim = p.dim
        size, offsets = _get_shard_size_and_offsets(
            local[dim],
            mesh_shape[mesh_dim],
            coordinate[mesh_dim],
            p,
            index.get(dim),
            global_shape[dim],
            False,
        )
        local[dim] = int(size)
        index[dim] = offsets if size else torch.empty(0, dtype=torch.long)
    return [
        index[d].tolist() if d in index else list(range(global_shape[d])) for d in range(len(global_shape))
    ]


def _boxed_indices(global_shape, mesh_shape, coordinate, placements) -> list[list[int]]:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    if any(type(p).__name__ == "_StridedShard" for p in placements):
        raise ValueError(
            "this torch has no _get_shard_size_and_offsets, which a _StridedShard placement needs to "
            "locate its rows; use torch >= 2.8, or push dt.full_tensor() from one rank"
        )
    shape, offset = _compute_local_shape_and_global_offset(
        global_shape, mesh_shape, list(coordinate), placements
    )
    return [list(range(o, o + s)) for s, o in zip(shape, offset)]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive runs of ``indices`` as ``(local start, global start, length)``."""
    runs: list[tuple[int, int, int]] = []
    for i, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            start, gstart, length = runs[-1]
            runs[-1] = (start, gstart, length + 1)
        else:
            runs.append((i, g, 1))
    return runs


def _product(runs: list[list[tuple[int, int, int]]]) -> list[tuple[tuple[int, int, int], ...]]:
    out: list[tuple[tuple[int, int, int], ...]] = [()]
    for dim_runs in runs:
        out = [(*combo, r) for combo in out for r in dim_runs]
    return out
