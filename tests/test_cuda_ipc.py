"""CUDA-IPC arenas, GPU discovery and the staging ring.

Everything but the last section runs on a CPU-only machine: the arena logic runs against
``HostDriver``, a CUDA stand-in whose "device memory" is host memory and whose IPC handles are
64 bytes naming an allocation on a shared fake node. Two HostDrivers over one node play two
processes with different ``CUDA_VISIBLE_DEVICES``. The GPU section needs a real GPU and skips with
the reason ``cuda_unavailable_reason()`` gives, the same predicate the code uses.
"""

from __future__ import annotations

import collections
import ctypes
import multiprocessing as mp
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch

from transport.arena import Arena, ArenaKind
from transport.cuda_driver import (
    IPC_HANDLE_BYTES,
    CudaArrayInterface,
    CudaDriver,
    CudaError,
    cuda_available,
    cuda_unavailable_reason,
)
from transport.cuda_ipc import (
    ALLOC_GRANULARITY,
    CudaIpcArena,
    CudaIpcHandle,
    allocation_size,
    open_any_arena,
)
from transport.gpus import (
    GpuInfo,
    GpuList,
    GpuNotVisible,
    InsufficientGpuMemory,
    check_free_memory,
    cuda_index_for_uuid,
    index_for_uuid,
    local_gpus,
    normalize_uuid,
    parse_visible_devices,
    render_gpus,
)
from transport.layout import Layout
from transport.shm import ShmArena, segment_name
from transport.wire import ProtocolError

GIB = 1 << 30
UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in (0xA0, 0xB1, 0xC2, 0xD3)]
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# fakes


class _HostArray:
    """``__array_interface__`` twin of CudaArrayInterface: tensors made from it keep ``owner`` alive."""

    def __init__(self, ptr: int, nbytes: int, owner: object):
        self.owner = owner
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class FakeNode:
    """The node's "GPUs": allocations by id, shared by every HostDriver (process) on the node."""

    def __init__(self, uuids=UUIDS, free=80 * GIB, total=141 * GIB):
        self.uuids, self.free, self.total = list(uuids), free, total
        self.buffers: dict[int, tuple[str, np.ndarray]] = {}  # allocation id -> (gpu uuid, bytes)
        self.next_id = 1


class HostDriver:
    """The Driver seam over host memory. ``visible`` is this "process's" CUDA_VISIBLE_DEVICES order."""

    def __init__(self, node: FakeNode, visible: list[str] | None = None, current: int = 0):
        self.node, self.visible, self.current = node, list(visible or node.uuids), current
        self.calls: collections.Counter[str] = collections.Counter()
        self.live: dict[int, int] = {}  # ptr -> allocation id, for what this process allocated or mapped

    def visible_uuids(self):
        return list(self.visible)

    def current_device(self):
        return self.current

    def mem_get_info(self, device):
        return self.node.free, self.node.total

    def malloc(self, device, nbytes):
        self.calls["malloc"] += 1
        buf = np.full(nbytes, 0xEE, np.uint8)  # garbage, as cudaMalloc gives: the arena must zero it
        aid, self.node.next_id = self.node.next_id, self.node.next_id + 1
        self.node.buffers[aid] = (self.visible[device], buf)
        self.live[buf.ctypes.data] = aid
        return buf.ctypes.data

    def memset(self, device, ptr, value, nbytes):
        _, buf = self.node.buffers[self.live[ptr]]
        buf[:nbytes] = value

    def free(self, device, ptr):
        self.calls["free"] += 1
        aid = self.live.pop(ptr)  # KeyError on a double free
        del self.node.buffers[aid]

    def ipc_get_handle(self, device, ptr):
        return b"FAKEIPC\0" + struct.pack("<Q", self.live[ptr]) + bytes(IPC_HANDLE_BYTES - 16)

    def ipc_open(self, device, handle):
        self.calls["ipc_open"] += 1
        aid = struct.unpack("<Q", handle[8:16])[0]
        if aid not in self.node.buffers:
            raise CudaError("cudaIpcOpenMemHandle failed: cudaErrorInvalidResourceHandle")
        ptr = self.node.buffers[aid][1].ctypes.data
        self.live[ptr] = aid
        return ptr

    def ipc_close(self, device, ptr):
        self.calls["ipc_close"] += 1
        self.live.pop(ptr)

    def synchronize(self, device):
        self.calls["synchronize"] += 1

    def tensor(self, ptr, nbytes, device, owner):
        return torch.from_numpy(np.asarray(_HostArray(ptr, nbytes, owner)))


class FakeNvml:
    """Enough of pynvml for local_gpus; ``fail`` makes nvmlInit raise like a machine without a driver."""

    def __init__(self, gpus: list[GpuInfo], fail: str | None = None):
        self.gpus, self.fail, self.shutdowns = gpus, fail, 0

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError(self.fail)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h.uuid

    def nvmlDeviceGetName(self, h):
        return h.name.encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h.memory_total, used=h.memory_used, free=h.memory_free)


def gpu(i: int, free: int = 100 * GIB, total: int = 141 * GIB) -> GpuInfo:
    return GpuInfo(i, UUIDS[i], "NVIDIA H200", total, total - free, free)


LAYOUT = Layout.build(
    [("w", torch.bfloat16, (3, 5)), ("q", torch.float8_e4m3fn, (7,)), ("s", torch.float32, ())]
)


@pytest.fixture
def node():
    return FakeNode()


@pytest.fixture
def nvml_off():
    return FakeNvml([], fail="NVML Shared Library Not Found")


# --------------------------------------------------------------------------------------------------
# the handle on the wire


def _wire(**over):
    h = CudaIpcHandle("refitd-gen0", 4096, LAYOUT.to_wire(), bytes(range(1, 65)), UUIDS[1], 512).to_wire()
    h.update(over)
    return h


def test_handle_round_trips_through_msgpack_as_plain_bytes():
    """The handle is plain msgpack data: the 64 bytes come back byte for byte, no pickle involved."""
    wire = _wire()
    back = msgpack.unpackb(msgpack.packb(wire), raw=False)
    assert isinstance(back["ipc_handle"], bytes) and back["ipc_handle"] == bytes(range(1, 65))
    h = CudaIpcHandle.from_wire(back)
    assert h.to_wire() == wire and h.offset == 512 and h.gpu_uuid == UUIDS[1]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ipc_handle": bytes(range(1, 64))}, "must be 64 bytes (cudaIpcMemHandle_t), got 63"),
        ({"ipc_handle": bytes(range(1, 66))}, "got 65"),
        ({"ipc_handle": "ab" * 32}, "'ipc_handle' must be bytes, got str"),
        ({"ipc_handle": bytes(64)}, "all zeros"),
        ({"size": -1}, "'size' must be a non-negative integer, got -1"),
        ({"size": True}, "'size' must be a non-negative integer, got True"),
        ({"offset": 100}, "'offset' 100 is not a multiple of 256"),
        ({"offset": 1.5}, "'offset' must be a non-negative integer"),
        ({"kind": "shm"}, "kind is 'shm', expected 'cuda_ipc'"),
        ({"gpu_uuid": "0"}, "'gpu_uuid' must be a GPU UUID"),
        ({"gpu_uuid": "MIG-1234-5678"}, "'gpu_uuid' must be a GPU UUID"),
        ({"name": ""}, "'name' must be a non-empty string"),
        ({"size": 16}, "the layout needs 516 bytes but the arena holds 16"),
        ({"layout": [["w", "no-such-dtype", [1], 0, 2]]}, "'layout' is malformed"),
    ],
)
def test_handle_validation_names_the_field(change, message):
    with pytest.raises(ProtocolError, match=re.escape(message)):
        CudaIpcHandle.from_wire(_wire(**change))


def test_handle_missing_field_and_not_a_map():
    wire = _wire()
    del wire["gpu_uuid"]
    with pytest.raises(ProtocolError, match="'gpu_uuid' is missing"):
        CudaIpcHandle.from_wire(wire)
    with pytest.raises(ProtocolError, match="expected a map, got list"):
        CudaIpcHandle.from_wire([1, 2])


def test_allocation_rounds_up_to_whole_granules():
    assert [allocation_size(n) for n in (0, 1, ALLOC_GRANULARITY, ALLOC_GRANULARITY + 1)] == [
        ALLOC_GRANULARITY,
        ALLOC_GRANULARITY,
        ALLOC_GRANULARITY,
        2 * ALLOC_GRANULARITY,
    ]
    with pytest.raises(ValueError, match="negative"):
        allocation_size(-1)


def test_cuda_array_interface_is_version_3_uint8_and_never_read_only():
    """torch refuses the read-only flag (``TypeError: the read only flag is not supported``)."""
    cai = CudaArrayInterface(0x7F00_0000_0000, 4096, owner="x").__cuda_array_interface__
    assert cai == {
        "shape": (4096,),
        "typestr": "|u1",
        "data": (0x7F00_0000_0000, False),
        "version": 3,
        "strides": None,
    }
    ro = SimpleNamespace(__cuda_array_interface__={**cai, "data": (cai["data"][0], True)})
    with pytest.raises(TypeError, match="read only"):
        torch.as_tensor(ro)


def test_ipc_handle_bytes_survive_the_cuda_bindings_struct():
    """The real driver moves the 64 bytes in and out of cudaIpcMemHandle_t by address (no driver needed)."""
    import ctypes

    rt = pytest.importorskip("cuda.bindings.runtime")
    h = rt.cudaIpcMemHandle_t()
    data = bytes(range(64))
    ctypes.memmove(h.getPtr(), data, IPC_HANDLE_BYTES)
    assert ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES) == data


def test_cuda_errors_carry_the_runtime_name():
    class Rt:
        @staticmethod
        def cudaGetErrorName(err):
            return 0, b"cudaErrorMemoryAllocation"

        @staticmethod
        def cudaGetErrorString(err):
            return 0, b"out of memory"

    d = CudaDriver(Rt(), None)
    assert d._check((0, 7), "x") == 7 and d._check((0, 1, 2), "x") == (1, 2)
    with pytest.raises(
        CudaError, match=r"cudaMalloc\(4096\) failed: cudaErrorMemoryAllocation \(out of memory\)"
    ):
        d._check((2, None), "cudaMalloc(4096)")


# --------------------------------------------------------------------------------------------------
# GPUs by UUID


def test_uuids_normalize_from_nvml_torch_and_raw_bytes():
    raw = bytes.fromhex("6f2a1c3e4b5d46e7a8b9c0d1e2f30415")
    want = "GPU-6f2a1c3e-4b5d-46e7-a8b9-c0d1e2f30415"
    assert normalize_uuid(raw) == want
    assert normalize_uuid("6F2A1C3E-4B5D-46E7-A8B9-C0D1E2F30415") == want  # torch's bare form
    assert normalize_uuid(b"GPU-6f2a1c3e-4b5d-46e7-a8b9-c0d1e2f30415") == want  # old NVML bytes
    assert normalize_uuid("MIG-abc").startswith("MIG-")


@pytest.mark.parametrize(
    "cvd, expect",
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        ("3", [3]),
        ("", []),
        ("0,-1,2", [0]),  # a negative entry ends the list
        ("1,9,2", [1]),  # so does one past the last GPU
        ("1gpu,2", [1, 2]),  # strtoul semantics, as CUDA and torch
        ("1,1", []),  # a repeated device empties it
        (f"{UUIDS[3][:12]},{UUIDS[0]}", [3, 0]),  # unique UUID prefixes
        ("GPU-000000,1", []),  # "GPU-000000" matches all four: ambiguous, the list ends there
    ],
)
def test_visible_devices_parse_like_cuda(cvd, expect):
    gpus = [gpu(i) for i in (3, 1, 0, 2)]  # NVML order is by index, whatever order they come in
    assert parse_visible_devices(cvd, gpus) == [UUIDS[i] for i in expect]


def test_index_for_uuid_follows_each_process_visible_order():
    """The daemon sees all four GPUs; an engine with CUDA_VISIBLE_DEVICES=2,0 calls GPU 0 'cuda:1'."""
    engine_view = parse_visible_devices("2,0", [gpu(i) for i in range(4)])
    assert index_for_uuid(UUIDS[0], engine_view) == 1
    assert index_for_uuid(UUIDS[2].upper().replace("GPU-", ""), engine_view) == 0
    assert index_for_uuid(UUIDS[0], UUIDS) == 0


def test_invisible_gpu_error_says_what_the_process_sees():
    with pytest.raises(GpuNotVisible) as err:
        index_for_uuid(UUIDS[3], [UUIDS[2], UUIDS[0]], env={"CUDA_VISIBLE_DEVICES": "2,0"})
    msg = str(err.value)
    assert f"the arena lives on {UUIDS[3]}, which this process cannot see" in msg
    assert f"CUDA_VISIBLE_DEVICES='2,0' shows cuda:0={UUIDS[2]}, cuda:1={UUIDS[0]}" in msg
    with pytest.raises(GpuNotVisible, match=r"CUDA_VISIBLE_DEVICES=\(unset\) shows no GPU at all"):
        index_for_uuid(UUIDS[3], [], env={})


def test_cuda_index_for_uuid_asks_the_driver(node):
    driver = HostDriver(node, visible=[UUIDS[3], UUIDS[1]])
    assert cuda_index_for_uuid(UUIDS[1], driver=driver) == 1


def test_local_gpus_from_nvml_and_without_it(nvml_off):
    fake = FakeNvml([gpu(0), gpu(1, free=3 * GIB)])
    gpus = local_gpus(fake)
    assert gpus == [gpu(0), gpu(1, free=3 * GIB)] and gpus.reason is None and fake.shutdowns == 1
    none = local_gpus(nvml_off)
    assert (
        none == []
        and "NVML is not available" in none.reason
        and "NVML Shared Library Not Found" in none.reason
    )
    real = local_gpus()  # this machine: either its GPUs or the reason there are none
    assert isinstance(real, GpuList) and (len(real) > 0 or real.reason)


def test_free_memory_error_says_asked_free_and_total():
    check_free_memory("arena 'g'", 10 * GIB, free=10 * GIB, total=141 * GIB, gpu="GPU 0")
    with pytest.raises(InsufficientGpuMemory) as err:
        check_free_memory("arena 'gen0'", 12 * GIB, free=3 * GIB, total=141 * GIB, gpu="GPU 1 (NVIDIA H200)")
    assert str(err.value) == (
        "arena 'gen0' needs 12.00 GiB (12884901888 B) on GPU 1 (NVIDIA H200), but only 3.00 GiB of "
        "141.00 GiB is free (138.00 GiB in use); free memory on that GPU or size the arenas smaller"
    )
    with pytest.raises(InsufficientGpuMemory, match=r"and keep 2\.00 GiB free"):
        check_free_memory("a", 9 * GIB, free=10 * GIB, total=141 * GIB, gpu="GPU 0", reserve=2 * GIB)


def test_render_gpus_lists_arenas_under_their_gpu(node, nvml_off):
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, gpu=UUIDS[1], driver=HostDriver(node), nvml=nvml_off)
    shm = ShmArena.create(segment_name("refitd-test", "staging"), LAYOUT)
    try:
        text = render_gpus(
            [gpu(0).to_wire(), gpu(1, free=40 * GIB)],
            [arena, shm, {"name": "refitd-odd", "bytes": 4096, "gpu_uuid": UUIDS[3]}],
        )
    finally:
        arena.close()
        shm.close()
        shm.unlink()
    assert text.splitlines() == [
        f"GPU 0  NVIDIA H200  {UUIDS[0]}  used 41.00 GiB / 141.00 GiB, free 100.00 GiB",
        f"GPU 1  NVIDIA H200  {UUIDS[1]}  used 101.00 GiB / 141.00 GiB, free 40.00 GiB",
        f"    arena refitd-gen0  {LAYOUT.size} B",
        "host memory (POSIX shm)",
        f"    arena {shm.name}  {LAYOUT.size} B",
        f"{UUIDS[3]} (not listed by NVML on this node)",
        "    arena refitd-odd  4096 B",
    ]
    assert render_gpus([], reason="NVML is not available") == "GPUs: none (NVML is not available)"


# --------------------------------------------------------------------------------------------------
# the arena over the host fake


def test_arena_views_round_trip_to_a_second_process(node, nvml_off):
    """The daemon fills an arena on GPU 1; an engine that calls that GPU cuda:0 opens it and reads it."""
    daemon = HostDriver(node)
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, gpu=UUIDS[1], driver=daemon, nvml=nvml_off)
    assert arena.kind is ArenaKind.CUDA_IPC and arena.size == LAYOUT.size and arena.device == 1
    assert all(t.reshape(-1).view(torch.uint8).sum() == 0 for t in arena.tensors().values())  # zeroed
    arena.tensor("w").copy_(torch.arange(15, dtype=torch.bfloat16).view(3, 5))
    arena.tensor("s").fill_(0.25)
    assert arena.tensor("w").dtype == torch.bfloat16 and arena.tensor("s").shape == ()

    handle = msgpack.unpackb(msgpack.packb(arena.handle()), raw=False)
    engine = HostDriver(node, visible=[UUIDS[1], UUIDS[0]])
    peer = open_any_arena(handle, writable=False, driver=engine)
    assert isinstance(peer, CudaIpcArena) and peer.device == 0 and peer.gpu_uuid == UUIDS[1]
    assert torch.equal(peer.tensor("w"), torch.arange(15, dtype=torch.bfloat16).view(3, 5))
    assert peer.tensor("s").item() == 0.25 and not peer.writable
    assert engine.calls["ipc_open"] == 1

    peer.close()
    peer.close()  # idempotent
    assert engine.calls["ipc_close"] == 1 and peer.released
    arena.close()
    arena.close()
    assert daemon.calls["free"] == 1 and arena.released and not node.buffers


def test_the_arena_must_be_visible_unless_a_device_is_named(node, nvml_off):
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, gpu=UUIDS[3], driver=HostDriver(node), nvml=nvml_off)
    engine = HostDriver(node, visible=[UUIDS[0]])
    with pytest.raises(GpuNotVisible, match=f"the arena lives on {UUIDS[3]}, which this process cannot see"):
        CudaIpcArena.open(arena.handle(), writable=False, driver=engine)
    peer = CudaIpcArena.open(arena.handle(), writable=False, driver=engine, device=0)  # peer memory
    assert peer.device == 0 and peer.gpu_uuid == UUIDS[3]
    peer.close()
    arena.close()


def test_memory_outlives_close_while_a_view_is_alive(node, nvml_off):
    """Like shm: closing while a view is alive defers the free, so the view never reads freed memory."""
    daemon = HostDriver(node)
    arena = CudaIpcArena.create("refitd-staging", LAYOUT, driver=daemon, nvml=nvml_off)
    view = arena.tensor("w")
    view.fill_(2.0)
    arena.close()
    assert daemon.calls["free"] == 0 and not arena.released
    assert view.sum().item() == 30.0
    del view
    assert daemon.calls["free"] == 1 and daemon.calls["synchronize"] == 1 and arena.released
    with pytest.raises(ValueError, match="is closed"):
        arena.tensors()


def test_each_handle_is_mapped_once_per_process(node, nvml_off):
    """Two arenas from one handle (a reader re-opening after a relayout) share one IPC mapping."""
    arena = CudaIpcArena.create("refitd-gen1", LAYOUT, driver=HostDriver(node), nvml=nvml_off)
    engine = HostDriver(node)
    a = CudaIpcArena.open(arena.handle(), writable=False, driver=engine)
    b = CudaIpcArena.open(arena.handle(), writable=False, driver=engine)
    assert engine.calls["ipc_open"] == 1
    a.close()
    assert engine.calls["ipc_close"] == 0
    b.close()
    assert engine.calls["ipc_close"] == 1
    arena.close()


def test_arenas_sharing_one_allocation_share_one_mapping(node, nvml_off):
    """Two arenas carved from one cudaMalloc travel as one IPC handle at two offsets."""
    from transport.cuda_ipc import DeviceMemory

    daemon = HostDriver(node)
    mem = DeviceMemory.allocate(daemon, 0, UUIDS[0], ALLOC_GRANULARITY)
    gen0 = CudaIpcArena(mem, 0, 4096, LAYOUT, "refitd-gen0", writable=True)
    gen1 = CudaIpcArena(mem, 8192, 4096, LAYOUT, "refitd-gen1", writable=True)
    gen1.tensor("s").fill_(5.0)
    engine = HostDriver(node)
    a = CudaIpcArena.open(gen0.handle(), writable=False, driver=engine)
    b = CudaIpcArena.open(gen1.handle(), writable=False, driver=engine)
    assert gen1.handle()["offset"] == 8192 and engine.calls["ipc_open"] == 1
    assert b.tensor("s").item() == 5.0 and a.tensor("s").item() == 0.0
    with pytest.raises(ValueError, match="does not fit its"):
        CudaIpcArena(mem, 0, 2 * ALLOC_GRANULARITY, Layout([]), "refitd-big", writable=True)
    for arena in (a, b, gen0, gen1):
        arena.close()
    del mem
    assert engine.calls["ipc_close"] == 1 and daemon.calls["free"] == 1


def test_opening_a_handle_this_process_exported_reuses_the_allocation(node, nvml_off):
    """CUDA cannot open its own IPC handles; an in-process reader (tests, demos) gets the allocation."""
    daemon = HostDriver(node)
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, driver=daemon, nvml=nvml_off)
    arena.tensor("q").view(torch.uint8).fill_(7)
    same = CudaIpcArena.open(arena.handle(), writable=True, driver=daemon)
    assert daemon.calls["ipc_open"] == 0 and same.tensor("q").view(torch.uint8).tolist() == [7] * 7
    arena.close()
    assert daemon.calls["free"] == 0  # the in-process reader still uses it
    same.close()
    assert daemon.calls["free"] == 1


def test_relayout_and_capacity(node, nvml_off):
    arena = CudaIpcArena.create(
        "refitd-staging", Layout([]), size=4096, driver=HostDriver(node), nvml=nvml_off
    )
    assert arena.tensors() == {} and arena.handle()["layout"] == []
    arena.relayout(LAYOUT)
    assert arena.tensor("w").shape == (3, 5) and arena.handle()["layout"] == LAYOUT.to_wire()
    big = Layout.build([("x", torch.float32, (2048,))])
    with pytest.raises(ValueError, match=r"holds 4096 bytes but the plan needs 8192; raise the configured"):
        arena.relayout(big)
    with pytest.raises(ValueError, match="cannot hold a layout of 8192 bytes"):
        CudaIpcArena.create("refitd-x", big, size=4096, driver=HostDriver(node), nvml=nvml_off)
    arena.close()


def test_allocation_refused_before_cudamalloc_when_the_gpu_is_full(node):
    """NVML says GPU 1 has 1 GiB free: a 2 GiB arena is refused with the figures, nothing allocated."""
    daemon = HostDriver(node)
    nvml = FakeNvml([gpu(0), gpu(1, free=1 * GIB)])
    with pytest.raises(InsufficientGpuMemory) as err:
        CudaIpcArena.create("refitd-gen0", Layout([]), size=2 * GIB, gpu=UUIDS[1], driver=daemon, nvml=nvml)
    assert str(err.value).startswith(
        f"arena 'refitd-gen0' needs 2.00 GiB (2147483648 B) on GPU 1 (NVIDIA H200, {UUIDS[1]}), "
        "but only 1.00 GiB of 141.00 GiB is free"
    )
    assert daemon.calls["malloc"] == 0
    node.free = 1 << 20  # without NVML, cudaMemGetInfo decides
    with pytest.raises(InsufficientGpuMemory, match=r"on cuda:0 \(GPU-000000a0"):
        CudaIpcArena.create(
            "refitd-gen0", Layout([]), size=4 << 20, driver=daemon, nvml=FakeNvml([], fail="x")
        )


def test_gpu_chosen_by_index_uuid_or_current_device(node, nvml_off):
    driver = HostDriver(node, visible=[UUIDS[2], UUIDS[0]], current=1)
    for choice, device, uuid in ((None, 1, UUIDS[0]), (0, 0, UUIDS[2]), (UUIDS[0], 1, UUIDS[0])):
        arena = CudaIpcArena.create("refitd-x", LAYOUT, gpu=choice, driver=driver, nvml=nvml_off)
        assert (arena.device, arena.gpu_uuid, arena.handle()["gpu_uuid"]) == (device, uuid, uuid)
        arena.close()
    with pytest.raises(ValueError, match=r"cuda:5 does not exist: this process sees 2 GPU\(s\)"):
        CudaIpcArena.create("refitd-x", LAYOUT, gpu=5, driver=driver, nvml=nvml_off)


def test_staging_of_a_failed_step_is_retired_on_gpu_arenas_and_late_writes_land_nowhere(node, monkeypatch):
    """Issue 21 on CUDA arenas: a rank the daemon stopped trusting keeps the staging arena mapped
    writable (an IPC mapping). Once its step failed, the daemon replaces the arena with a fresh
    allocation before the next step: the next READY names another arena (name and IPC handle), a
    write through the old mapping lands in memory no step reads, and the old allocation stays
    allocated (issue 34: a cudaFree under an importer's mapping is undefined behaviour) until the
    arenas close."""
    from sidecar.daemon.memory.generations import Arenas
    from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
    from transport import cuda_ipc

    daemon = HostDriver(node)
    monkeypatch.setattr(cuda_ipc, "default_driver", lambda: daemon)
    specs = [TensorSpec(f"t.{i}.weight", torch.bfloat16, (8, 4)) for i in range(3)]
    plan = RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="bf16"))
    arenas = Arenas.for_plan("refitd-test", plan, kind=ArenaKind.CUDA_IPC, gpu=0)
    try:
        old = arenas.staging
        handed = old.handle()  # what READY gave the ranks of the step that fails
        frozen = CudaIpcArena.open(handed, writable=True, driver=HostDriver(node))  # the rank's mapping
        daemon_view = old.tensor("t.1.weight")  # a view the daemon still held when the step failed

        arenas.staging_tainted = True  # what fail_step sets when ranks were handed staging
        node.free = 0  # the GPU is full: no fresh arena now, and no step may start on the old one
        with pytest.raises(InsufficientGpuMemory):
            arenas.retire_staging()
        assert arenas.staging_tainted and arenas.retired_staging == 0
        node.free = 80 * GIB  # the next BEGIN tries again
        arenas.retire_staging()
        fresh = arenas.staging
        assert not arenas.staging_tainted and arenas.retired_staging == 1
        assert fresh is not old and fresh.kind is ArenaKind.CUDA_IPC
        assert fresh.layout is old.layout and fresh.size == old.size
        new_handle = fresh.handle()
        assert new_handle["name"] != handed["name"] and new_handle["ipc_handle"] != handed["ipc_handle"]
        assert daemon.calls["malloc"] == 4  # staging, two generations, the new staging

        frozen.tensor("t.1.weight").fill_(7.0)  # the rank resumes: its late copy
        assert torch.equal(daemon_view, torch.full((8, 4), 7.0, dtype=torch.bfloat16))  # the old memory
        for name in ("t.0.weight", "t.1.weight", "t.2.weight"):
            assert not fresh.tensor(name).view(torch.uint8).any(), f"{name}: a late write reached staging"
        frees = daemon.calls["free"]
        del daemon_view
        assert daemon.calls["free"] == frees and not old.released  # kept: the rank may still map it
        assert arenas.quarantine == {0: old}
        frozen.close()
    finally:
        arenas.close()


def test_a_freed_arena_cannot_be_opened(node, nvml_off):
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, driver=HostDriver(node), nvml=nvml_off)
    handle = arena.handle()
    arena.close()
    with pytest.raises(CudaError, match="InvalidResourceHandle"):
        CudaIpcArena.open(handle, writable=False, driver=HostDriver(node))


def test_open_any_arena_routes_by_kind():
    shm = ShmArena.create(segment_name("refitd-test", "route"), LAYOUT)
    try:
        peer = open_any_arena(shm.handle(), writable=False)
        assert isinstance(peer, ShmArena) and peer.layout.to_wire() == LAYOUT.to_wire()
        peer.close()
    finally:
        shm.close()
        shm.unlink()
    with pytest.raises(ValueError, match="arena kind 'nixl' is unknown; this build opens 'shm', 'cuda_ipc'"):
        open_any_arena({"kind": "nixl"}, writable=False)
    if not cuda_available():
        with pytest.raises(CudaError, match=cuda_unavailable_reason().split(" (")[0]):
            open_any_arena(_wire(), writable=False)


def test_import_works_without_cuda_python():
    """``import transport.cuda_ipc`` and the capability predicate work where cuda-python is absent."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "cuda" or name.startswith("cuda."):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import transport.cuda_ipc
        import transport.cuda_driver as c
        assert not c.cuda_available()
        print(c.cuda_unavailable_reason())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cuda-python is not installed" in out.stdout


class FakeRuntime:
    """cuda.bindings' runtime and driver call shapes (tuples led by an error code) over host memory.

    Lets the real CudaDriver wrapper run here: error checks, device switching, the handle struct.
    """

    cudaIpcMemLazyEnablePeerAccess = 1

    class cudaIpcMemHandle_t:
        def __init__(self):
            self._raw = ctypes.create_string_buffer(IPC_HANDLE_BYTES)

        def getPtr(self):
            return ctypes.addressof(self._raw)

    def __init__(self, uuids, malloc_limit=1 << 30, *, context: bool = True):
        """``context``: the thread starts with device 0's primary context current (a process that
        used CUDA already); False: no context at all, as in a fresh thread."""
        self.uuids, self.malloc_limit = uuids, malloc_limit
        self.tls_device, self.log = 0, []  # the runtime's per-thread device (cudaSetDevice)
        self.ctx = ("primary", 0) if context else None  # the driver's current context
        self.buffers: dict[int, np.ndarray] = {}

    @property
    def device(self) -> int:
        """The device runtime calls act on: the current context's, else the runtime's own."""
        return self.ctx[1] if self.ctx is not None else self.tls_device

    # runtime
    def cudaGetDeviceCount(self):
        return (0, len(self.uuids))

    def cudaGetDeviceProperties(self, i):
        raw = bytes.fromhex(self.uuids[i][4:].replace("-", ""))
        return (0, SimpleNamespace(uuid=SimpleNamespace(bytes=raw)))

    def cudaGetDevice(self):
        return (0, self.device)

    def cudaSetDevice(self, d):
        self.tls_device, self.ctx = d, ("primary", d)
        return (0,)

    def cudaDriverGetVersion(self):
        return (0, 13000)

    def cudaMemGetInfo(self):
        return (0, 50 * GIB, 141 * GIB)

    def cudaMalloc(self, n):
        if n > self.malloc_limit:
            return (2, None)
        buf = np.zeros(n, np.uint8)
        self.buffers[buf.ctypes.data] = buf
        self.log.append(("malloc", self.device, n))
        return (0, buf.ctypes.data)

    def cudaMemset(self, ptr, value, n):
        self.buffers[ptr][:n] = value
        return (0,)

    def cudaDeviceSynchronize(self):
        return (0,)

    def cudaFree(self, ptr):
        self.log.append(("free", self.device))
        del self.buffers[ptr]
        return (0,)

    def cudaIpcGetMemHandle(self, ptr):
        h = self.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), b"RT" + struct.pack("<Q", ptr) + bytes(54), IPC_HANDLE_BYTES)
        return (0, h)

    def cudaIpcOpenMemHandle(self, h, flags):
        ptr = struct.unpack("<Q", ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)[2:10])[0]
        self.log.append(("open", self.device, flags))
        return (0, ptr) if ptr in self.buffers else (400, None)

    def cudaIpcCloseMemHandle(self, ptr):
        self.log.append(("close", self.device))
        return (0,)

    def cudaGetErrorName(self, err):
        return (0, {2: b"cudaErrorMemoryAllocation", 400: b"cudaErrorInvalidResourceHandle"}[int(err)])

    def cudaGetErrorString(self, err):
        return (0, b"described")

    def cudaHostRegister(self, ptr, n, flags):
        self.log.append(("host_register", self.device, n, flags))
        return (0,) if n else (1, None)

    def cudaHostUnregister(self, ptr):
        self.log.append(("host_unregister", self.device))
        return (0,)

    # driver
    def cuInit(self, flags):
        return (0,)

    def cuDeviceGet(self, ordinal):
        return (0, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):
        self.log.append(("retain", dev))
        return (0, ("primary", dev))

    def cuDevicePrimaryCtxGetState(self, dev):  # (flags, active): retained here, or current from the start
        return (0, 0, int(("retain", dev) in self.log or self.ctx == ("primary", dev)))

    def cuCtxGetCurrent(self):
        return (0, self.ctx)

    def cuCtxSetCurrent(self, ctx):
        self.ctx = ctx
        return (0,)


class HostCudaDriver(CudaDriver):
    def tensor(self, ptr, nbytes, device, owner):
        return torch.from_numpy(np.asarray(_HostArray(ptr, nbytes, owner)))


def test_the_real_driver_wrapper_over_a_fake_runtime(nvml_off):
    """CudaDriver switches to the arena's GPU for each call and restores the thread's context after."""
    rt = FakeRuntime(UUIDS[:3])
    daemon = HostCudaDriver(rt, rt)
    assert daemon.visible_uuids() == UUIDS[:3]
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, gpu=UUIDS[2], driver=daemon, nvml=nvml_off)
    assert rt.log == [("retain", 2), ("malloc", 2, ALLOC_GRANULARITY)] and rt.device == 0
    arena.tensor("w").fill_(1.5)
    handle = arena.handle()
    assert handle["ipc_handle"][:2] == b"RT" and len(handle["ipc_handle"]) == IPC_HANDLE_BYTES

    reader = HostCudaDriver(rt, rt)  # a second "process" on the same runtime
    peer = CudaIpcArena.open(handle, writable=False, driver=reader)
    assert rt.log[-1] == ("open", 2, 1) and peer.tensor("w")[2, 4].item() == 1.5
    assert daemon.active_devices() == [0, 2]  # device 0's context from the start, 2's made for the arena
    peer.close()
    arena.close()
    assert rt.log[-2:] == [("close", 2), ("free", 2)] and rt.device == 0


def test_the_real_driver_wrapper_translates_failures(nvml_off):
    rt = FakeRuntime(UUIDS[:1], malloc_limit=1 << 20)
    driver = HostCudaDriver(rt, rt)
    with pytest.raises(
        InsufficientGpuMemory, match=r"cudaMalloc of 4194304 B on cuda:0 .* cudaErrorMemoryAllocation"
    ):
        CudaIpcArena.create("refitd-gen0", Layout([]), size=3 << 20, driver=driver, nvml=nvml_off)
    stale = _wire(gpu_uuid=UUIDS[0], offset=0)
    with pytest.raises(CudaError, match=r"cudaErrorInvalidResourceHandle .* has exited or freed it"):
        CudaIpcArena.open(stale, writable=False, driver=driver)


def test_the_real_driver_wrapper_page_locks_host_memory_portable_and_read_only(tmp_path):
    """cudaHostRegister through CudaDriver: PORTABLE always (every context sees it pinned), READ_ONLY
    for a reader's read-only mapping, on the asked GPU with the thread's context restored; a
    HostPin unregisters once, and a failure is a CudaError naming the call."""
    from transport.cuda_ipc import HostPin, pin_shm_arena

    rt = FakeRuntime(UUIDS[:2])
    driver = HostCudaDriver(rt, rt)
    arena = ShmArena.create(segment_name("refitd-test", "pin"), Layout([]), size=1 << 16)
    try:
        pin = pin_shm_arena(arena, driver=driver, device=1, read_only=False)
        ro = HostPin(driver, 0, 4096, 64, read_only=True)
        assert [e for e in rt.log if e[0] == "host_register"] == [
            ("host_register", 1, 1 << 16, 0x01),
            ("host_register", 0, 64, 0x01 | 0x08),
        ]
        assert rt.device == 0
        pin.release()
        pin.release()
        assert pin.released and rt.log.count(("host_unregister", 1)) == 1
        ro.release()
        with pytest.raises(CudaError, match=r"cudaHostRegister\(0 B\) failed"):
            HostPin(driver, 0, 4096, 0, read_only=False)
    finally:
        arena.close()
        arena.unlink()


def test_a_thread_without_a_context_is_not_left_on_the_arenas_gpu(nvml_off):
    """A fresh thread (no CUDA context current, the runtime's device 0) creates an arena on GPU 2:
    the calls run in GPU 2's primary context, and afterwards the thread has no context again and
    its device is still 0 (cudaSetDevice(2) would have left it on 2 for torch and every later call)."""
    rt = FakeRuntime(UUIDS[:3], context=False)
    driver = HostCudaDriver(rt, rt)
    arena = CudaIpcArena.create("refitd-gen0", LAYOUT, gpu=UUIDS[2], driver=driver, nvml=nvml_off)
    assert ("malloc", 2, ALLOC_GRANULARITY) in rt.log
    assert rt.ctx is None and rt.cudaGetDevice() == (0, 0) and rt.tls_device == 0
    arena.close()
    assert rt.log[-1] == ("free", 2) and rt.ctx is None and rt.cudaGetDevice() == (0, 0)
    assert rt.log.count(("retain", 2)) == 1  # the primary context is retained once, then reused


def test_peer_mappings_are_labelled_with_the_gpu_that_mapped_them(monkeypatch):
    """torch labels a wrapped pointer with the GPU owning the memory; an arena mapped on cuda:1 as
    peer memory of cuda:0 is relabelled cuda:1 through DLPack, same address, same owner."""
    from transport import cuda_driver

    ptr = 0x7F0000000000
    made = []
    monkeypatch.setattr(
        torch,
        "as_tensor",
        lambda obj: SimpleNamespace(is_cuda=True, data_ptr=lambda: ptr, device=torch.device("cuda", 0)),
    )

    def relabel(p, nbytes, device, owner):
        made.append((p, nbytes, device, owner))
        return SimpleNamespace(device=torch.device("cuda", device), data_ptr=lambda: p)

    monkeypatch.setattr(cuda_driver, "dlpack_tensor", relabel)
    driver = CudaDriver(None, None)
    owner = object()
    assert driver.tensor(ptr, 4096, 0, owner).device == torch.device("cuda", 0) and not made
    assert driver.tensor(ptr, 4096, 1, owner).device == torch.device("cuda", 1)
    assert made == [(ptr, 4096, 1, owner)]


def test_dlpack_wrapping_keeps_the_owner_alive_while_any_view_lives():
    """The DLPack path wraps memory in place (host memory here), and the owner lives exactly as long
    as some view of it does."""
    import gc
    import weakref

    from transport import cuda_driver

    buf = np.arange(64, dtype=np.uint8)

    class Owner:
        pass

    owner = Owner()
    alive = weakref.ref(owner)
    t = cuda_driver.dlpack_tensor(buf.ctypes.data, 64, 0, owner, device_type=cuda_driver.DL_CPU)
    del owner
    assert t.data_ptr() == buf.ctypes.data and t.dtype == torch.uint8 and t.shape == (64,) and t[5] == 5
    view = t[8:16].view(torch.int64)
    del t
    gc.collect()
    assert alive() is not None and int(view[0]) == int(buf[8:16].view(np.int64)[0])
    del view
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize(
    "driver_version,bindings,expect",
    [
        (12040, 13, r"cuda-bindings 13.x needs a CUDA 13 driver.*CUDA 12.4.*refitd\[gpu-cu12\]"),
        (12080, 12, None),
        (13000, 12, None),  # a newer driver runs older bindings
        (13000, 13, None),
        (11080, 12, r"CUDA 11.8: refitd needs a driver for CUDA 12 or newer"),
        (12040, None, None),  # version unknown: try, and let the calls say
    ],
)
def test_bindings_major_is_checked_against_the_driver(driver_version, bindings, expect):
    from transport.cuda_driver import bindings_mismatch

    got = bindings_mismatch(driver_version, bindings)
    assert (got is None) if expect is None else re.search(expect, got), got


def test_a_mismatched_or_incomplete_install_is_refused_naming_the_extra():
    """cuda-bindings 13 on a CUDA 12 driver: every --arena cuda daemon would refuse with an opaque
    error; the probe says which extra to install instead. Without cuda-pathfinder it says that."""
    from transport.cuda_driver import _probe_with

    rt = FakeRuntime(UUIDS[:1])
    rt.cudaDriverGetVersion = lambda: (0, 12020)
    driver, reason = _probe_with(lambda: (rt, rt), 13)
    assert driver is None and "pip install 'refitd[gpu-cu12]'" in reason and "CUDA 12.2" in reason
    driver, reason = _probe_with(lambda: (rt, rt), 12)
    assert driver is not None and reason is None

    def no_pathfinder():
        raise ModuleNotFoundError("No module named 'cuda.pathfinder'")

    driver, reason = _probe_with(no_pathfinder, 13)
    assert driver is None and "cuda-pathfinder is missing" in reason and "refitd[gpu-cu13]" in reason


def test_release_waits_for_copies_on_the_arenas_gpu(monkeypatch):
    """An engine on cuda:0 copies out of an arena mapped on cuda:1: release synchronizes both GPUs
    before telling the daemon (the copies may run on either's stream), not only the current one."""
    from adapters.base import Generation, RefitReader

    synced = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    reader = RefitReader("ipc:///nonexistent/refitd-test.sock", name="engine")
    sent = []
    monkeypatch.setattr(reader, "_send", lambda kind, fields, **kw: sent.append((kind, synced[:])))
    try:
        reader.release(Generation(0, 7, {}, "refitd-gen0", on_gpu=True, device=1))
        assert synced == [0, 1] and sent and sent[0][1] == [0, 1]  # both before RELEASE went out
        synced.clear()
        reader.release(Generation(1, 8, {}, "refitd-gen1"))  # host memory: nothing to wait for
        assert synced == []
    finally:
        reader._closed = True
        reader._sock.close(linger=0)
        reader._ctx.term()


# --------------------------------------------------------------------------------------------------
# on a real GPU

needs_gpu = pytest.mark.skipif(not cuda_available(), reason=f"needs a CUDA GPU: {cuda_unavailable_reason()}")
GPU_LAYOUT = Layout.build([("w", torch.bfloat16, (1024, 4096)), ("s", torch.float32, (8, 32))])


def _child_read(handle, conn):
    """An engine worker: open read-only, copy out device to device, report what it read."""
    try:
        torch.cuda.init()
        peer = open_any_arena(handle, writable=False)
        out = torch.empty_like(peer.tensor("w"))
        out.copy_(peer.tensor("w"))
        torch.cuda.synchronize()
        conn.send({"sum": float(out.float().sum().item()), "device": str(peer.tensor("w").device)})
        del out
        peer.close()
    except BaseException as exc:
        conn.send({"error": repr(exc)})


def _child_write(handle, conn):
    """A trainer client on the local path: open writable and fill its shard."""
    try:
        peer = open_any_arena(handle, writable=True)
        peer.tensor("s").fill_(3.0)
        torch.cuda.synchronize()
        peer.close()
        conn.send({"ok": True})
    except BaseException as exc:
        conn.send({"error": repr(exc)})


def _run_child(target, handle):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(handle, child))
    p.start()
    assert parent.poll(120), "the child process did not answer within 120 s"
    reply = parent.recv()
    p.join(30)
    assert "error" not in reply, reply["error"]
    return reply


@needs_gpu
def test_gpu_arena_crosses_processes_and_copies_out():
    """The daemon fills a cudaMalloc arena; an engine process copies it out D2D; a client writes into it."""
    arena = CudaIpcArena.create(
        segment_name("refitd-test", "gpu"), GPU_LAYOUT, gpu=torch.cuda.current_device()
    )
    try:
        assert arena.tensor("w").is_cuda and arena.tensor("w").data_ptr() % 256 == 0
        arena.tensor("w").fill_(1.0)
        torch.cuda.synchronize()
        reply = _run_child(_child_read, arena.handle())
        assert reply["sum"] == 1024 * 4096
        _run_child(_child_write, arena.handle())
        assert torch.all(arena.tensor("s") == 3.0)
    finally:
        arena.close()
    assert arena.released


@needs_gpu
def test_gpu_uuids_agree_between_torch_nvml_and_cuda():
    from transport.cuda_driver import default_driver

    visible = default_driver().visible_uuids()
    assert [
        normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(len(visible))
    ] == visible
    nvml = {g.uuid for g in local_gpus()}
    assert not nvml or set(visible) <= nvml
    assert cuda_index_for_uuid(visible[-1]) == len(visible) - 1


@needs_gpu
def test_gpu_free_memory_check_refuses_an_impossible_arena():
    with pytest.raises(InsufficientGpuMemory, match="is free"):
        CudaIpcArena.create("refitd-huge", Layout([]), size=1 << 50)


def test_every_arena_kind_implements_the_whole_arena_protocol(node, nvml_off):
    """The daemon, clients, adapters and movers hold arenas of either kind through ``Arena`` only:
    each kind has every member, with its own ``tensors``/``view`` (not the base class's stubs), and
    a kind that names itself with the enum, whose value is what its handle says on the wire."""
    cuda = CudaIpcArena.create("refitd-gen0", LAYOUT, gpu=UUIDS[1], driver=HostDriver(node), nvml=nvml_off)
    shm = ShmArena.create(segment_name("refitd-test", "proto"), LAYOUT)
    try:
        for arena, kind in ((shm, ArenaKind.SHM), (cuda, ArenaKind.CUDA_IPC)):
            assert isinstance(arena, Arena), type(arena).__name__
            assert arena.kind is kind and arena.handle()["kind"] == kind.value
            for own in ("tensors", "view", "handle", "close", "unlink"):
                assert own in vars(type(arena)), f"{type(arena).__name__} does not implement {own}"
            assert set(arena.tensors()) == {s.name for s in LAYOUT}
    finally:
        cuda.close()
        shm.close()
        shm.unlink()
