"""DTensors as ``push_step`` takes them: every rank's pieces, against torch's own ``distribute_tensor``.

One process plays each rank of a 2 x 2 (and a 4) mesh in turn over torch's fake process group (no
communication: ``distribute_tensor(..., src_data_rank=None)`` splits locally, as each rank of a real
job holds its shard). Each rank's pieces must hold the global tensor's values at their offsets, and all
ranks' pieces together must cover every element exactly once: Shard on any dim with uneven last
shards, Replicate sent once, FSDP2 + TP's _StridedShard (whose rows need not be one box), and
Partial refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from sidecar.client.pieces import pieces

WORLD = 4
PLACEMENTS = {
    "shard0-shard1": ((2, 2), [Shard(0), Shard(1)]),
    "shard1-shard1": ((2, 2), [Shard(1), Shard(1)]),
    "replicate-shard0": ((2, 2), [Replicate(), Shard(0)]),
    "shard1-replicate": ((2, 2), [Shard(1), Replicate()]),
    "replicate-replicate": ((2, 2), [Replicate(), Replicate()]),
    "fsdp-over-tp": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    "strided-after-shard": ((2, 2), [Shard(0), _StridedShard(0, split_factor=2)]),
    "uneven-1d": ((4,), [Shard(0)]),
}


def as_rank(rank: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_pieces(full: torch.Tensor, mesh_shape, placements, rank: int, extra=None):
    for _ in as_rank(rank):
        mesh = init_device_mesh("cpu", mesh_shape)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
        items = {"w": dt} if extra is None else {"w": dt, **extra}
        return [(p.name, p.tensor.clone(), p.global_shape, p.offsets) for p in pieces(items)]
    raise AssertionError("unreachable")


@pytest.mark.parametrize("shape", [(7, 5), (9, 6)])
@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_every_rank_sends_its_shard_where_it_lies(case, shape):
    mesh_shape, placements = PLACEMENTS[case]
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    covered = torch.zeros(shape, dtype=torch.int32)
    boxes = 0
    for rank in range(WORLD):
        for name, t, g, o in rank_pieces(full, mesh_shape, placements, rank):
            assert name == "w" and tuple(g) == shape
            box = tuple(slice(a, a + n) for a, n in zip(o, t.shape))
            assert torch.equal(t, full[box]), (case, rank, o)
            covered[box] += 1
            boxes += 1
    assert torch.all(covered == 1), (case, covered)
    if "strided-after" in case:  # its rows interleave: more than one box per rank
        assert boxes > WORLD


def test_plain_tensors_beside_dtensors_are_sent_once():
    """FSDP2 leaves buffers unsharded: a plain tensor is sent by mesh coordinate 0 only."""
    full, bias = torch.arange(12.0).reshape(4, 3), torch.ones(3)
    senders = [
        rank
        for rank in range(WORLD)
        if any(n == "b" for n, *_ in rank_pieces(full, (2, 2), [Shard(0), Shard(1)], rank, {"b": bias}))
    ]
    assert senders == [0]


def test_partial_is_refused_naming_the_tensor_and_placement():
    for _ in as_rank(1):
        mesh = init_device_mesh("cpu", (WORLD,))
        from torch.distributed.tensor import DTensor

        dt = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False)
        with pytest.raises(ValueError, match=r"'model.norm.weight'.*Partial") as err:
            pieces({"model.norm.weight": dt})
        assert "redistribute" in str(err.value)
