"""A CUDA stand-in over host memory for the memory-tier tests: every allocation, free, page-lock and
unlock counted, the device bytes live at once (and their peak) per GPU, and the fake's "device
memory" plain host memory, so copies through it are real memcpys and results compare byte for byte.

    fake = FakeCuda(gpus=2, total=141 << 30)
    monkeypatch.setattr(transport.cuda_ipc, "default_driver", lambda required=True: fake)
    ...                                   # a daemon with arena = "cuda", a trainer, a reader
    assert fake.peak[0] <= budget and fake.registered == {}

It implements ``transport.cuda_driver.Driver`` (the seam the arenas use), like test_cuda_ipc's
HostDriver; tests that need two processes' views use that one.
"""

from __future__ import annotations

import collections
import struct
import threading

import numpy as np
import torch

from transport.cuda_driver import IPC_HANDLE_BYTES, CudaError

GIB = 1 << 30


class _HostArray:
    """``__array_interface__`` over ``nbytes`` at ``ptr``: tensors made from it keep ``owner`` alive."""

    def __init__(self, ptr: int, nbytes: int, owner: object):
        self.owner = owner
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class FakeCuda:
    """``gpus`` fake GPUs of ``total`` bytes each, in one process."""

    def __init__(self, gpus: int = 1, total: int = 141 * GIB):
        self.uuids = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(gpus)]
        self.total = total
        self.calls: collections.Counter[str] = collections.Counter()
        self.buffers: dict[int, tuple[int, np.ndarray]] = {}  # ptr -> (device, bytes)
        self.ids: dict[int, int] = {}  # ptr -> allocation id (its IPC handle)
        self.live = collections.Counter()  # device -> bytes allocated now
        self.peak = collections.Counter()  # device -> most bytes allocated at once
        self.allocations: list[tuple[int, int]] = []  # (device, bytes) of every malloc, in order
        self.registered: dict[int, tuple[int, bool]] = {}  # host ptr -> (bytes, read_only)
        self.registrations: list[tuple[int, int, bool]] = []  # (ptr, bytes, read_only) of every register
        self._lock = threading.Lock()
        self._next = 1

    # ---- the Driver seam

    def visible_uuids(self):
        return list(self.uuids)

    def current_device(self):
        return 0

    def mem_get_info(self, device):
        return self.total - self.live[device], self.total

    def malloc(self, device, nbytes):
        with self._lock:
            self.calls["malloc"] += 1
            if self.live[device] + nbytes > self.total:
                raise CudaError(f"cudaMalloc({nbytes}) failed: cudaErrorMemoryAllocation (out of memory)")
            buf = np.full(nbytes, 0xEE, np.uint8)  # garbage, as cudaMalloc gives
            ptr = buf.ctypes.data
            self.buffers[ptr] = (device, buf)
            self.ids[ptr], self._next = self._next, self._next + 1
            self.live[device] += nbytes
            self.peak[device] = max(self.peak[device], self.live[device])
            self.allocations.append((device, nbytes))
            return ptr

    def memset(self, device, ptr, value, nbytes):
        self.buffers[ptr][1][:nbytes] = value

    def free(self, device, ptr):
        with self._lock:
            self.calls["free"] += 1
            dev, buf = self.buffers.pop(ptr)  # KeyError on a double free
            self.ids.pop(ptr)
            self.live[dev] -= buf.nbytes

    def ipc_get_handle(self, device, ptr):
        return b"FAKECUDA" + struct.pack("<Q", self.ids[ptr]) + bytes(IPC_HANDLE_BYTES - 16)

    def ipc_open(self, device, handle):
        raise CudaError("cudaIpcOpenMemHandle failed: one process here; its own handles resolve without it")

    def ipc_close(self, device, ptr):
        raise CudaError("cudaIpcCloseMemHandle: nothing was opened")

    def synchronize(self, device):
        self.calls["synchronize"] += 1

    def tensor(self, ptr, nbytes, device, owner):
        return torch.from_numpy(np.asarray(_HostArray(ptr, nbytes, owner)))

    def host_register(self, device, ptr, nbytes, *, read_only):
        with self._lock:
            self.calls["host_register"] += 1
            if ptr in self.registered:  # as CUDA: cudaErrorHostMemoryAlreadyRegistered
                raise CudaError("cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered")
            self.registered[ptr] = (nbytes, read_only)
            self.registrations.append((ptr, nbytes, read_only))

    def host_unregister(self, device, ptr):
        with self._lock:
            self.calls["host_unregister"] += 1
            if self.registered.pop(ptr, None) is None:
                raise CudaError("cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered")

    # ---- for tests

    @property
    def device_bytes_now(self) -> int:
        return sum(self.live.values())
