"""Pure pieces of the trainer client: splitting shards into frames, normalizing what users pass."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.client.pieces import Shard, blocks
from sidecar.client.pieces import pieces as pieces_of


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=4).map(tuple),
    itemsize=st.sampled_from([1, 2, 4]),
    limit=st.integers(4, 400),
)
def test_blocks_tile_the_piece_contiguously_within_the_limit(shape, itemsize, limit):
    """Every element lands in exactly one block; each block is contiguous and fits the frame limit."""
    t = torch.arange(max(1, int(torch.tensor(shape).prod().item()) if shape else 1)).reshape(shape)
    seen = torch.zeros(shape, dtype=torch.int32)
    for offsets, sub in blocks(shape, itemsize, limit):
        block = t[tuple(slice(o, o + s) for o, s in zip(offsets, sub))] if shape else t
        assert block.is_contiguous()
        assert block.numel() * itemsize <= max(limit, itemsize)
        if shape:
            seen[tuple(slice(o, o + s) for o, s in zip(offsets, sub))] += 1
        else:
            seen += 1
    assert bool((seen == 1).all())


def test_blocks_refuse_an_element_larger_than_the_limit():
    with pytest.raises(ValueError, match="single element"):
        list(blocks((4,), 8, 4))


def test_pieces_accept_tensors_shards_and_lists():
    w = torch.zeros(4, 6)
    pieces = pieces_of(
        {
            "full": w,
            "tp": Shard(w[:2], (4, 6), (2, 0)),
            "two": [Shard(w[:1], (4, 6), (0, 0)), Shard(w[:3], (4, 6), (1, 0))],
        }
    )
    assert [(p.name, p.offsets) for p in pieces] == [
        ("full", (0, 0)),
        ("tp", (2, 0)),
        ("two", (0, 0)),
        ("two", (1, 0)),
    ]
    assert list(itertools.chain(*(p.wire()[2] for p in pieces[:1]))) == [4, 6]


@pytest.mark.parametrize(
    ("value", "error", "fragment"),
    [
        (Shard(torch.zeros(3, 6), (4, 6), (2, 0)), ValueError, "does not fit"),
        (Shard(torch.zeros(2, 6), (4, 6), (0,)), ValueError, "does not fit"),
        ("not a tensor", TypeError, "expected a tensor or a Shard"),
    ],
)
def test_pieces_refuse_bad_input(value, error, fragment):
    with pytest.raises(error, match=fragment):
        pieces_of({"x": value})
