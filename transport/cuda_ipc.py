"""Daemon-owned GPU memory shared over CUDA IPC: the GPU twin of ``transport.shm.ShmArena``.

The daemon allocates each arena with plain ``cudaMalloc`` (through ``cuda.bindings``, never the
torch caching allocator: its expandable segments break CUDA IPC and RDMA) and exports it with
``cudaIpcGetMemHandle``. The handle travels in msgpack as plain data, no pickle::

    {"kind": "cuda_ipc", "name": str, "size": int, "layout": [...],   # as ShmArena.handle()
     "ipc_handle": bytes (64, cudaIpcMemHandle_t), "gpu_uuid": "GPU-…", "offset": int}

``offset`` is where the arena starts inside the exported allocation (an allocation may hold several
arenas). A client or engine opens it with ``cudaIpcOpenMemHandle(…, cudaIpcMemLazyEnablePeerAccess)``
on the CUDA index that *its* process gives that UUID (``transport.gpus``), and sees torch tensors
wrapped through ``__cuda_array_interface__``. CUDA has no read-only mapping and torch refuses the
interface's read-only flag, so every view is writable and ``writable=False`` is a promise, not a
protection: readers are trusted not to write.

Lifetime mirrors ShmSegment: ``close()`` drops this process's reference, and the memory is freed
(owner: ``cudaFree``) or unmapped (reader: ``cudaIpcCloseMemHandle``) once no tensor view of it is
alive, so a late view can never touch freed memory. A process that opens a handle it exported
itself gets its own allocation back (CUDA refuses to open its own handles).

Every CUDA call goes through ``CudaDriver`` so tests substitute a host-memory fake; ``cuda.bindings``
is imported lazily and ``import transport.cuda_ipc`` works without it.

    >>> arena = CudaIpcArena.create("refitd-gen0", layout, gpu="GPU-6f2a…")   # daemon   # doctest: +SKIP
    >>> peer = open_any_arena(arena.handle(), writable=False)                 # engine   # doctest: +SKIP
    >>> param.copy_(peer.tensor("model.layers.0.mlp.experts.0.up_proj.weight"))         # doctest: +SKIP
    >>> peer.close(); arena.close()                                                     # doctest: +SKIP
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from transport.arena import ArenaKind, arena_kind
from transport.cuda_driver import IPC_HANDLE_BYTES, CudaError, Driver, active_devices, default_driver
from transport.gpus import (
    InsufficientGpuMemory,
    check_free_memory,
    gpu_by_uuid,
    index_for_uuid,
    local_gpus,
    normalize_uuid,
)
from transport.layout import ALIGN, Layout, nbytes_of
from transport.shm import CarvedArena, ShmArena, shm_region
from transport.shm import open_arena as open_shm_arena
from transport.wire import ProtocolError

log = logging.getLogger("refitd.cuda_ipc")

ALLOC_GRANULARITY = 2 << 20  # allocations are rounded up to 2 MiB, the IPC mapping granularity


def allocation_size(nbytes: int) -> int:
    """Bytes to ``cudaMalloc`` for an arena of ``nbytes``: at least one granule, whole granules."""
    if nbytes < 0:
        raise ValueError(f"arena size {nbytes} is negative")
    return max(1, -(-nbytes // ALLOC_GRANULARITY)) * ALLOC_GRANULARITY


# --------------------------------------------------------------------------------------------------
# the handle on the wire


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """The plain-data description of a CUDA-IPC arena; ``from_wire`` checks every field."""

    name: str
    size: int
    layout: list[list[Any]]
    ipc_handle: bytes
    gpu_uuid: str
    offset: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": ArenaKind.CUDA_IPC.value,
            "name": self.name,
            "size": self.size,
            "layout": self.layout,
            "ipc_handle": self.ipc_handle,
            "gpu_uuid": self.gpu_uuid,
            "offset": self.offset,
        }

    @classmethod
    def from_wire(cls, d: Any) -> CudaIpcHandle:
        def bad(msg: str) -> ProtocolError:
            return ProtocolError(f"cuda_ipc arena handle: {msg}")

        if not isinstance(d, Mapping):
            raise bad(f"expected a map, got {type(d).__name__}")
        if d.get("kind") != ArenaKind.CUDA_IPC.value:
            raise bad(f"kind is {d.get('kind')!r}, expected 'cuda_ipc'")
        for key in ("name", "size", "layout", "ipc_handle", "gpu_uuid", "offset"):
            if key not in d:
                raise bad(f"field {key!r} is missing")
        name, size, offset, raw, uuid = d["name"], d["size"], d["offset"], d["ipc_handle"], d["gpu_uuid"]
        if not isinstance(name, str) or not name:
            raise bad(f"'name' must be a non-empty string, got {name!r}")
        for key, value in (("size", size), ("offset", offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"{key!r} must be a non-negative integer, got {value!r}")
        if offset % ALIGN:
            raise bad(f"'offset' {offset} is not a multiple of {ALIGN}")
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise bad(f"'ipc_handle' must be bytes, got {type(raw).__name__}")
        raw = bytes(raw)
        if len(raw) != IPC_HANDLE_BYTES:
            raise bad(f"'ipc_handle' must be {IPC_HANDLE_BYTES} bytes (cudaIpcMemHandle_t), got {len(raw)}")
        if not any(raw):
            raise bad("'ipc_handle' is all zeros: the arena was never exported")
        if not isinstance(uuid, str) or not uuid.upper().startswith("GPU-") or len(uuid) < 8:
            raise bad(f"'gpu_uuid' must be a GPU UUID like 'GPU-6f2a…', got {uuid!r}")
        rows = d["layout"]
        try:
            layout = Layout.from_wire(rows)
        except (TypeError, ValueError, KeyError) as exc:
            raise bad(f"'layout' is malformed ({exc})") from None
        if layout.size > size:
            raise bad(f"the layout needs {layout.size} bytes but the arena holds {size}")
        return cls(name, size, [list(r) for r in rows], raw, normalize_uuid(uuid), offset)


# --------------------------------------------------------------------------------------------------
# device memory with one owner


class DeviceMemory:
    """One ``cudaMalloc`` allocation, or one IPC mapping of one, in this process.

    Released (freed / unmapped) exactly once, when the last reference goes: the arenas that use it
    and every tensor view made from it (views hold it through their CudaArrayInterface).
    """

    # this process's allocations and mappings, by (driver, IPC handle[, device]): each handle is mapped
    # once, and a handle this process exported resolves to its own allocation (CUDA refuses to open it)
    _owned: ClassVar[weakref.WeakValueDictionary[tuple[int, bytes], DeviceMemory]] = (
        weakref.WeakValueDictionary()
    )
    _opened: ClassVar[weakref.WeakValueDictionary[tuple[int, bytes, int], DeviceMemory]] = (
        weakref.WeakValueDictionary()
    )

    def __init__(
        self, driver: Driver, ptr: int, nbytes: int, device: int, uuid: str, ipc: bytes, *, owned: bool
    ):
        self.driver, self.ptr, self.nbytes, self.device, self.gpu_uuid = driver, ptr, nbytes, device, uuid
        self.ipc_handle, self.owned = ipc, owned
        self._finalizer = weakref.finalize(self, _release, driver, ptr, device, owned, uuid)

    @classmethod
    def allocate(cls, driver: Driver, device: int, uuid: str, nbytes: int) -> DeviceMemory:
        ptr = driver.malloc(device, nbytes)
        try:
            driver.memset(device, ptr, 0, nbytes)  # like a fresh shm segment: readers never see stale bytes
            ipc = driver.ipc_get_handle(device, ptr)
        except BaseException:
            driver.free(device, ptr)
            raise
        mem = cls(driver, ptr, nbytes, device, uuid, ipc, owned=True)
        cls._owned[(id(driver), ipc)] = mem  # the entry dies with mem, which holds driver
        return mem

    @classmethod
    def open(cls, driver: Driver, device: int, uuid: str, ipc: bytes, nbytes: int) -> DeviceMemory:
        """Map an exported allocation once per (handle, device) in this process."""
        mem = cls._owned.get((id(driver), ipc))
        if mem is not None:
            return mem
        mem = cls._opened.get((id(driver), ipc, device))
        if mem is not None:
            mem.nbytes = max(mem.nbytes, nbytes)  # another arena further into the same allocation
            return mem
        ptr = driver.ipc_open(device, ipc)
        mem = cls(driver, ptr, nbytes, device, uuid, ipc, owned=False)
        cls._opened[(id(driver), ipc, device)] = mem
        return mem

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) lies outside the allocation ({self.nbytes} B)")
        return self.driver.tensor(self.ptr + offset, nbytes, self.device, self)


def _synchronize_all(driver: Driver, device: int) -> None:
    """Wait for every GPU of this process, not only ``device``: with several lanes another GPU's
    stream may be copying out of (or into) the memory, and a finalizer runs on whatever thread
    dropped the last reference."""
    for d in active_devices(driver, device):
        driver.synchronize(d)


def _release(driver: Driver, ptr: int, device: int, owned: bool, uuid: str) -> None:
    try:
        _synchronize_all(driver, device)  # pending copies out of (or into) it, on any lane, finish first
        (driver.free if owned else driver.ipc_close)(device, ptr)
    except Exception as exc:  # at interpreter exit the runtime may already be gone
        log.warning("could not %s arena memory on %s: %s", "free" if owned else "unmap", uuid, exc)


# --------------------------------------------------------------------------------------------------
# the arena


def _resolve_device(driver: Driver, gpu: int | str | None) -> tuple[int, str]:
    visible = driver.visible_uuids()
    if gpu is None:
        device = driver.current_device()
    elif isinstance(gpu, int):
        device = gpu
        if not 0 <= device < len(visible):
            raise ValueError(f"cuda:{device} does not exist: this process sees {len(visible)} GPU(s)")
    else:
        device = index_for_uuid(gpu, visible)
    return device, visible[device]


def resolve_gpu(gpu: int | str, driver: Driver | None = None) -> tuple[int, str]:
    """(this process's CUDA index, UUID) of ``gpu`` (an index or a UUID); ValueError for an index
    out of range, GpuNotVisible (a LookupError) for a UUID this process cannot see."""
    return _resolve_device(default_driver() if driver is None else driver, gpu)


def _free_memory(driver: Driver, device: int, uuid: str, nvml: Any = None) -> tuple[int, int, str]:
    """(free, total, where) for the GPU: NVML first (all processes), else cudaMemGetInfo."""
    gpu = gpu_by_uuid(uuid, local_gpus(nvml))
    if gpu is not None:
        return gpu.memory_free, gpu.memory_total, f"GPU {gpu.index} ({gpu.name}, {uuid})"
    free, total = driver.mem_get_info(device)
    return free, total, f"cuda:{device} ({uuid})"


class CudaIpcArena(CarvedArena):
    """GPU memory carved by a layout, shared over CUDA IPC. Same interface as ShmArena.

    Create (daemon) with ``create``; open (client, engine) with ``open`` or ``open_any_arena``.
    """

    kind = ArenaKind.CUDA_IPC

    def __init__(
        self, mem: DeviceMemory, offset: int, size: int, layout: Layout, name: str, *, writable: bool
    ):
        if offset % ALIGN or offset + size > mem.nbytes:
            raise ValueError(
                f"arena {name!r}: [{offset}, {offset + size}) does not fit its {mem.nbytes} B memory"
            )
        if layout.size > size:
            raise ValueError(f"arena {name!r}: {size} bytes cannot hold a layout of {layout.size} bytes")
        self._mem: DeviceMemory | None = mem
        self.offset, self.size, self.layout, self.name, self.writable = offset, size, layout, name, writable
        self.gpu_uuid, self.device = mem.gpu_uuid, mem.device
        self._views: dict[str, torch.Tensor] | None = None
        self._closed: weakref.ref[DeviceMemory] | None = None

    @classmethod
    def create(
        cls,
        name: str,
        layout: Layout,
        *,
        size: int | None = None,
        gpu: int | str | None = None,
        driver: Driver | None = None,
        reserve_bytes: int = 0,
        nvml: Any = None,
    ) -> CudaIpcArena:
        """Allocate an arena on ``gpu`` (UUID, this process's index, or the current device).

        Refuses, naming the sizes, when the allocation plus ``reserve_bytes`` (left for the
        engines and kernels that share the GPU) exceeds its free memory.
        """
        capacity = layout.size if size is None else size
        if capacity < layout.size:
            raise ValueError(f"arena {name!r}: {capacity} bytes cannot hold a layout of {layout.size} bytes")
        driver = default_driver() if driver is None else driver
        device, uuid = _resolve_device(driver, gpu)
        nbytes = allocation_size(capacity)
        free, total, where = _free_memory(driver, device, uuid, nvml)
        check_free_memory(f"arena {name!r}", nbytes, free=free, total=total, gpu=where, reserve=reserve_bytes)
        try:
            mem = DeviceMemory.allocate(driver, device, uuid, nbytes)
        except CudaError as exc:
            if "MemoryAllocation" not in str(exc):
                raise
            raise InsufficientGpuMemory(
                f"arena {name!r}: cudaMalloc of {nbytes} B on {where} failed: {exc}"
            ) from None
        return cls(mem, 0, capacity, layout, name, writable=True)

    @classmethod
    def open(
        cls,
        handle: Mapping[str, Any],
        *,
        writable: bool,
        device: int | None = None,
        driver: Driver | None = None,
    ) -> CudaIpcArena:
        """Map an arena from its ``handle()``; on its own GPU, or on ``device`` as peer memory."""
        h = CudaIpcHandle.from_wire(handle)
        driver = default_driver() if driver is None else driver
        if device is None:
            device = index_for_uuid(h.gpu_uuid, driver.visible_uuids())
        mem = DeviceMemory.open(driver, device, h.gpu_uuid, h.ipc_handle, h.offset + h.size)
        return cls(mem, h.offset, h.size, Layout.from_wire(h.layout), h.name, writable=writable)

    def _memory(self) -> DeviceMemory:
        if self._mem is None:
            raise ValueError(f"arena {self.name!r} is closed")
        return self._mem

    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._views is None:
            flat = self._memory().tensor(self.offset, self.size)
            self._views = {
                s.name: flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.layout
            }
        return self._views

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = nbytes_of(dtype, shape)
        self._check_range(offset, nbytes)
        return self._memory().tensor(self.offset + offset, nbytes).view(dtype).view(shape)

    def handle(self) -> dict[str, Any]:
        mem = self._memory()
        return CudaIpcHandle(
            self.name, self.size, self.layout.to_wire(), mem.ipc_handle, mem.gpu_uuid, self.offset
        ).to_wire()

    @property
    def released(self) -> bool:
        """True once this arena is closed and its memory is gone from this process."""
        if self._mem is not None:
            return False
        mem = self._closed() if self._closed is not None else None
        return mem is None or mem.released

    def close(self) -> None:
        """Drop this process's reference (idempotent); the memory goes once no view of it is alive."""
        self._views = None
        mem, self._mem = self._mem, None
        if mem is not None:
            self._closed = weakref.ref(mem)

    def unlink(self) -> None:
        """Nothing to do: GPU memory has no name to remove. Kept so arenas are interchangeable."""

    @property
    def driver(self) -> Driver:
        return self._memory().driver

    def zero(self) -> None:
        """Zero the arena's bytes (synchronously), as a fresh allocation is."""
        mem = self._memory()
        mem.driver.memset(mem.device, mem.ptr + self.offset, 0, self.size)

    def synchronize(self) -> None:
        """Wait for every stream of this arena's GPU (its writes land before anyone is told)."""
        mem = self._memory()
        mem.driver.synchronize(mem.device)


class HostPin:
    """Host memory page-locked for DMA (``cudaHostRegister``) until :meth:`release` (idempotent;
    also at garbage collection). The daemon pins each host generation (writable), a reader its
    read-only mapping of one; both unpin before they unmap. The mapping must outlive the pin."""

    def __init__(self, driver: Driver, device: int, ptr: int, nbytes: int, *, read_only: bool):
        driver.host_register(device, ptr, nbytes, read_only=read_only)
        self.driver, self.device, self.ptr, self.nbytes, self.read_only = (
            driver,
            device,
            ptr,
            nbytes,
            read_only,
        )
        self._finalizer = weakref.finalize(self, _unpin, driver, device, ptr)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        self._finalizer()


def _unpin(driver: Driver, device: int, ptr: int) -> None:
    try:
        _synchronize_all(driver, device)  # DMAs in flight out of (or into) it, on any lane, finish first
        driver.host_unregister(device, ptr)
    except Exception as exc:  # at interpreter exit the runtime may already be gone
        log.warning("could not unregister page-locked host memory at %#x: %s", ptr, exc)


def pin_shm_arena(arena: ShmArena, *, driver: Driver, device: int, read_only: bool) -> HostPin | None:
    """Page-lock a POSIX-shm arena's whole segment (None for an empty one: nothing to pin)."""
    region = shm_region(arena)
    if region is None:
        return None
    ptr, nbytes = region
    return HostPin(driver, device, ptr, nbytes, read_only=read_only)


def own_device(driver: Driver | None = None) -> int:
    """This process's current CUDA index (``cudaGetDevice``: the GPU a trainer rank or engine
    worker set, 0 where it set none), to map an arena on instead of the arena's own GPU."""
    return (default_driver() if driver is None else driver).current_device()


def open_any_arena(
    handle: Mapping[str, Any], *, writable: bool, device: int | None = None, driver: Driver | None = None
) -> ShmArena | CudaIpcArena:
    """Open the arena a daemon described, whatever memory it lives in.

    ``device`` (CUDA arenas only): map on this CUDA index instead of the arena's own GPU, reading
    it as peer memory over NVLink; by default the arena's GPU must be visible to this process.
    """
    if not isinstance(handle, Mapping):
        raise ValueError(f"an arena handle is a map, got {type(handle).__name__}")
    if arena_kind(handle) is ArenaKind.SHM:
        return open_shm_arena(handle, writable=writable)
    return CudaIpcArena.open(handle, writable=writable, device=device, driver=driver)
