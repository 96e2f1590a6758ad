"""A CUDA stand-in over host memory for the memory-tier tests: every allocation, free, page-lock and
unlock counted, the device bytes live at once (and their peak) per GPU, and the fake's "device
memory" plain host memory, so copies through it are real memcpys and results compare byte for byte.

    fake = FakeCuda(gpus=2, total=141 << 30)
    monkeypatch.setattr(transport.cuda_ipc, "default_driver", lambda required=True: fake)
    ...                                   # a daemon with arena = "cuda", a trainer, a reader
    assert fake.peak[0] <= budget and fake.registered == {}

It implements ``transport.cuda_driver.Driver`` (the seam the arenas use), like test_cuda_ipc's
HostDriver. It also enforces the CUDA rules a first run on a GPU would meet (issue 34):

- a process sees only its ``visible`` GPUs: a call naming another index fails (cudaErrorInvalidDevice),
  but ``ipc_open`` on a visible device maps an allocation of any GPU of the node (peer memory);
- the first call on a device makes this process's primary context there (``contexts``: what
  ``nvidia-smi`` would list, one per process and GPU);
- ``fault()`` is a kernel fault: sticky, every later call of the process fails with it;
- ``cudaFree`` of an exported allocation poisons it, puts it back for the next ``malloc`` of the
  same size, and is recorded in ``violations`` while another process still maps it (undefined
  behaviour in CUDA's words);
- ``read_only_register=False`` answers a READ_ONLY ``cudaHostRegister`` with cudaErrorNotSupported;
- ``launch(device, fn)`` runs work on a thread per device (a lane's stream), ``synchronize(device)``
  waits for that device's only, and ``host_unregister`` while any device's work is in flight is a
  violation.

``process(visible=..., current=...)`` is another process on the same node (its own contexts,
mappings and sticky state; the GPUs' memory shared).
"""

from __future__ import annotations

import collections
import struct
import threading

import numpy as np
import torch

from transport.cuda_driver import IPC_HANDLE_BYTES, CudaError

GIB = 1 << 30


def _read_only_mapping(ptr: int) -> bool:
    """Whether this process maps ``ptr`` without write permission (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return "w" not in perms
    return False


class _HostArray:
    """``__array_interface__`` over ``nbytes`` at ``ptr``: tensors made from it keep ``owner`` alive."""

    def __init__(self, ptr: int, nbytes: int, owner: object):
        self.owner = owner
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


POISON = 0xDB  # what a freed exported allocation reads as
STICKY = {
    "cudaErrorIllegalAddress": "an illegal memory access was encountered",
    "cudaErrorLaunchFailure": "unspecified launch failure",
}


class FakeNode:
    """The node's GPUs, shared by every fake process: allocations, exports and who maps them."""

    def __init__(self, uuids: list[str], total: int):
        self.uuids, self.total = uuids, total
        self.lock = threading.RLock()
        self.owner: dict[
            int, tuple[FakeCuda, int, np.ndarray]
        ] = {}  # allocation id -> (process, device, bytes)
        self.exported: set[int] = set()
        self.mapped: dict[int, set[int]] = collections.defaultdict(set)  # allocation id -> importer pids
        self.pool: dict[int, list[np.ndarray]] = collections.defaultdict(list)  # freed exported, by size
        self.violations: list[str] = []
        self.next_id, self.next_pid = 1, 1


class FakeCuda:
    """``gpus`` fake GPUs of ``total`` bytes each; this object is one process on the node."""

    def __init__(
        self,
        gpus: int = 1,
        total: int = 141 * GIB,
        *,
        node: FakeNode | None = None,
        visible: list[str] | None = None,
        current: int = 0,
        read_only_register: bool = True,
        pageable_host_page_tables: bool = False,
    ):
        if node is None:
            node = FakeNode([f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(gpus)], total)
        self.node, self.total = node, node.total
        self.uuids = list(node.uuids if visible is None else visible)  # this process's CUDA order
        self.current, self.read_only_register = current, read_only_register
        #: x86 without HMM: a read-only mapping registers only with READ_ONLY; Grace / HMM: either way
        self.pageable_host_page_tables = pageable_host_page_tables
        #: set by a test to hold every cudaHostRegister until it is set (a slow page-lock)
        self.register_gate: threading.Event | None = None
        self.pid, node.next_pid = node.next_pid, node.next_pid + 1
        self.calls: collections.Counter[str] = collections.Counter()
        self.buffers: dict[int, tuple[int, np.ndarray]] = {}  # ptr -> (device, bytes)
        self.ids: dict[int, int] = {}  # ptr -> allocation id (its IPC handle)
        self.opened: dict[int, int] = {}  # ptr -> allocation id, of what this process mapped over IPC
        self.live = collections.Counter()  # device -> bytes allocated now
        self.peak = collections.Counter()  # device -> most bytes allocated at once
        self.allocations: list[tuple[int, int]] = []  # (device, bytes) of every malloc, in order
        self.registered: dict[int, tuple[int, bool]] = {}  # host ptr -> (bytes, read_only)
        self.registrations: list[tuple[int, int, bool]] = []  # (ptr, bytes, read_only) of every register
        self.contexts: set[int] = set()  # devices this process has a primary context on
        self.sticky: str | None = None  # the sticky error every call now fails with
        self.inflight: dict[int, list[threading.Thread]] = collections.defaultdict(list)
        self._lock = node.lock

    def process(self, *, visible: list[str] | None = None, current: int = 0, **kw) -> FakeCuda:
        """Another process on this node, seeing ``visible`` (UUIDs, in its CUDA order)."""
        return FakeCuda(node=self.node, visible=visible, current=current, **kw)

    @property
    def violations(self) -> list[str]:
        return self.node.violations

    def _on(self, device: int, what: str) -> None:
        """A call on ``device``: sticky errors first, then the device must be one this process sees."""
        if self.sticky is not None:
            raise CudaError(f"{what} failed: {self.sticky} ({STICKY.get(self.sticky, 'sticky error')})")
        if not isinstance(device, int) or not 0 <= device < len(self.uuids):
            raise CudaError(
                f"{what} failed: cudaErrorInvalidDevice (this process sees {len(self.uuids)} GPU(s), not {device})"
            )
        self.contexts.add(device)

    # ---- the Driver seam

    def visible_uuids(self):
        return list(self.uuids)

    def current_device(self):
        return self.current

    def active_devices(self):
        return sorted(self.contexts)

    def mem_get_info(self, device):
        self._on(device, "cudaMemGetInfo")
        return self.total - self.live[device], self.total

    def malloc(self, device, nbytes):
        with self._lock:
            self._on(device, f"cudaMalloc({nbytes})")
            self.calls["malloc"] += 1
            if self.live[device] + nbytes > self.total:
                raise CudaError(f"cudaMalloc({nbytes}) failed: cudaErrorMemoryAllocation (out of memory)")
            reuse = self.node.pool.get(nbytes)
            buf = reuse.pop() if reuse else np.full(nbytes, 0xEE, np.uint8)  # garbage, as cudaMalloc gives
            ptr = buf.ctypes.data
            self.buffers[ptr] = (device, buf)
            self.ids[ptr], self.node.next_id = self.node.next_id, self.node.next_id + 1
            self.node.owner[self.ids[ptr]] = (self, device, buf)
            self.live[device] += nbytes
            self.peak[device] = max(self.peak[device], self.live[device])
            self.allocations.append((device, nbytes))
            return ptr

    def memset(self, device, ptr, value, nbytes):
        self._on(device, "cudaMemset")
        base = next(b for b, (_, buf) in self.buffers.items() if b <= ptr < b + buf.nbytes)
        self.buffers[base][1][ptr - base : ptr - base + nbytes] = value

    def free(self, device, ptr):
        with self._lock:
            self._on(device, "cudaFree")
            self.calls["free"] += 1
            dev, buf = self.buffers.pop(ptr)  # KeyError on a double free
            aid = self.ids.pop(ptr)
            self.node.owner.pop(aid)
            self.live[dev] -= buf.nbytes
            if aid in self.node.exported:
                if self.node.mapped.get(aid):
                    self.node.violations.append(
                        f"cudaFree of exported allocation {aid} ({buf.nbytes} B) while process(es) "
                        f"{sorted(self.node.mapped[aid])} still map it"
                    )
                buf[:] = POISON
                self.node.pool[buf.nbytes].append(buf)  # the next cudaMalloc of this size may get it

    def ipc_get_handle(self, device, ptr):
        self._on(device, "cudaIpcGetMemHandle")
        aid = self.ids[ptr]
        self.node.exported.add(aid)
        return b"FAKECUDA" + struct.pack("<Q", aid) + bytes(IPC_HANDLE_BYTES - 16)

    def ipc_open(self, device, handle):
        with self._lock:
            self._on(device, "cudaIpcOpenMemHandle")
            self.calls["ipc_open"] += 1
            aid = struct.unpack("<Q", bytes(handle[8:16]))[0]
            owner = self.node.owner.get(aid)
            if owner is None:
                raise CudaError("cudaIpcOpenMemHandle failed: cudaErrorInvalidResourceHandle")
            if owner[0] is self:  # CUDA refuses a process its own handles
                raise CudaError("cudaIpcOpenMemHandle failed: cudaErrorInvalidContext (own handle)")
            ptr = owner[2].ctypes.data
            self.opened[ptr] = aid
            self.node.mapped[aid].add(self.pid)
            return ptr

    def ipc_close(self, device, ptr):
        with self._lock:
            self._on(device, "cudaIpcCloseMemHandle")
            self.calls["ipc_close"] += 1
            aid = self.opened.pop(ptr)  # KeyError: nothing was opened there
            self.node.mapped[aid].discard(self.pid)

    def launch(self, device, fn):
        """Work queued on ``device`` (a lane's stream), run on a thread of its own."""
        self._on(device, "cudaLaunchKernel")
        t = threading.Thread(target=fn, daemon=True)
        self.inflight[device].append(t)
        t.start()
        return t

    def synchronize(self, device):
        self._on(device, "cudaDeviceSynchronize")
        self.calls["synchronize"] += 1
        for t in self.inflight.pop(device, []):
            t.join()

    def fault(self, error: str = "cudaErrorIllegalAddress") -> None:
        """A kernel of this process faulted: sticky from now on."""
        self.sticky = error

    def tensor(self, ptr, nbytes, device, owner):
        self._on(device, "cudaPointerGetAttributes")
        return torch.from_numpy(np.asarray(_HostArray(ptr, nbytes, owner)))

    def host_register(self, device, ptr, nbytes, *, read_only):
        if self.register_gate is not None and not self.register_gate.wait(60):
            raise CudaError("cudaHostRegister: the test never opened register_gate")
        with self._lock:
            self._on(device, f"cudaHostRegister({nbytes} B)")
            self.calls["host_register"] += 1
            if read_only and not self.read_only_register:
                raise CudaError(
                    f"cudaHostRegister({nbytes} B) failed: cudaErrorNotSupported (operation not supported)"
                )
            if not read_only and not self.pageable_host_page_tables and _read_only_mapping(ptr):
                raise CudaError(
                    f"cudaHostRegister({nbytes} B) failed: cudaErrorInvalidValue (invalid argument)"
                )
            if ptr in self.registered:  # as CUDA: cudaErrorHostMemoryAlreadyRegistered
                raise CudaError("cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered")
            self.registered[ptr] = (nbytes, read_only)
            self.registrations.append((ptr, nbytes, read_only))

    def host_unregister(self, device, ptr):
        with self._lock:
            self._on(device, "cudaHostUnregister")
            self.calls["host_unregister"] += 1
            busy = sorted(d for d, ts in self.inflight.items() if any(t.is_alive() for t in ts))
            if busy:
                self.node.violations.append(
                    f"cudaHostUnregister({ptr:#x}) while work is in flight on cuda:{busy}"
                )
            if self.registered.pop(ptr, None) is None:
                raise CudaError("cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered")

    # ---- for tests

    @property
    def device_bytes_now(self) -> int:
        return sum(self.live.values())
