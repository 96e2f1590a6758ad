"""bench/gpu_check.py's ``tiers`` section, multi-GPU part: one GPU against every GPU of the device.

docs/multi_gpu.md, "Per-GPU work": with ``gpus`` naming several GPUs the daemon places ring group
``g`` on GPU ``g mod N``, each GPU with its own staging and publish rings under ``device_budget``
and its own quantization thread. This builds the daemon's own arenas twice for the same
Qwen3.5-shaped plan (``Arenas.for_plan``: once on one GPU, once with ``gpus`` = every visible GPU)
and streams one step through each as the daemon's workers do (one thread per GPU: each group's
BF16 inputs into its staging region on its GPU, ``run_unit`` into its publish region,
``copy_out`` into the page-locked host generation), then reports:

- the wall time of the step on N GPUs against 1 GPU (the ratio is the figure; N-fold at best,
  bounded by the host's memory bandwidth for the copy-out and by the Python launch thread);
- each GPU's arena bytes (``cudaMalloc``) against the budget;
- whether both host generations are byte-identical (the inputs are a deterministic function of
  the group and the element index, identical on every GPU).

Skipped (``status``) on fewer than two GPUs; without CUDA it plans only (each GPU's tier).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch

GiB = 2**30


def spread_section(device: torch.device, args, plan) -> dict[str, Any]:
    """1 GPU vs every GPU, on ``plan`` (bench/gpu_tiers.tiers_plan's), within ``args.tiers_budget``."""
    from sidecar.daemon.memory.tiers import fit_device_tier

    budget = args.tiers_budget
    n = torch.cuda.device_count() if device.type == "cuda" else 0
    planned = {
        k: fit_device_tier(plan, regions=4, budget=budget, host_generations=True, gpus=k).device_bytes
        for k in sorted({1, 2, 4, 8, max(n, 1)})
    }
    result: dict[str, Any] = {"gpus": n, "planned_device_bytes_per_gpu": planned}
    if n < 2:
        result["status"] = f"skipped: {n} GPU(s); comparing 1 GPU with all needs at least 2"
        return result
    one = _run(plan, [device.index or 0], budget)
    every = _run(plan, list(range(n)), budget)
    result.update(
        {
            "status": "ran",
            "one_gpu": {k: v for k, v in one.items() if k != "generation"},
            "all_gpus": {k: v for k, v in every.items() if k != "generation"},
            "speedup": one["seconds"] / max(every["seconds"], 1e-9),
            "identical": bool(torch.equal(one["generation"], every["generation"])),
            "within_budget": all(b <= budget for b in every["device_bytes_per_gpu"]),
        }
    )
    result["ok"] = result["identical"] and result["within_budget"]
    return result


def _fill(view: torch.Tensor, group: int) -> None:
    """Deterministic inputs, the same on every GPU: a function of the group and the element index."""
    if not view.numel():
        return
    if not view.dtype.is_floating_point:
        view.zero_()
        return
    idx = torch.arange(view.numel(), device=view.device, dtype=torch.int64)
    vals = ((idx * 7919 + group * 104729) % 2003 - 1001).to(torch.float32) / 256.0
    view.copy_(vals.view(view.shape))


def _run(plan, gpus: list[int], budget: int) -> dict[str, Any]:
    from sidecar.daemon.memory.generations import Arenas
    from sidecar.daemon.memory.tiers import copy_out
    from sidecar.plan.run import run_unit
    from transport.arena import ArenaKind

    arenas = Arenas.for_plan(
        f"refitd-gpuspread-{random.getrandbits(32):08x}",
        plan,
        kind=ArenaKind.CUDA_IPC,
        gpu=gpus[0],
        gpus=gpus if len(gpus) > 1 else None,
        staging_regions=4,
        host_generations=True,
        budget=budget,
    )
    if arenas.pinning is not None:  # host generations are page-locked on a thread (issue 34): timed pinned
        arenas.pinning.wait()
    try:
        ring, gen = arenas.ring, arenas.generations[0]
        errors: list[BaseException] = []

        def lane(k: int) -> None:  # one GPU's worker: its groups in plan order, region by region
            try:
                staging, dev = arenas.stagings[k], torch.device("cuda", arenas.stagings[k].device)
                mine = [g for g in ring.groups if ring.lane_of(g.index) == k]
                for j, group in enumerate(mine):
                    region = j % ring.regions
                    base = ring.rings[k].slots[region].offset
                    inputs = {}
                    for s in group.layout:
                        view = staging.view(base + s.offset, s.dtype, s.shape)
                        _fill(view, group.index)
                        inputs[s.name] = view
                    views = arenas.publish_outputs(group.index, region)
                    for u in group.units:
                        unit = plan.units[u]
                        outs = {o.name: views.get(o.name) for o in unit.outputs}
                        outs = {
                            name: v if v is not None else gen.arena.tensor(name) for name, v in outs.items()
                        }
                        run_unit(unit, inputs, outs)
                    torch.cuda.synchronize(dev)
                    copy_out(arenas.publish_copies(group.index, region, gen))
            except BaseException as exc:  # reported after the join
                errors.append(exc)

        for k in range(arenas.lanes):  # warm: compile every kernel on every GPU before timing
            lane(k)
        if errors:
            raise errors[0]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lane, args=(k,)) for k in range(arenas.lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
        flat = gen.arena.view(0, torch.uint8, (gen.arena.size,)).clone()
        return {
            "gpus": len(gpus),
            "seconds": seconds,
            "groups": len(ring.groups),
            "device_bytes_per_gpu": arenas.device_bytes_per_gpu(),
            "generation": flat,
        }
    finally:
        arenas.close()
