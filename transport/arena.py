"""What every arena is: the kind of memory it lives in, and the one interface all kinds implement.

An arena is daemon-owned memory carved by a :class:`~transport.layout.Layout` into named tensors. Its
``handle()`` is plain data (msgpack) that another process opens with
``transport.cuda_ipc.open_any_arena``; the handle's ``"kind"`` is an :class:`ArenaKind` value, so the
enum's values are wire values and never change. Two kinds exist:

- ``ShmArena`` (``transport.shm``): a POSIX shared-memory segment, any machine;
- ``CudaIpcArena`` (``transport.cuda_ipc``): ``cudaMalloc`` memory shared through CUDA IPC.

Code that needs to tell them apart asks ``arena.kind is ArenaKind.SHM``, never a string. The config's
``arena = "cuda"`` is the user's word for :attr:`ArenaKind.CUDA_IPC`, converted once in
``sidecar.config``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from transport.layout import Layout


class ArenaKind(str, enum.Enum):
    """Where an arena's memory lives; the value is the ``"kind"`` of its wire handle."""

    SHM = "shm"  # POSIX shared memory (host)
    CUDA_IPC = "cuda_ipc"  # GPU memory from cudaMalloc, shared through CUDA IPC


@runtime_checkable
class Arena(Protocol):
    """Daemon-owned memory carved by a layout, the same for every kind.

    Why a Protocol and not only the shared base class (``transport.shm.CarvedArena``): the daemon,
    the trainer client, the engine adapters and the movers hold arenas of either kind and must need
    nothing but this; a test checks that every kind implements all of it.

    ``tensors()`` views are cached until ``relayout``; ``view`` reads bytes the layout does not name
    (a staging ring); ``close`` drops this process's mapping (idempotent) and ``unlink`` removes the
    name (the owner, once; a no-op for CUDA memory, which has no name).
    """

    kind: ArenaKind
    name: str
    size: int
    layout: Layout

    def tensor(self, name: str) -> torch.Tensor: ...

    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...

    def relayout(self, layout: Layout) -> None: ...

    def handle(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def unlink(self) -> None: ...


def arena_kind(handle: Mapping[str, Any]) -> ArenaKind:
    """The kind of the arena a wire handle describes; ValueError names the kinds this build opens."""
    try:
        return ArenaKind(handle.get("kind"))
    except ValueError:
        known = ", ".join(repr(k.value) for k in ArenaKind)
        raise ValueError(f"arena kind {handle.get('kind')!r} is unknown; this build opens {known}") from None
