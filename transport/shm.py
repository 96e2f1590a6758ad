"""Daemon-owned POSIX shared memory: segments, the layouts that carve them into tensors, arenas.

The daemon creates every segment (``/dev/shm/<name>``, mode 0600, ``O_EXCL``) and unlinks it on
shutdown; trainer clients and engine readers only attach. Segments are opened with ``os.open`` +
``mmap`` rather than ``multiprocessing.shared_memory``, so no resource tracker is involved: on
Python 3.11 an attaching process's tracker would otherwise unlink the segment when that process
exits, pulling it from under everyone else.

Tensor views hold a numpy export of the mapping, so the mapping cannot be unmapped while a view is
alive (``close()`` then leaves the unmapping to the garbage collector instead of segfaulting a
reader that still holds a view).

An arena (``transport.arena.Arena``) is a segment plus a ``Layout``; its wire description
(``handle()``) is plain data sent in msgpack. The CUDA-IPC arena implements the same interface with a
64-byte IPC handle.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transport.arena import ArenaKind, arena_kind
from transport.layout import ALIGN, Layout, nbytes_of

SHM_DIR = Path("/dev/shm")


def segment_name(prefix: str, role: str) -> str:
    """A fresh, unguessable segment name: ``<prefix>-<role>-<random>``."""
    return f"{prefix}-{role}-{secrets.token_hex(6)}"


class ShmSegment:
    """One POSIX shared-memory segment mapped into this process. Use ``create`` or ``attach``."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, *, owner: bool, writable: bool):
        self.name, self.size, self.owner, self.writable = name, size, owner, writable
        self._mmap: mmap.mmap | None = mm
        self._bytes = np.frombuffer(mm, dtype=np.uint8, count=size) if size else np.empty(0, np.uint8)

    @classmethod
    def create(cls, name: str, size: int) -> ShmSegment:
        """Create ``/dev/shm/<name>`` of ``size`` bytes, mode 0600; fails if it exists."""
        if size < 0:
            raise ValueError(f"segment {name!r}: size {size} is negative")
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
        return cls(name, size, mm, owner=True, writable=True)

    @classmethod
    def attach(cls, name: str, size: int, *, writable: bool) -> ShmSegment:
        """Map an existing segment; a read-only mapping makes reader writes fault, not corrupt."""
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {name!r} does not exist: the daemon that owned it has exited; "
                "reconnect to the running daemon"
            ) from None
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"segment {name!r} holds {actual} bytes, expected at least {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False, writable=writable)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over bytes ``[offset, offset + nbytes)`` of the segment (no copy)."""
        if self._mmap is None:
            raise ValueError(f"segment {self.name!r} is closed")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"view [{offset}, {offset + nbytes}) lies outside segment {self.name!r} ({self.size} B)"
            )
        raw = self._bytes[offset : offset + nbytes]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mappings: torch warns, we meant it
            flat = torch.from_numpy(raw)
        return flat.view(dtype).view(shape)

    def close(self) -> None:
        """Drop this process's mapping (idempotent). Views still alive keep it mapped until collected."""
        mm, self._mmap = self._mmap, None
        self._bytes = np.empty(0, np.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def unlink(self) -> None:
        """Remove the segment's name (owner only, idempotent): it is freed once every mapping is gone."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / self.name)


# --------------------------------------------------------------------------------------------------
# arenas


class CarvedArena:
    """What every arena shares: named views over its memory, cut by a layout that may change.

    Subclasses set ``name``, ``size``, ``layout`` and ``_views`` and implement ``tensors()``.
    """

    name: str
    size: int
    layout: Layout
    _views: dict[str, torch.Tensor] | None

    def tensors(self) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors()[name]

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over bytes ``[offset, offset + nbytes)`` of this arena, whatever its layout says
        (a staging ring places each group's tensors at offsets of their own)."""
        raise NotImplementedError

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset % ALIGN or offset + nbytes > self.size:
            raise ValueError(
                f"view [{offset}, {offset + nbytes}) of arena {self.name!r} ({self.size} B) is out of "
                f"bounds or not {ALIGN}-byte aligned"
            )

    def relayout(self, layout: Layout) -> None:
        """Carve the same memory differently (the plan became known after the arena was made)."""
        if layout.size > self.size:
            raise ValueError(
                f"arena {self.name!r} holds {self.size} bytes but the plan needs {layout.size}; "
                "raise the configured arena size or give the daemon the model's config so it sizes itself"
            )
        self.layout, self._views = layout, None


class ShmArena(CarvedArena):
    """A POSIX shared-memory segment carved by a layout.

    >>> arena = ShmArena.create("refitd-demo-staging", Layout.build([("w", torch.bfloat16, (4, 4))]))
    >>> arena.tensor("w").fill_(1.0)             # doctest: +SKIP
    >>> peer = open_arena(arena.handle(), writable=False)   # in another process
    >>> arena.close(); arena.unlink()
    """

    kind = ArenaKind.SHM

    def __init__(self, segment: ShmSegment, layout: Layout):
        self.segment, self.layout = segment, layout
        self._views: dict[str, torch.Tensor] | None = None

    @classmethod
    def create(cls, name: str, layout: Layout, *, size: int | None = None) -> ShmArena:
        capacity = layout.size if size is None else size
        if capacity < layout.size:
            raise ValueError(f"arena {name!r}: {capacity} bytes cannot hold a layout of {layout.size} bytes")
        return cls(ShmSegment.create(name, capacity), layout)

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def size(self) -> int:
        return self.segment.size

    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._views is None:
            self._views = {s.name: self.segment.view(s.offset, s.dtype, s.shape) for s in self.layout}
        return self._views

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self._check_range(offset, nbytes_of(dtype, shape))
        return self.segment.view(offset, dtype, shape)

    def handle(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "name": self.name,
            "size": self.size,
            "layout": self.layout.to_wire(),
        }

    def close(self) -> None:
        self._views = None
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()


def open_arena(handle: Mapping[str, Any], *, writable: bool) -> ShmArena:
    """Attach to an arena described by ``handle()`` from the daemon."""
    if arena_kind(handle) is not ArenaKind.SHM:
        raise ValueError(
            f"arena kind {handle.get('kind')!r} cannot be opened here (this build opens 'shm' arenas)"
        )
    segment = ShmSegment.attach(str(handle["name"]), int(handle["size"]), writable=writable)
    return ShmArena(segment, Layout.from_wire(handle["layout"]))


def shm_region(arena: Any) -> tuple[int, int] | None:
    """``(address, size)`` of a POSIX-shm arena's whole segment in this process, else None (a CUDA
    arena, or none): what NIXL registers to READ or WRITE a generation or the staging arena."""
    segment = getattr(arena, "segment", None)
    if getattr(arena, "kind", None) is not ArenaKind.SHM or segment is None or not segment.size:
        return None
    return segment.view(0, torch.uint8, (segment.size,)).data_ptr(), segment.size
