"""The node's GPUs as the daemon sees them: NVML inventory, UUID -> CUDA index, free memory, status text.

A GPU is named by its UUID everywhere on the wire, never by an index: indices depend on each
process's ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER``), so ``cuda:0`` in the daemon and
``cuda:0`` in an engine worker can be different chips. Each process maps a UUID to its own index
with :func:`index_for_uuid` over the UUIDs it can see, in its own order.

Everything here but :func:`local_gpus` (NVML) and the caller-supplied ``visible`` lists is pure and
runs on a CPU-only machine; NVML is optional (``local_gpus`` says why it found nothing).

    >>> gpus = local_gpus()                       # [] with gpus.reason on a CPU-only machine
    >>> index_for_uuid("GPU-6f2a...", visible=["GPU-11...", "GPU-6f2a..."])   # doctest: +SKIP
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from transport.cuda_driver import (  # re-exported: callers use gpus.normalize_uuid
    default_driver,
    normalize_uuid,
)
from transport.process_env import cuda_visible_devices

GIB = 1 << 30
HOST = "host"  # the placement of arenas in host memory (POSIX shm) in status output


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU as NVML reports it (``index`` is NVML's, i.e. PCI bus order)."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GpuInfo:
        return cls(**{k: d[k] for k in cls.__slots__})


class GpuList(list):
    """A ``list[GpuInfo]`` that also says why it is empty (``reason``) when NVML found nothing."""

    def __init__(self, gpus: Iterable[GpuInfo] = (), reason: str | None = None):
        super().__init__(gpus)
        self.reason = reason


class GpuNotVisible(LookupError):
    """The GPU an arena lives on is not among the devices this process can see."""


class InsufficientGpuMemory(MemoryError):
    """An allocation would not fit in the GPU's free memory."""


# --------------------------------------------------------------------------------------------------
# UUIDs


def parse_visible_devices(value: str | None, gpus: Sequence[GpuInfo]) -> list[str]:
    """The UUIDs a process with ``CUDA_VISIBLE_DEVICES=value`` sees, in its CUDA index order.

    Mirrors CUDA's (and torch's) parsing: unset means every GPU; entries are indices or ``GPU-``
    UUID prefixes (the first entry's kind decides); the first invalid, unknown or ambiguous entry
    ends the list; a repeated device empties it. Indices are taken in NVML's PCI-bus order, which is
    CUDA's order only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (on a node of identical GPUs the
    default FASTEST_FIRST order gives the same). Prefer asking CUDA (``CudaDriver.visible_uuids``)
    where it is initialized; this is for processes that are not.
    """
    uuids = [normalize_uuid(g.uuid) for g in sorted(gpus, key=lambda g: g.index)]
    if value is None:
        return uuids
    out: list[str] = []
    entries = [e.strip() for e in value.split(",")]
    by_uuid = entries[0].upper().startswith(("GPU-", "MIG-")) if entries else False
    for entry in entries:
        if by_uuid:
            if not entry.upper().startswith("GPU-"):
                break  # MIG instances cannot hold IPC arenas: treated as not visible
            prefix = normalize_uuid(entry)
            matches = [u for u in uuids if u.startswith(prefix)]
            if len(matches) != 1:
                break
            uuid = matches[0]
        else:
            digits = entry[: len(entry) - len(entry.lstrip("+0123456789"))] if entry else ""
            if not digits or not digits.lstrip("+").isdigit():
                break
            i = int(digits)
            if i >= len(uuids):
                break
            uuid = uuids[i]
        if uuid in out:
            return []
        out.append(uuid)
    return out


def index_for_uuid(uuid: str, visible: Sequence[str], *, env: Mapping[str, str] | None = None) -> int:
    """This process's CUDA index of GPU ``uuid``, given the UUIDs it sees in index order; the error
    for a GPU it cannot see names ``CUDA_VISIBLE_DEVICES`` from ``env`` (default: this process's)."""
    want = normalize_uuid(uuid)
    seen = [normalize_uuid(u) for u in visible]
    if want in seen:
        return seen.index(want)
    cvd = cuda_visible_devices(env)
    shown = ", ".join(f"cuda:{i}={u}" for i, u in enumerate(seen)) or "no GPU at all"
    raise GpuNotVisible(
        f"the arena lives on {want}, which this process cannot see; "
        f"CUDA_VISIBLE_DEVICES={'(unset)' if cvd is None else repr(cvd)} shows {shown}. "
        "Run this process with that GPU visible (its UUID or index in CUDA_VISIBLE_DEVICES), "
        "or attach to the daemon that serves the GPU it runs on"
    )


def cuda_index_for_uuid(uuid: str, *, driver: Any = None) -> int:
    """The CUDA index of ``uuid`` in this process, asking CUDA for the visible devices' UUIDs.

    Without CUDA (or before it is initialized) falls back to NVML + ``CUDA_VISIBLE_DEVICES``.
    """
    if driver is None:
        driver = default_driver(required=False)
    if driver is not None:
        visible = driver.visible_uuids()
    else:
        visible = parse_visible_devices(cuda_visible_devices(), local_gpus())
    return index_for_uuid(uuid, visible)


# --------------------------------------------------------------------------------------------------
# NVML


def _nvml_module() -> Any:
    import pynvml  # nvidia-ml-py, a hard dependency; libnvidia-ml.so may still be absent

    return pynvml


def local_gpus(nvml: Any = None) -> GpuList:
    """Every GPU on the node, in NVML order, with memory figures; empty with ``.reason`` if no NVML."""
    try:
        nvml = _nvml_module() if nvml is None else nvml
    except ImportError as exc:
        return GpuList(reason=f"nvidia-ml-py is not installed ({exc})")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, …
        return GpuList(reason=f"NVML is not available ({type(exc).__name__}: {exc}): no NVIDIA driver here")
    try:
        gpus = GpuList()
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            name = nvml.nvmlDeviceGetName(h)
            gpus.append(
                GpuInfo(
                    index=i,
                    uuid=normalize_uuid(nvml.nvmlDeviceGetUUID(h)),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_total=int(mem.total),
                    memory_used=int(mem.used),
                    memory_free=int(mem.free),
                )
            )
        if not gpus:
            gpus.reason = "NVML lists no GPU on this node"
        return gpus
    except Exception as exc:
        return GpuList(reason=f"NVML failed while listing GPUs ({type(exc).__name__}: {exc})")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def gpu_by_uuid(uuid: str, gpus: Sequence[GpuInfo]) -> GpuInfo | None:
    want = normalize_uuid(uuid)
    return next((g for g in gpus if normalize_uuid(g.uuid) == want), None)


# --------------------------------------------------------------------------------------------------
# free memory


def fmt_bytes(n: int) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n} B"


def check_free_memory(
    what: str, nbytes: int, *, free: int, total: int, gpu: str, reserve: int = 0, hint: str = ""
) -> None:
    """Raise InsufficientGpuMemory unless ``nbytes`` (+ ``reserve`` left for others) fits in ``free``."""
    if nbytes + reserve <= free:
        return
    keep = f" and keep {fmt_bytes(reserve)} free" if reserve else ""
    raise InsufficientGpuMemory(
        f"{what} needs {fmt_bytes(nbytes)} ({nbytes} B){keep} on {gpu}, but only {fmt_bytes(free)} "
        f"of {fmt_bytes(total)} is free ({fmt_bytes(total - free)} in use)"
        + (f"; {hint}" if hint else "; free memory on that GPU or size the arenas smaller")
    )


# --------------------------------------------------------------------------------------------------
# status text


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def arena_placements(arenas: Iterable[Any]) -> list[dict[str, Any]]:
    """``{name, bytes, gpu_uuid}`` of each arena (``gpu_uuid`` is ``"host"`` for POSIX shm) for status."""
    return [
        {"name": a.name, "bytes": int(a.size), "gpu_uuid": getattr(a, "gpu_uuid", None) or HOST}
        for a in arenas
    ]


def render_gpus(
    gpus: Sequence[GpuInfo | Mapping[str, Any]],
    arenas: Iterable[Any] = (),
    *,
    reason: str | None = None,
) -> str:
    """Text for ``refitd status``: each GPU (name, UUID, memory) and the daemon's arenas on it.

    ``gpus`` are GpuInfo or their wire dicts; ``arenas`` are arena objects or ``{name, bytes,
    gpu_uuid}`` dicts (see :func:`arena_placements`).
    """
    placed: dict[str, list[tuple[str, int]]] = {}
    for a in arenas:
        uuid = _get(a, "gpu_uuid") or HOST
        key = HOST if uuid == HOST else normalize_uuid(uuid)
        placed.setdefault(key, []).append((str(_get(a, "name")), int(_get(a, "bytes", _get(a, "size", 0)))))
    lines: list[str] = []
    if not gpus:
        lines.append(f"GPUs: none ({reason or 'NVML lists none'})")
    for g in gpus:
        uuid = normalize_uuid(_get(g, "uuid"))
        total, used, free = (int(_get(g, k)) for k in ("memory_total", "memory_used", "memory_free"))
        lines.append(
            f"GPU {_get(g, 'index')}  {_get(g, 'name')}  {uuid}  "
            f"used {fmt_bytes(used)} / {fmt_bytes(total)}, free {fmt_bytes(free)}"
        )
        lines.extend(_arena_lines(placed.pop(uuid, [])))
    if placed.get(HOST):
        lines.append("host memory (POSIX shm)")
        lines.extend(_arena_lines(placed.pop(HOST)))
    for uuid, items in placed.items():  # on a GPU NVML did not list: say so rather than hide it
        lines.append(f"{uuid} (not listed by NVML on this node)")
        lines.extend(_arena_lines(items))
    return "\n".join(lines)


def _arena_lines(items: list[tuple[str, int]]) -> list[str]:
    return [f"    arena {name}  {fmt_bytes(size)}" for name, size in items]
