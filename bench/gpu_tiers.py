"""bench/gpu_check.py's ``tiers`` section: the memory tiers on one GPU (DESIGN decision 10).

For a Qwen3.5-35B-A3B-shaped model (its real layer shapes, ``--tiers-layers`` layers; the whole
model's two host generations would need 71 GiB of /dev/shm) it builds the daemon's own arenas
(``Arenas.for_plan``: staging and publish rings by ``cudaMalloc`` within ``--tiers-budget``, two
host generations in POSIX shm, page-locked) and streams one step through them as the daemon does:
each ring group's BF16 inputs into its staging region, ``run_unit`` (the Triton kernels) into its
publish region, the copy-out into the host generation. It reports:

- **peak device memory** against the budget: the arenas' ``cudaMalloc`` bytes, torch's allocator
  peak (the kernels' temporaries) and the GPU's used memory above the run's start
  (``cudaMemGetInfo``), sampled after every group;
- **correctness**: sampled units re-run into fresh device buffers, compared byte for byte with what
  landed in the host generation;
- **H2D rate of an engine load** from the page-locked host generation (every published tensor
  ``copy_(non_blocking=True)`` into device buffers allocated beforehand, as an engine's parameters
  are) against a plain pinned ``copy_`` of the same bytes (``torch.empty(pin_memory=True)``) and a
  pageable one, in the same run; the ratio to the pinned copy is the figure (target >= 0.9).

Without CUDA (``--device cpu``) it plans only: the device tier the budget gives and the sizes, so
the CPU dry run checks this code's planning half.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN35_CONFIG = ROOT / "tests" / "data" / "qwen3.5-35b-a3b.config.json"
GiB = 2**30


def tiers_plan(layers: int, small: bool):
    """The Qwen3.5-35B-A3B plan cut to ``layers`` decoder layers (``small``: a synthetic tiny one)."""
    from sidecar.cli.demo.synthetic import make_hf_config
    from sidecar.plan.build import RefitSpec, plan_from_hf_config

    if small:
        config = make_hf_config("qwen3_5_moe", num_layers=layers, num_experts=8, unaligned=True)
    else:
        config = json.loads(QWEN35_CONFIG.read_text())
        text = config.get("text_config", config)
        text["num_hidden_layers"] = layers
        for key in ("layer_types",):
            if isinstance(text.get(key), list):
                text[key] = text[key][:layers]
    return plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def tiers_section(device: torch.device, args) -> dict[str, Any]:
    from sidecar.daemon.memory.tiers import fit_device_tier

    plan = tiers_plan(args.tiers_layers, args.small)
    budget = args.tiers_budget
    tier = fit_device_tier(plan, regions=4, budget=budget, host_generations=True)
    result: dict[str, Any] = {
        "layers": args.tiers_layers,
        "budget": budget,
        "plan": {
            "regions": tier.regions,
            "groups": tier.groups,
            "split": tier.max_group_bytes is not None,
            "staging_region": tier.staging_region,
            "publish_region": tier.publish_region,
            "device_bytes": tier.device_bytes,
            "generation": plan.bytes_out,
        },
    }
    spread = _spread(device, args, plan)
    if device.type != "cuda":
        result["status"] = "planned only: no CUDA device (the measurement needs a GPU)"
        result["ok"] = tier.device_bytes <= budget
        result["spread"] = spread
        return result
    result.update(_measure(device, plan, budget, args))
    result["status"] = "ran"
    result["spread"] = spread
    if spread.get("ok") is False:
        result["ok"] = False
    return result


def _spread(device: torch.device, args, plan) -> dict[str, Any]:
    """1 GPU against every GPU (bench/gpu_spread.py); skipped on one GPU; an error is recorded."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_spread", Path(__file__).with_name("gpu_spread.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.spread_section(device, args, plan)
    except Exception as exc:  # the one-GPU figures above stand on their own
        return {"status": f"failed: {type(exc).__name__}: {exc}", "ok": False}


def _measure(device: torch.device, plan, budget: int, args) -> dict[str, Any]:
    from sidecar.daemon.memory.generations import Arenas
    from sidecar.daemon.memory.tiers import copy_out
    from sidecar.plan.run import run_unit
    from transport.arena import ArenaKind

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base_used, base_torch = _used(device), torch.cuda.memory_allocated(device)
    arenas = Arenas.for_plan(
        f"refitd-gpucheck-{random.getrandbits(32):08x}",
        plan,
        kind=ArenaKind.CUDA_IPC,
        gpu=device.index or 0,
        staging_regions=4,
        host_generations=True,
        budget=budget,
    )
    if arenas.pinning is not None:  # host generations are page-locked on a thread (issue 34): timed pinned
        arenas.pinning.wait()
    try:
        ring, gen = arenas.ring, arenas.generations[0]
        peak_used, samples, seconds = _used(device) - base_used, [], 0.0
        for k, group in enumerate(ring.groups):
            region = k % ring.regions
            base = ring.ring.slots[region].offset
            inputs = {}
            for s in group.layout:
                view = arenas.staging.view(base + s.offset, s.dtype, s.shape)
                if s.dtype.is_floating_point:
                    view.copy_(torch.randn(s.shape, device=device))
                else:
                    view.zero_()
                inputs[s.name] = view
            views = arenas.publish_outputs(group.index, region)
            t0 = time.perf_counter()
            for u in group.units:
                unit = plan.units[u]
                outs = {o.name: views.get(o.name, None) for o in unit.outputs}
                outs = {n: v if v is not None else gen.arena.tensor(n) for n, v in outs.items()}
                run_unit(unit, inputs, outs)
            torch.cuda.synchronize(device)
            copy_out(arenas.publish_copies(group.index, region, gen))
            seconds += time.perf_counter() - t0
            peak_used = max(peak_used, _used(device) - base_used)
            if k % max(1, len(ring.groups) // 4) == 0:
                samples.append(_check_group(device, plan, group, inputs, gen))
        arena_bytes = arenas.device_bytes()
        torch_peak = torch.cuda.max_memory_allocated(device) - base_torch
        load = _h2d(device, gen, args)
        return {
            "device": {
                "arenas_cudamalloc": arena_bytes,
                "torch_allocator_peak": torch_peak,
                "used_peak_above_start": peak_used,
                "within_budget": arena_bytes <= budget,
                "of_budget": arena_bytes / budget,
            },
            "quantize_and_copy_out_s": seconds,
            "bytes_in": plan.bytes_in,
            "checked_groups": samples,
            "h2d": load,
            "ok": arena_bytes <= budget and all(s["exact"] for s in samples) and load["ratio"] > 0,
        }
    finally:
        arenas.close()


def _check_group(device, plan, group, inputs, gen) -> dict[str, Any]:
    """Re-run ``group``'s units into fresh device buffers: the host generation must hold the same bytes."""
    from sidecar.plan.run import run_unit

    bad = []
    for u in group.units:
        unit = plan.units[u]
        fresh = {o.name: torch.empty(o.shape, dtype=o.dtype, device=device) for o in unit.outputs}
        run_unit(unit, inputs, fresh)
        for name, t in fresh.items():
            host = gen.arena.tensor(name)
            if not torch.equal(t.cpu().reshape(-1).view(torch.uint8), host.reshape(-1).view(torch.uint8)):
                bad.append(name)
    return {"group": group.label, "units": len(group.units), "exact": not bad, "mismatched": bad[:5]}


def _h2d(device: torch.device, gen, args) -> dict[str, Any]:
    """An engine's load out of the page-locked host generation vs a plain pinned copy_ of the bytes."""
    tensors = dict(gen.arena.tensors())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = {n: torch.empty_like(t, device=device) for n, t in tensors.items()}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def load() -> None:
        for n, t in tensors.items():
            params[n].copy_(t, non_blocking=True)

    def timed(fn) -> float:
        runs = []
        for i in range(args.warmup + max(3, args.iters // 4)):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            if i >= args.warmup:
                runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    engine = timed(load)
    plain = timed(lambda: flat.copy_(pinned, non_blocking=True))
    unpinned = timed(lambda: flat.copy_(pageable))
    return {
        "bytes": nbytes,
        "tensors": len(tensors),
        "engine_load_gbps": _gbps(nbytes, engine),
        "pinned_copy_gbps": _gbps(nbytes, plain),
        "pageable_copy_gbps": _gbps(nbytes, unpinned),
        "ratio": _gbps(nbytes, engine) / max(_gbps(nbytes, plain), 1e-9),
    }


def print_tiers(t: dict[str, Any]) -> None:
    print(f"\ntiers: {t.get('status')}")
    if "plan" not in t:
        return
    p = t["plan"]
    print(
        f"  {t['layers']} Qwen3.5-35B-A3B layers, budget {t['budget'] / GiB:.2f} GiB: {p['regions']} ring regions, "
        f"{p['groups']} groups{' (layers cut)' if p['split'] else ''}, rings {p['device_bytes'] / GiB:.2f} GiB, "
        f"a host generation {p['generation'] / GiB:.2f} GiB"
    )
    if "device" in t:
        d, h = t["device"], t["h2d"]
        print(
            f"  device: arenas {d['arenas_cudamalloc'] / GiB:.3f} GiB ({100 * d['of_budget']:.0f}% of the budget), "
            f"torch peak {d['torch_allocator_peak'] / GiB:.3f} GiB, used above start {d['used_peak_above_start'] / GiB:.3f} GiB"
        )
        print(
            f"  engine load from the page-locked host generation: {h['engine_load_gbps']:.1f} GB/s; pinned copy_ "
            f"{h['pinned_copy_gbps']:.1f} GB/s (ratio {h['ratio']:.2f}); pageable {h['pageable_copy_gbps']:.1f} GB/s"
        )
        exact = all(s["exact"] for s in t["checked_groups"])
        print(f"  {len(t['checked_groups'])} groups re-checked: {'byte-exact' if exact else 'MISMATCH'}")
    if "spread" in t:
        s = t["spread"]
        print(f"  all GPUs vs one: {s.get('status')}")
        planned = s.get("planned_device_bytes_per_gpu", {})
        if planned:
            print(
                "    planned device bytes per GPU: "
                + ", ".join(f"{k} GPU(s) {v / GiB:.2f} GiB" for k, v in planned.items())
            )
        if s.get("status") == "ran":
            one, every = s["one_gpu"], s["all_gpus"]
            print(
                f"    step on {every['gpus']} GPUs {every['seconds']:.3f} s vs 1 GPU {one['seconds']:.3f} s: "
                f"{s['speedup']:.2f}x; per GPU {[round(b / GiB, 3) for b in every['device_bytes_per_gpu']]} GiB "
                f"(within budget: {s['within_budget']}); generations identical: {s['identical']}"
            )
