"""The CUDA runtime seam: the few calls refitd makes, behind one ``Driver`` Protocol.

``CudaDriver`` wraps ``cuda.bindings`` (imported lazily, so ``import transport.cuda_driver`` works on any
machine); tests substitute a host-memory fake with the same shape. ``default_driver()`` probes once and
says why CUDA is unusable when it is (``cuda_unavailable_reason()``), and device memory is handed to torch
in place through ``__cuda_array_interface__`` or DLPack (``dlpack_tensor``). Both ``transport.cuda_ipc``
(the arenas) and ``transport.gpus`` (UUID to CUDA index) use it; it imports neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch loads when a tensor is made: ``transport.gpus`` (NVML only) imports this module
    import torch

log = logging.getLogger("refitd.cuda_ipc")

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY = 0x01, 0x08  # cudaHostRegister flags (driver_types.h)


def normalize_uuid(uuid: str | bytes) -> str:
    """``GPU-<hex uuid>`` in lower case, from NVML's ``GPU-…``, torch's bare ``…`` or 16 raw bytes."""
    if isinstance(uuid, bytes | bytearray) and len(uuid) == 16:
        h = bytes(uuid).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    text = uuid.decode() if isinstance(uuid, bytes | bytearray) else str(uuid)
    text = text.strip().lower()
    if text.startswith("mig-"):
        return "MIG-" + text[4:]
    if text.startswith("gpu-"):
        text = text[4:]
    if not text:
        raise ValueError("empty GPU UUID")
    return "GPU-" + text


class CudaError(RuntimeError):
    """A CUDA runtime call failed, or CUDA is not usable in this process."""


#: CUDA errors that poison the process's context: every later CUDA call fails with them too, and
#: only a new process recovers (cudaErrorIllegalAddress, ...: "the process must be terminated and
#: relaunched"). By the runtime's name and by the text torch and Triton print for them.
STICKY_CUDA_ERRORS = {
    "cudaErrorIllegalAddress": "an illegal memory access was encountered",
    "cudaErrorLaunchFailure": "unspecified launch failure",
    "cudaErrorHardwareStackError": "hardware stack error",
    "cudaErrorIllegalInstruction": "an illegal instruction was encountered",
    "cudaErrorMisalignedAddress": "misaligned address",
    "cudaErrorInvalidAddressSpace": "operation not supported on global/shared address space",
    "cudaErrorInvalidPc": "invalid program counter",
    "cudaErrorAssert": "device-side assert triggered",
    "cudaErrorLaunchTimeout": "the launch timed out and was terminated",
    "cudaErrorECCUncorrectable": "uncorrectable ECC error encountered",
}


def sticky_cuda_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is a sticky CUDA error: this process can make
    no CUDA call again. Raised by refitd's own calls (CudaError), torch (``torch.AcceleratorError``,
    a RuntimeError "CUDA error: ...") or Triton ("Triton Error [CUDA]: ...")."""
    seen = 0
    while exc is not None and seen < 8:
        try:
            text = str(exc) if isinstance(exc, RuntimeError) else ""
        except Exception:  # an exception that cannot even be printed is no CUDA error of ours
            text = ""
        cuda = "CUDA" in text or "cuda" in text
        if cuda and any(name in text or words in text for name, words in STICKY_CUDA_ERRORS.items()):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


# --------------------------------------------------------------------------------------------------
# the CUDA seam


class Driver(Protocol):
    """The few CUDA calls an arena makes; ``CudaDriver`` is the real one, tests pass a host fake."""

    def visible_uuids(self) -> list[str]: ...
    def current_device(self) -> int: ...
    def mem_get_info(self, device: int) -> tuple[int, int]: ...
    def malloc(self, device: int, nbytes: int) -> int: ...
    def memset(self, device: int, ptr: int, value: int, nbytes: int) -> None: ...
    def free(self, device: int, ptr: int) -> None: ...
    def ipc_get_handle(self, device: int, ptr: int) -> bytes: ...
    def ipc_open(self, device: int, handle: bytes) -> int: ...
    def ipc_close(self, device: int, ptr: int) -> None: ...
    def synchronize(self, device: int) -> None: ...
    def tensor(self, ptr: int, nbytes: int, device: int, owner: object) -> torch.Tensor: ...
    def host_register(self, device: int, ptr: int, nbytes: int, *, read_only: bool) -> None: ...
    def host_unregister(self, device: int, ptr: int) -> None: ...


class CudaArrayInterface:
    """``nbytes`` of device memory at ``ptr`` as a uint8 vector, for ``torch.as_tensor``.

    ``owner`` is kept alive by every tensor made from this object (torch holds the object until
    the storage dies). The read-only flag is always False: torch raises on True.
    """

    def __init__(self, ptr: int, nbytes: int, owner: object = None):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DLDeleter),
]

DL_CPU, DL_CUDA = 1, 2  # DLDeviceType
_DL_UINT = 1  # DLDataTypeCode
#: address of a DLManagedTensor handed to torch -> what it keeps alive (the struct, its shape, the owner)
_dlpack_alive: dict[int, tuple[Any, ...]] = {}


@_DLDeleter
def _dlpack_deleter(managed: Any) -> None:  # called by torch when the tensor's storage dies
    _dlpack_alive.pop(ctypes.addressof(managed.contents), None)


def dlpack_tensor(
    ptr: int, nbytes: int, device: int, owner: object, *, device_type: int = DL_CUDA
) -> torch.Tensor:
    """``nbytes`` at ``ptr`` as a uint8 tensor that torch labels ``cuda:<device>`` as told (DLPack
    names the device; ``__cuda_array_interface__`` lets torch ask the pointer, which names the GPU
    owning peer memory). ``owner`` lives as long as the tensor's storage. ``device_type`` DL_CPU
    wraps host memory (tests)."""
    shape = (ctypes.c_int64 * 2)(nbytes, 1)  # [shape, stride]
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        ctypes.c_void_p(ptr),
        _DLDevice(device_type, device),
        1,
        _DLDataType(_DL_UINT, 8, 1),
        ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
        ctypes.cast(ctypes.byref(shape, 8), ctypes.POINTER(ctypes.c_int64)),
        0,
    )
    managed.deleter = _dlpack_deleter
    from torch.utils.dlpack import from_dlpack

    _dlpack_alive[ctypes.addressof(managed)] = (managed, shape, owner)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = (
        ctypes.py_object,
        [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p],
    )
    try:
        return from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))
    except BaseException:
        _dlpack_alive.pop(ctypes.addressof(managed), None)
        raise


def _import_cudart() -> tuple[Any, Any]:
    """(runtime, driver) modules of cuda-python: ``cuda.bindings`` (>=12.6) or the older ``cuda``."""
    try:
        from cuda.bindings import driver as cu
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cuda as cu  # cuda-python < 12.6
        from cuda import cudart
    return cudart, cu


class CudaDriver:
    """The CUDA runtime through cuda-python; every call checks its error code.

    Calls for a device other than the current one make its primary context current and then restore
    the thread's previous CUDA context exactly (a bare ``cudaSetDevice`` back would create a
    context, and hundreds of MiB, on a GPU this process never used; none at all would leave the
    thread on the other device).
    """

    def __init__(self, cudart: Any, cu: Any):
        self.rt, self.cu = cudart, cu
        self._primaries: dict[int, Any] = {}

    def _check(self, result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise CudaError(f"{what} failed: {self._error_text(err)}")
        return values[0] if len(values) == 1 else tuple(values)

    def _error_text(self, err: Any) -> str:
        try:
            name = self.rt.cudaGetErrorName(err)[1].decode()
            text = self.rt.cudaGetErrorString(err)[1].decode()
            return f"{name} ({text})"
        except Exception:
            return f"CUDA error {int(err)}"

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """Run the block with ``device``'s primary context current, then make the thread's previous
        context current again, exactly: none if there was none. The runtime's own idea of the
        thread's device (``cudaSetDevice``) is never touched, so a thread with no context before
        the block is not left on ``device`` after it."""
        if self.current_device() == device:
            yield
            return
        ctx = self._check(self.cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._check(self.cu.cuCtxSetCurrent(self._primary(device)), f"cuCtxSetCurrent(cuda:{device})")
        try:
            yield
        finally:
            self._check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _primary(self, device: int) -> Any:
        """``device``'s primary context (the one the runtime and torch use), retained once and kept
        for the process's life, as the runtime keeps it."""
        primary = self._primaries.get(device)
        if primary is None:
            self._check(self.cu.cuInit(0), "cuInit")
            dev = self._check(self.cu.cuDeviceGet(device), f"cuDeviceGet({device})")
            primary = self._check(
                self.cu.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device})"
            )
            self._primaries[device] = primary
        return primary

    def device_count(self) -> int:
        return int(self._check(self.rt.cudaGetDeviceCount(), "cudaGetDeviceCount"))

    def visible_uuids(self) -> list[str]:
        out = []
        for i in range(self.device_count()):
            prop = self._check(self.rt.cudaGetDeviceProperties(i), f"cudaGetDeviceProperties({i})")
            out.append(normalize_uuid(bytes(prop.uuid.bytes)))
        return out

    def current_device(self) -> int:
        return int(self._check(self.rt.cudaGetDevice(), "cudaGetDevice"))

    def active_devices(self) -> list[int]:
        """The CUDA indices this process has a primary context on (torch's included), asked
        without making one (``cuDevicePrimaryCtxGetState``)."""
        self._check(self.cu.cuInit(0), "cuInit")
        out = []
        for i in range(self.device_count()):
            dev = self._check(self.cu.cuDeviceGet(i), f"cuDeviceGet({i})")
            _flags, active = self._check(
                self.cu.cuDevicePrimaryCtxGetState(dev), "cuDevicePrimaryCtxGetState"
            )
            if active:
                out.append(i)
        return out

    def mem_get_info(self, device: int) -> tuple[int, int]:
        with self.on(device):
            free, total = self._check(self.rt.cudaMemGetInfo(), "cudaMemGetInfo")
        return int(free), int(total)

    def malloc(self, device: int, nbytes: int) -> int:
        with self.on(device):
            return int(self._check(self.rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))

    def memset(self, device: int, ptr: int, value: int, nbytes: int) -> None:
        with self.on(device):
            self._check(self.rt.cudaMemset(ptr, value, nbytes), "cudaMemset")
            self._check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def free(self, device: int, ptr: int) -> None:
        with self.on(device):
            self._check(self.rt.cudaFree(ptr), "cudaFree")

    def ipc_get_handle(self, device: int, ptr: int) -> bytes:
        with self.on(device):
            h = self._check(self.rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        return ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)  # .reserved is gone in cuda-bindings 13

    def ipc_open(self, device: int, handle: bytes) -> int:
        h = self.rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
        with self.on(device):
            result = self.rt.cudaIpcOpenMemHandle(h, self.rt.cudaIpcMemLazyEnablePeerAccess)
            try:
                return int(self._check(result, "cudaIpcOpenMemHandle"))
            except CudaError as exc:
                raise CudaError(
                    f"{exc}: the daemon that exported this arena has exited or freed it (reconnect and "
                    "take a fresh handle), or the GPU cannot reach it (no peer access, different MIG "
                    "instance, or a container without --ipc=host)"
                ) from None

    def ipc_close(self, device: int, ptr: int) -> None:
        with self.on(device):
            self._check(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def synchronize(self, device: int) -> None:
        with self.on(device):
            self._check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def host_register(self, device: int, ptr: int, nbytes: int, *, read_only: bool) -> None:
        """Page-lock ``nbytes`` of host memory at ``ptr`` (``cudaHostRegister``, PORTABLE: every
        context of the process sees it pinned), so copies to and from the GPU are DMAs; a read-only
        mapping (a reader's view of a generation) needs the READ_ONLY flag (CUDA 11.1+)."""
        flags = int(getattr(self.rt, "cudaHostRegisterPortable", HOST_REGISTER_PORTABLE))
        if read_only:
            flags |= int(getattr(self.rt, "cudaHostRegisterReadOnly", HOST_REGISTER_READ_ONLY))
        with self.on(device):
            self._check(self.rt.cudaHostRegister(ptr, nbytes, flags), f"cudaHostRegister({nbytes} B)")

    def host_unregister(self, device: int, ptr: int) -> None:
        with self.on(device):
            self._check(self.rt.cudaHostUnregister(ptr), "cudaHostUnregister")

    def tensor(self, ptr: int, nbytes: int, device: int, owner: object) -> torch.Tensor:
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
        t = torch.as_tensor(CudaArrayInterface(ptr, nbytes, owner))  # no device=: it would copy
        if not t.is_cuda or t.data_ptr() != ptr:
            raise CudaError(f"torch copied the arena instead of wrapping it (got {t.device}); refusing")
        if t.device.index != device:
            # torch labels a pointer with the GPU that owns the memory (cudaPointerGetAttributes);
            # a peer mapping made on `device` belongs there: copies out of it must run on that
            # GPU's stream (the one release() synchronizes), not create a context on the owner
            t = dlpack_tensor(ptr, nbytes, device, owner)
            if t.device != torch.device("cuda", device) or t.data_ptr() != ptr:
                raise CudaError(
                    f"the arena mapped on cuda:{device} came back as {t.device} at {t.data_ptr():#x}; refusing"
                )
        return t


#: the extras that install cuda-bindings for each CUDA major (pyproject.toml)
BINDINGS_EXTRAS = {12: "gpu-cu12", 13: "gpu-cu13"}


def _bindings_major() -> int | None:
    """Major version of the installed cuda-bindings (or the older cuda-python), None if unknown."""
    from importlib import metadata

    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return int(metadata.version(dist).split(".")[0])
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


def bindings_mismatch(driver_version: int, bindings: int | None) -> str | None:
    """Why cuda-bindings ``bindings``.x cannot run on a driver reporting ``driver_version``
    (``cudaDriverGetVersion``: 12040 is CUDA 12.4), naming the extra to install; None if it can."""
    major, minor = driver_version // 1000, driver_version % 1000 // 10
    if bindings is None or bindings <= major:
        return None
    extra = BINDINGS_EXTRAS.get(major)
    fix = (
        f"pip install 'refitd[{extra}]' (cuda-bindings {major}.x) instead"
        if extra
        else f"refitd needs a driver for CUDA {min(BINDINGS_EXTRAS)} or newer"
    )
    return (
        f"cuda-bindings {bindings}.x needs a CUDA {bindings} driver, but this machine's driver "
        f"supports CUDA {major}.{minor}: {fix}"
    )


def _probe_with(imports: Any, bindings: int | None) -> tuple[CudaDriver | None, str | None]:
    try:
        cudart, cu = imports()
    except ImportError as exc:
        if "pathfinder" in str(exc):
            return None, (
                f"cuda-bindings is installed but cuda-pathfinder is missing ({exc}): pip install "
                "cuda-pathfinder, or install refitd with the extra for your driver "
                f"({' or '.join(f'refitd[{e}]' for e in BINDINGS_EXTRAS.values())})"
            )
        extras = " or ".join(f"'refitd[{e}]'" for e in BINDINGS_EXTRAS.values())
        return (
            None,
            f"cuda-python is not installed (pip install {extras}, by your driver's CUDA major): {exc}",
        )
    driver = CudaDriver(cudart, cu)
    version = None
    with contextlib.suppress(Exception):
        version = int(cudart.cudaDriverGetVersion()[1])
    if version == 0:
        return None, "no NVIDIA driver in this process (libcuda.so was not found)"
    if version is not None and (mismatch := bindings_mismatch(version, bindings)):
        return None, mismatch
    try:
        count = driver.device_count()
    except CudaError as exc:
        return None, f"CUDA is not usable here: {exc}"
    if count == 0:
        return None, "CUDA sees no GPU in this process (check CUDA_VISIBLE_DEVICES)"
    return driver, None


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[CudaDriver | None, str | None]:
    return _probe_with(_import_cudart, _bindings_major())


def active_devices(driver: Driver, device: int) -> list[int]:
    """Every GPU this process may have work in flight on (``device`` at least); a driver without
    ``active_devices`` (a test fake) answers ``[device]``."""
    ask = getattr(driver, "active_devices", None)
    try:
        others = ask() if ask is not None else []
    except Exception as exc:  # a driver that cannot tell: at least the memory's own device
        log.warning(
            "could not list this process's GPU contexts (%s): synchronizing cuda:%d only", exc, device
        )
        others = []
    return sorted({device, *others})


def default_driver(*, required: bool = True) -> CudaDriver | None:
    """The process's CudaDriver; None (or CudaError if ``required``) when CUDA is not usable."""
    driver, reason = _probe()
    if driver is None and required:
        raise CudaError(reason)
    return driver


def cuda_available() -> bool:
    """The capability predicate the code and the GPU tests' skipif share."""
    return _probe()[0] is not None


def cuda_unavailable_reason() -> str | None:
    return _probe()[1]
