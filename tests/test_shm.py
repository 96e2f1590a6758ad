"""Daemon-owned POSIX shared memory: mode 0600, attach without a resource tracker, read-only readers."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest
import torch

from transport.layout import Layout
from transport.shm import SHM_DIR, ShmArena, ShmSegment, open_arena, segment_name


@pytest.fixture
def arena():
    layout = Layout.build(
        [("a", torch.bfloat16, (3, 5)), ("b", torch.float8_e4m3fn, (7,)), ("s", torch.float32, ())]
    )
    a = ShmArena.create(segment_name("refitd-test", "unit"), layout)
    yield a
    a.close()
    a.unlink()


def test_layout_is_aligned_and_round_trips():
    layout = Layout.build(
        [("a", torch.bfloat16, (3, 5)), ("b", torch.uint8, (1,)), ("c", torch.float32, (2, 2))]
    )
    offsets = [s.offset for s in layout]
    assert offsets == [0, 256, 512] and layout.size == 512 + 16
    again = Layout.from_wire(layout.to_wire())
    assert [(s.name, s.dtype, s.shape, s.offset) for s in again] == [
        (s.name, s.dtype, s.shape, s.offset) for s in layout
    ]


def test_segment_is_private_and_unlinked(arena):
    path = SHM_DIR / arena.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    arena.close()
    arena.unlink()
    assert not path.exists()
    arena.unlink()  # idempotent


def _child_attach(handle, done):
    peer = open_arena(handle, writable=True)
    peer.tensor("a").fill_(3.0)
    peer.close()
    done.set()


def test_attaching_process_exit_does_not_unlink(arena):
    """Python 3.11's resource tracker would unlink a segment when an attaching process exits."""
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    p = ctx.Process(target=_child_attach, args=(arena.handle(), done))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0 and done.is_set()
    assert (SHM_DIR / arena.name).exists()
    assert torch.equal(arena.tensor("a"), torch.full((3, 5), 3.0, dtype=torch.bfloat16))


def _child_write_readonly(handle):
    peer = open_arena(handle, writable=False)
    peer.tensor("a").fill_(1.0)  # must fault, not corrupt


def test_reader_mapping_is_read_only(arena):
    arena.tensor("a").fill_(2.0)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_write_readonly, args=(arena.handle(),))
    p.start()
    p.join(timeout=60)
    assert p.exitcode != 0  # SIGSEGV/SIGBUS in the reader, not a silent write
    assert torch.equal(arena.tensor("a"), torch.full((3, 5), 2.0, dtype=torch.bfloat16))


def test_views_outlive_close_without_crashing(arena):
    view = arena.tensor("b")
    arena.close()  # the mapping stays while the view is alive
    assert view.view(torch.uint8).sum().item() == 0


def test_relayout_refuses_a_plan_that_does_not_fit(arena):
    with pytest.raises(ValueError, match="raise the configured arena size"):
        arena.relayout(Layout.build([("big", torch.float32, (1 << 20,))]))


def test_create_refuses_existing_name(arena):
    with pytest.raises(FileExistsError):
        ShmSegment.create(arena.name, 16)


def test_attach_missing_segment_says_what_to_do():
    with pytest.raises(FileNotFoundError, match="reconnect to the running daemon"):
        ShmSegment.attach("refitd-test-does-not-exist", 16, writable=False)


def test_segment_names_are_unique():
    assert len({segment_name("p", "r") for _ in range(100)}) == 100
    assert not any(Path(SHM_DIR, n).exists() for n in (segment_name("p", "r"),))
    assert os.sep not in segment_name("p", "r")
