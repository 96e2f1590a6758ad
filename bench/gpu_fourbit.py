"""bench/gpu_check.py's 4-bit section: the daemon's CUDA quantize path for NVFP4, MXFP4 and INT4.

On one Qwen3.5-35B-A3B layer's routed experts (gate_up ``[256, 1024, 2048]`` + down ``[256, 2048,
512]``, bf16; ``--small``: 8 experts) planned as the daemon plans them, for each 4-bit variant
(NVFP4 under ModelOpt's and compressed-tensors' names, MXFP4, INT4 group 32 bf16 and group 128
float32 scales):

* **bytes**: every output of the Triton slab kernels (``sidecar.plan.launch.try_run_unit``, what
  ``run_unit`` calls first) against the torch reference run on the same device (what ``run_unit``
  falls back to), ``.view(torch.uint8)`` equal, output by output;
* **throughput**: milliseconds per layer of the kernels and of the reference, against a plain
  device-to-device copy of the same bf16 bytes in the same run (GB/s counts bf16 read + outputs
  written; the copy: read + written), and each one's fraction of the copy's GB/s;
* **device memory**: the peak bytes each allocates above what it held before (the kernels: their
  flag, pointer tables and NVFP4's amax scratch, 4 bytes per expert; the reference: its temporaries),
  what counts against ``device_budget`` beyond the rings.

On CPU (the dry run) the kernels are skipped with the capability predicate's reason; the reference
and the copy still run, so the section's code paths are exercised.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from sidecar.numerics import kernels
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan import launch
from sidecar.plan.build import RefitPlan, RefitSpec
from sidecar.plan.run import _quantize_groups

VARIANTS: dict[str, tuple[Format, FormatParams]] = {
    "nvfp4": (Format.NVFP4, FormatParams()),
    "nvfp4 (compressed-tensors)": (Format.NVFP4, FormatParams(nvfp4_names="compressed_tensors")),
    "mxfp4": (Format.MXFP4, FormatParams()),
    "int4 g32 bf16": (Format.INT4_W4A16, FormatParams()),
    "int4 g128 f32": (Format.INT4_W4A16, FormatParams(int4_group=128, int4_scale_dtype="float32")),
}
PREFIX = "model.language_model.layers.0.mlp.experts"


def _layer(shape, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, dims in (("gate_up_proj", shape.gate_up), ("down_proj", shape.down)):
        x = torch.randn(dims, generator=g, device=device, dtype=torch.float32)
        x *= torch.exp2(torch.randint(-12, 12, (*dims[:-1], 1), generator=g, device=device).float())
        out[f"{PREFIX}.{name}"] = x.to(torch.bfloat16)
        del x
    return out


def _reference(plan: RefitPlan, tensors, outputs) -> None:
    """What run_unit does when the kernels decline: sidecar.numerics.cpu, the torch reference on a GPU."""
    for unit in plan.units:
        weights = {o.name: o for o in unit.outputs if o.scale_name}
        groups = [tuple(weights[n] for n in group) for group in unit.scale_groups]
        _quantize_groups(unit.fmt, groups, tensors, outputs, unit.params)


def _triton(plan: RefitPlan, tensors, outputs, group: kernels.FlagGroup) -> None:
    """As the daemon's quantize worker: the launches' NaN/Inf flags in its one group, read once
    for the layer."""
    for unit in plan.units:
        with kernels.collecting(group, unit.index):
            if not launch.try_run_unit(unit, tensors, outputs):
                raise RuntimeError(f"the kernels declined unit {unit.index} ({unit.inputs[0]})")
    errors = group.check()
    if errors:
        raise next(iter(errors.values()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_extra(device: torch.device, fn: Callable[[], Any]) -> int | None:
    """Device bytes ``fn`` allocated at its peak above what was held before (None on CPU)."""
    if device.type != "cuda":
        fn()
        return None
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def _time_copy(tensors: dict[str, torch.Tensor], run) -> float:
    """Median ms of a plain device copy of the layer's bf16 bytes (the baseline, same run)."""
    dst = {n: torch.empty_like(t) for n, t in tensors.items()}
    return statistics.median(run(lambda: [dst[n].copy_(t) for n, t in tensors.items()]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fourbit_section(device: torch.device, shape, args, timer) -> dict[str, Any]:
    """The section's result: ``rows`` (one per variant and implementation), ``copy``, ``ok``."""
    run = timer(device, args.warmup, args.iters)
    slow = timer(device, min(args.warmup, 1), max(1, min(args.iters, 3)))  # the reference: seconds
    tensors = _layer(shape, device, args.seed)
    nbytes_in = sum(t.numel() * t.element_size() for t in tensors.values())
    copy_ms = _time_copy(tensors, run)
    copy_gbps = 2 * nbytes_in / copy_ms / 1e6
    reason = kernels.unavailable_reason(device)
    result: dict[str, Any] = {
        "shape": {"experts": shape.experts, "inter": shape.inter, "hidden": shape.hidden},
        "copy": {"ms": copy_ms, "gbps": copy_gbps, "bytes": 2 * nbytes_in},
        "triton": reason or "ran",
        "rows": [],
        "ok": True,
    }
    flags = kernels.FlagGroup()  # as the worker: one group, its flag buffer allocated once
    # what run_unit runs when the kernels decline: the torch reference on a GPU, native C on CPU
    fallback = "torch reference" if device.type == "cuda" else "run_unit on cpu (native C)"
    for label, (fmt, params) in VARIANTS.items():
        plan = RefitPlan.build(
            [(n, t) for n, t in tensors.items()], RefitSpec(model_type="qwen3_5_moe", fmt=fmt, params=params)
        )
        nbytes = nbytes_in + sum(o.nbytes for o in plan.outputs)
        want = plan.allocate(device=device)
        extra = _peak_extra(device, lambda plan=plan, want=want: _reference(plan, tensors, want))
        ms = statistics.median(slow(lambda plan=plan, want=want: _reference(plan, tensors, want)))
        base = {"variant": label, "fmt": fmt.value, "params": params.describe(fmt)}
        result["rows"].append(
            {
                **base,
                "impl": fallback,
                "ms": ms,
                "gbps": nbytes / ms / 1e6,
                "of_copy": nbytes / ms / 1e6 / copy_gbps,
                "peak_extra_bytes": extra,
            }
        )
        if reason is not None:
            result["rows"].append({**base, "impl": "triton", "status": f"skipped: {reason}"})
            continue
        got = plan.allocate(device=device)
        for t in got.values():
            _bits(t).fill_(0xA5)  # stale bytes would show
        extra = _peak_extra(device, lambda plan=plan, got=got: _triton(plan, tensors, got, flags))
        bad = [o.name for o in plan.outputs if not torch.equal(_bits(got[o.name]), _bits(want[o.name]))]
        ms = statistics.median(run(lambda plan=plan, got=got: _triton(plan, tensors, got, flags)))
        result["rows"].append(
            {
                **base,
                "impl": "triton",
                "ms": ms,
                "gbps": nbytes / ms / 1e6,
                "of_copy": nbytes / ms / 1e6 / copy_gbps,
                "peak_extra_bytes": extra,
                "byte_equal": not bad,
                "mismatched": bad[:5],
                "outputs": len(plan.outputs),
            }
        )
        result["ok"] = result["ok"] and not bad
        del got, want
    return result


def print_fourbit(section: dict[str, Any]) -> None:
    if "rows" not in section:
        print(f"\n4-bit: {section.get('status')}")
        return
    copy = section["copy"]
    print(
        f"\n4-bit quantize, one layer {section['shape']}: copy {copy['ms']:.3f} ms ({copy['gbps']:.1f} GB/s)"
    )
    for r in section["rows"]:
        head = f"  {r['variant']:28s} {r['impl']:38s}"
        if "status" in r:
            print(f"{head} {r['status']}")
            continue
        peak = "" if r.get("peak_extra_bytes") is None else f"  peak +{r['peak_extra_bytes'] / 2**20:.1f} MiB"
        same = "" if "byte_equal" not in r else ("  bytes equal" if r["byte_equal"] else "  BYTES DIFFER")
        print(f"{head} {r['ms']:9.3f} ms {r['gbps']:7.1f} GB/s {r['of_copy']:6.1%} of copy{peak}{same}")
