"""Memory and GPUs: the arenas, their sizes, and the device memory tiers.

Arena sizes are bytes, allocated once at start; None sizes them from the plan. ``staging_regions``:
0 stages a whole step; N streams it through N regions the size of its largest layer group
(sidecar.daemon.memory.staging); None: 0 for shm arenas, ``DEFAULT_GPU_REGIONS`` for cuda. ``arena``
is ``shm`` (POSIX shared memory, any machine) or ``cuda`` (``cudaMalloc`` on ``gpu``, a UUID or an
index, shared with trainers and engines through CUDA IPC). With ``arena = "cuda"`` the daemon
allocates at most ``device_budget`` bytes on each GPU it uses (``gpus``: CUDA indices or UUIDs;
default: ``gpu``, else CUDA's current device): the staging and publish rings, cut into layer groups
small enough to fit; several ``gpus`` spread the groups over all of them (docs/multi_gpu.md).
``generation_residency`` puts the two generations in host memory (``host``, page-locked, the
default) or on the GPU (``device``: only where both fit the budget too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sidecar.config import values as v
from sidecar.config.groups.common import AUTO_SIZE as _AUTO_SIZE
from sidecar.config.groups.common import OPT_COUNT as _OPT_COUNT
from sidecar.config.groups.common import OPT_TEXT as _OPT_TEXT
from sidecar.config.values import Residency, knob, parse_size
from transport.arena import ArenaKind

#: staging regions when ``arena = "cuda"`` and ``staging_regions`` is unset: a whole step of BF16
#: (67 GB for Qwen3.5-35B-A3B) does not belong on a GPU the engines share; four layer groups do.
DEFAULT_GPU_REGIONS = 4
#: device memory the daemon may allocate on each GPU it uses when ``device_budget`` is unset: the
#: staging and publish rings (and, with ``generation_residency = "device"``, both generations).
#: The peers' anchor: checkpoint-engine takes up to 3 buckets of 2.67-8 GiB per GPU.
DEFAULT_DEVICE_BUDGET = 4 << 30


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """Memory and GPUs: the arenas, their sizes, and the device memory tiers. (one group of :class:`sidecar.config.settings.DaemonConfig`)"""

    TITLE: ClassVar[str] = "memory and GPUs"

    staging_bytes: int | None = field(
        default=None,
        metadata=knob(
            "--staging-bytes",
            _AUTO_SIZE,
            "SIZE",
            "staging arena (auto: from the plan)",
            example='"16GiB"',
            note="default: sized from the plan",
        ),
    )
    publish_bytes: int | None = field(
        default=None,
        metadata=knob(
            "--publish-bytes",
            _AUTO_SIZE,
            "SIZE",
            "publish arena (auto: from the plan)",
            example='"8GiB"',
            note="default: sized from the plan",
        ),
    )
    staging_regions: int | None = field(
        default=None,
        metadata=knob(
            "--staging-regions",
            _OPT_COUNT,
            "N",
            f"stream steps through N layer-sized staging regions; 0: whole step (default: 0 shm, "
            f"{DEFAULT_GPU_REGIONS} cuda)",
            example="4",
            note=f"stream a step through N layer-sized regions, 0: stage it whole;\n"
            f'default: 0 with arena = "shm", {DEFAULT_GPU_REGIONS} with arena = "cuda"',
        ),
    )
    arena: ArenaKind = field(
        default=ArenaKind.SHM,
        metadata=knob(
            "--arena",
            v.arena,
            "KIND",
            "shm (POSIX shared memory) or cuda (CUDA IPC)",
            note="shm, or cuda (arenas in GPU memory, CUDA IPC)",
        ),
    )
    gpu: str | None = field(
        default=None,
        metadata=knob(
            "--gpu",
            _OPT_TEXT,
            "UUID|INDEX",
            "arena=cuda: the GPU holding the arenas (default 0)",
            example='"GPU-5c1e..."',
            note="arena = cuda: UUID or index of the arenas' GPU",
        ),
    )
    device_budget: int = field(
        default=DEFAULT_DEVICE_BUDGET,
        metadata=knob(
            "--device-budget",
            parse_size,
            "SIZE",
            "arena=cuda: device memory the daemon may use per GPU (default 4GiB)",
            example='"4GiB"',
            note="arena = cuda: device memory per GPU for the rings (and device-resident generations)",
        ),
    )
    gpus: tuple[str, ...] = field(
        default=(),
        metadata=knob(
            "--gpus",
            v.gpu_list,
            "LIST",
            "arena=cuda: GPUs the daemon uses, indices or UUIDs; several: layer groups spread over them",
            example='["GPU-5c1e...", "1"]',
            note="arena = cuda: the GPUs it uses (indices or UUIDs); several: groups spread over them",
        ),
    )
    generation_residency: Residency = field(
        default=Residency.HOST,
        metadata=knob(
            "--generation-residency",
            v.choice(Residency),
            "WHERE",
            "arena=cuda: generations in host memory (page-locked) or on the device",
            note="arena = cuda: host (page-locked host memory) or device (must fit device_budget)",
        ),
    )

    @property
    def ring_regions(self) -> int:
        """Staging regions in effect: ``staging_regions``, else 0 on shm and DEFAULT_GPU_REGIONS on cuda."""
        if self.staging_regions is not None:
            return self.staging_regions
        return DEFAULT_GPU_REGIONS if self.arena is ArenaKind.CUDA_IPC else 0

    @property
    def arena_gpu(self) -> str | None:
        """The GPU the arenas go on: ``gpu``, else the first of ``gpus``, else None (CUDA's current)."""
        return self.gpu if self.gpu is not None else (self.gpus[0] if self.gpus else None)

    @property
    def host_generations(self) -> bool:
        """Whether the generations live in host memory: always on shm, and on cuda unless
        ``generation_residency = "device"``."""
        return self.arena is ArenaKind.SHM or self.generation_residency is Residency.HOST
