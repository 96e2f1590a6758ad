"""CPU throughput of each quantizer on (a slice of) a Qwen3.5-35B-A3B layer's routed-expert slabs.

Implementations, measured in the same run on the same bytes (outputs into existing buffers):
  reference    sidecar.numerics.reference, the pure-torch oracle, one call per slab;
  native       sidecar.numerics.cpu (the daemon's CPU path: native/quant.c, fourbit.c), one call per slab;
  native/proj  the same, one call per expert projection (gate, up, down views), as the daemon's
               plan units made them until they batched;
  native/unit  ``sidecar.plan.run.run_unit`` on the plan's two slab units (gate_up, down): what the
               daemon's quantize worker runs, every projection of a slab in one split; on the same
               buffers every round, as the daemon's staging and arena views are step after step, so
               after the warm-up round the units' kernel calls are the kept ones (sidecar.plan.reuse);
  native/batch the same bytes as a per-expert model's units (Qwen3-MoE's layout: a unit per expert's
               gate and up, or per projection), queued together: ``run_quantized_units`` over
               batches of BATCH_QUANT_BYTES, as the worker runs them;
and the baselines:
  copy   a plain ``dst.copy_(src)`` of the bf16 slab into an existing buffer (the memory floor);
  naive  the straightforward implementation: pad, reshape, amax, divide, cast, whole tensor at once
         (FP8 formats only; the 4-bit formats' reference is already that).
The 4-bit formats (nvfp4, mxfp4, int4_w4a16) are measured the same way, against the same copy.
Printed as GB/s of bf16 input and as a fraction of the copy's speed ("of copy"); the copy, the
reference and the native columns are timed round-robin, per format, so they share the same moments.
The header names the machine (lscpu's model, its cores) and its copy rate, and the call paths' table
gives n/unit's and the copy's GB/s per thread, so a figure can be read on another machine. Its last
column, "n/unit cpu", is the same ratio in this process's CPU seconds (all threads) instead of wall time:
on a shared machine a process waiting for a core loses wall time, not CPU time, so that ratio moves
less with the load (time stalled on memory is in both).

    python bench/quant.py [--experts 32] [--repeat 5] [--threads N] [--json PATH] [--formats F,..]
                          [--baseline-lib PATH] [--stages]

``--baseline-lib`` adds a column "base": the native slab call run with another build of
native/ (e.g. the previous commit's, built with the same flags), timed in the same
round-robin as the others, for a before/after comparison on the same moments of a shared machine;
and "base n/unit": the slab units (``run_unit``, this tree's Python) on that build's kernels.

``--stages`` also times NVFP4's two passes apart, round-robin with the copy: the global-amax pass
(``cpu.nvfp4_global_scale``, a read of the slab) and the block kernel given that scale; the one-call
"native" column is both.

A full layer is gate_up [256, 1024, 2048] + down [256, 2048, 512] (1.5 GiB bf16); the default takes
32 experts of it (192 MiB) so the run fits a 2-core, 24 GiB machine in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: ``python bench/quant.py`` puts bench/ first on sys.path, where bench/transport.py would hide the
#: transport package (the daemon's worker imports it): the repository goes first
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.config.environment import brief_openmp_spin

# the daemon's OpenMP wait policy (refitd sets it before torch loads): with libgomp's default, torch's
# threads keep spinning after each torch call here (the copy, the reference) and slow the native
# kernels timed right after them, which the daemon never sees
brief_openmp_spin()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sidecar.cli.demo.synthetic import make_hf_config  # noqa: E402
from sidecar.daemon.worker import BATCH_QUANT_BYTES  # noqa: E402
from sidecar.numerics import cpu, fourbit, native  # noqa: E402
from sidecar.numerics import reference as quant  # noqa: E402
from sidecar.numerics.formats import FLT_MIN, FOUR_BIT_FORMATS, FP8_DTYPE, FP8_MAX, Format  # noqa: E402
from sidecar.plan.build import RefitSpec, plan_from_hf_config  # noqa: E402
from sidecar.plan.run import run_quantized_units, run_unit  # noqa: E402

HIDDEN, INTER = 2048, 512  # Qwen3.5-35B-A3B


def naive_block_fp8(w: torch.Tensor):
    *lead, n, k = w.shape
    pn, pk = (-n) % 128, (-k) % 128
    x = F.pad(w.float(), (0, pk, 0, pn))
    tiles = x.reshape(*lead, (n + pn) // 128, 128, (k + pk) // 128, 128)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax == 0, 1.0, (amax / FP8_MAX).clamp_min(FLT_MIN))
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape)[..., :n, :k], scale.squeeze(-1).squeeze(-2)


def naive_mxfp8(w: torch.Tensor):
    x = w.float().unflatten(-1, (-1, 32))
    amax = x.abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-126, 127)
    e = torch.where(amax == 0, torch.full_like(e, -126), e)
    q = (x / torch.exp2(e)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), (e + 127).to(torch.uint8).squeeze(-1)


def naive_per_tensor(w: torch.Tensor):
    x = w.float()
    amax = x.abs().amax()
    scale = torch.where(amax == 0, 1.0, (amax / FP8_MAX).clamp_min(FLT_MIN))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def four_bit_outs(fmt: Format, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Output buffers of a 4-bit format for an input of ``shape``."""
    q = torch.empty(fmt.weight_shape(shape), dtype=fmt.weight_dtype)
    s = torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype)
    if fmt is Format.NVFP4:
        return q, s, torch.empty(())
    if fmt is Format.INT4_W4A16:
        return q, s, torch.empty(2, dtype=torch.int64)
    return q, s


def per_projection_calls(fmt: str, slabs: dict[str, torch.Tensor]) -> list:
    """One ``cpu.quantize`` call per expert projection (gate and up views of gate_up, down), into
    per-projection output buffers, as the daemon's plan units call it; per-tensor shares one scale
    over each expert's gate and up."""
    calls = []
    for key, slab in slabs.items():
        parts = (slice(0, INTER), slice(INTER, 2 * INTER)) if key == "gate_up" else (slice(None),)
        for e in range(slab.shape[0]):
            views = [slab[e, p] for p in parts]
            if fmt in FOUR_BIT_FORMATS:
                outs4 = [four_bit_outs(Format(fmt), tuple(v.shape)) for v in views]
                if fmt == Format.NVFP4.value:  # gate and up share one global scale

                    def group4(views=views, outs=outs4):
                        gs = cpu.nvfp4_global_scale(*views)
                        for v, o in zip(views, outs):
                            cpu.quantize_nvfp4(v, global_scale=gs, out=o)

                    calls.append(group4)
                else:
                    calls.extend((lambda v=v, o=o: cpu.quantize(v, fmt, out=o)) for v, o in zip(views, outs4))
                continue
            outs = []
            for v in views:
                q = torch.empty(v.shape, dtype=FP8_DTYPE)
                if fmt == "block_fp8":
                    s = torch.empty(-(-v.shape[0] // 128), -(-v.shape[1] // 128))
                elif fmt == "mxfp8":
                    s = torch.empty(v.shape[0], v.shape[1] // 32, dtype=torch.uint8)
                else:
                    s = torch.empty(())
                outs.append((q, s))
            if fmt == "fp8_per_tensor":

                def group(views=views, outs=outs):
                    scale = cpu.fp8_per_tensor_scale(*views)
                    for v, o in zip(views, outs):
                        cpu.quantize_fp8_per_tensor(v, scale=scale, out=o)

                calls.append(group)
            else:
                calls.extend(
                    (lambda v=v, o=o: cpu.quantize(v, fmt, out=o)) for v, o in zip(views, outs, strict=True)
                )
    return calls


def slab_units(fmt: str, experts: int, slabs: dict[str, torch.Tensor]) -> list:
    """``run_unit`` on each of a one-layer plan's slab units, over ``slabs``, into its own outputs."""
    config = make_hf_config(
        "qwen3_5_moe", num_layers=1, hidden=HIDDEN, intermediate=INTER, num_experts=experts
    )
    plan = plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    calls = []
    for unit in plan.units:
        if unit.fmt is None or not unit.inputs[0].startswith("model.") or ".experts." not in unit.inputs[0]:
            continue
        (source,) = unit.inputs
        inputs = {source: slabs["gate_up" if source.endswith("gate_up_proj") else "down"]}
        outputs = {o.name: torch.empty(o.shape, dtype=o.dtype) for o in unit.outputs}
        calls.append(lambda unit=unit, inputs=inputs, outputs=outputs: run_unit(unit, inputs, outputs))
    assert len(calls) == 2, f"expected the gate_up and down slab units, found {len(calls)}"
    return calls


def expert_batches(fmt: str, experts: int, slabs: dict[str, torch.Tensor]) -> list:
    """The worker's batches of a per-expert (qwen3_moe) plan's quantizing units over the slabs' views."""
    config = make_hf_config("qwen3_moe", num_layers=1, hidden=HIDDEN, intermediate=INTER, num_experts=experts)
    plan = plan_from_hf_config(config, RefitSpec(model_type="qwen3_moe", fmt=fmt))
    gate_up, down = slabs["gate_up"], slabs["down"]
    views = {}
    for e in range(experts):
        prefix = f"model.layers.0.mlp.experts.{e}"
        views[f"{prefix}.gate_proj.weight"] = gate_up[e, :INTER]
        views[f"{prefix}.up_proj.weight"] = gate_up[e, INTER:]
        views[f"{prefix}.down_proj.weight"] = down[e]
    units = [u for u in plan.units if u.fmt is not None and all(n in views for n in u.inputs)]
    assert sum(len(u.inputs) for u in units) == 3 * experts
    runs: list[list] = [[]]
    for unit in units:
        if runs[-1] and sum(u.bytes_in for u in runs[-1]) + unit.bytes_in > BATCH_QUANT_BYTES:
            runs.append([])
        runs[-1].append(unit)
    calls = []
    for run in runs:
        ins = [{n: views[n] for n in u.inputs} for u in run]
        outs = [{o.name: torch.empty(o.shape, dtype=o.dtype) for o in u.outputs} for u in run]
        calls.append(lambda run=run, ins=ins, outs=outs: _batched(run, ins, outs))
    return calls


def _batched(units: list, ins: list, outs: list) -> None:
    if not run_quantized_units(units, ins, outs):
        raise RuntimeError("run_quantized_units declined the units: the n/batch column would time nothing")


def machine() -> dict:
    """The CPU this ran on (lscpu's model name, the cores Linux shows), so a figure can be read elsewhere."""
    model = platform.processor() or platform.machine()
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False)
        for line in done.stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "arch": platform.machine()}


def timed(fn, repeat: int) -> float:
    fn()  # warm-up: page faults, allocator
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def timed_together(fns: list, repeat: int, cpu: list[float] | None = None) -> list[float]:
    """Median seconds of each of ``fns``, timed round-robin (one of each per round), so a load that
    comes and goes on a shared machine lands on all of them alike rather than on one column. With
    ``cpu``, each one's median CPU seconds of this process (all its threads: torch's for the copy, the
    quantizer threads for the kernels) are appended to it: time spent waiting for a core another
    process holds is not in them, so their ratios move less with the machine's load."""
    for fn in fns:
        fn()  # warm-up
    samples: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out, used in zip(fns, samples, cpus):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            used.append(time.process_time() - c0)
    if cpu is not None:
        cpu.extend(statistics.median(x) for x in cpus)
    return [statistics.median(x) for x in samples]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32, help="experts of the 256-expert layer to use")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--formats", default=None, help="comma-separated formats to time (default: all)")
    ap.add_argument("--baseline-lib", type=Path, default=None, help="another native build to time alongside")
    ap.add_argument(
        "--stages", action="store_true", help="also time NVFP4's global-amax pass and kernel apart"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    slabs = {
        "gate_up": (torch.randn(args.experts, 2 * INTER, HIDDEN, generator=g) * 0.02).bfloat16(),
        "down": (torch.randn(args.experts, HIDDEN, INTER, generator=g) * 0.02).bfloat16(),
    }
    nbytes = sum(t.numel() * t.element_size() for t in slabs.values())
    copies = {k: torch.empty_like(t) for k, t in slabs.items()}
    outs = {
        "block_fp8": {
            k: (
                torch.empty(t.shape, dtype=FP8_DTYPE),
                torch.empty(*t.shape[:-2], -(-t.shape[-2] // 128), -(-t.shape[-1] // 128)),
            )
            for k, t in slabs.items()
        },
        "mxfp8": {
            k: (
                torch.empty(t.shape, dtype=FP8_DTYPE),
                torch.empty(*t.shape[:-1], t.shape[-1] // 32, dtype=torch.uint8),
            )
            for k, t in slabs.items()
        },
        "fp8_per_tensor": {
            k: (torch.empty(t.shape, dtype=FP8_DTYPE), torch.empty(())) for k, t in slabs.items()
        },
    }
    for fmt in FOUR_BIT_FORMATS:
        outs[fmt.value] = {k: four_bit_outs(fmt, tuple(t.shape)) for k, t in slabs.items()}
    ours = {
        "block_fp8": quant.quantize_block_fp8,
        "mxfp8": quant.quantize_mxfp8,
        "fp8_per_tensor": quant.quantize_fp8_per_tensor,
        "nvfp4": fourbit.quantize_nvfp4,
        "mxfp4": fourbit.quantize_mxfp4,
        "int4_w4a16": fourbit.quantize_int4,
    }
    kernels = {
        "block_fp8": cpu.quantize_block_fp8,
        "mxfp8": cpu.quantize_mxfp8,
        "fp8_per_tensor": cpu.quantize_fp8_per_tensor,
        "nvfp4": cpu.quantize_nvfp4,
        "mxfp4": cpu.quantize_mxfp4,
        "int4_w4a16": cpu.quantize_int4,
    }
    naive = {"block_fp8": naive_block_fp8, "mxfp8": naive_mxfp8, "fp8_per_tensor": naive_per_tensor}
    proj_calls = {fmt: per_projection_calls(fmt, slabs) for fmt in ours}
    unit_calls = {fmt: slab_units(fmt, args.experts, slabs) for fmt in ours}
    batch_calls = {fmt: expert_batches(fmt, args.experts, slabs) for fmt in ours}
    base_lib = native._open(args.baseline_lib) if args.baseline_lib else None

    def with_base(fn):
        """``fn`` run with the baseline build as the one cpu.py loads (bench-only swap)."""
        load = native.load
        native.load = lambda: base_lib
        try:
            return fn()
        finally:
            native.load = load

    done = cpu.warm_up()  # build + load before timing
    if done.impl != "native":
        print(f"warning: {done.reason}; the native columns time the torch reference")

    rows = []
    for fmt in ours if args.formats is None else [Format.parse(f).value for f in args.formats.split(",")]:
        t_naive = float("nan")
        if fmt in naive:
            t_naive = timed(lambda fmt=fmt: [naive[fmt](t) for t in slabs.values()], max(1, args.repeat // 2))
        fns = [
            lambda: [copies[k].copy_(t) for k, t in slabs.items()],
            lambda fmt=fmt: [ours[fmt](t, out=outs[fmt][k]) for k, t in slabs.items()],
            lambda fmt=fmt: [kernels[fmt](t, out=outs[fmt][k]) for k, t in slabs.items()],
            lambda fmt=fmt: [call() for call in proj_calls[fmt]],
            lambda fmt=fmt: [call() for call in unit_calls[fmt]],
            lambda fmt=fmt: [call() for call in batch_calls[fmt]],
        ]
        if base_lib is not None:
            fns.append(
                lambda fmt=fmt: with_base(
                    lambda: [kernels[fmt](t, out=outs[fmt][k]) for k, t in slabs.items()]
                )
            )
            fns.append(lambda fmt=fmt: with_base(lambda: [call() for call in unit_calls[fmt]]))
        cpu_s: list[float] = []
        t_copy, t_ours, t_native, t_proj, t_unit, t_batch, *t_base = timed_together(fns, args.repeat, cpu_s)
        rows.append(
            {
                "format": fmt,
                "ours_gbps": nbytes / t_ours / 1e9,
                "native_gbps": nbytes / t_native / 1e9,
                "native_proj_gbps": nbytes / t_proj / 1e9,
                "native_unit_gbps": nbytes / t_unit / 1e9,
                "native_batch_gbps": nbytes / t_batch / 1e9,
                "naive_gbps": nbytes / t_naive / 1e9,
                "copy_gbps": nbytes / t_copy / 1e9,
                "vs_naive": t_naive / t_ours,
                "vs_copy": t_copy / t_ours,
                "native_vs_copy": t_copy / t_native,
                "native_proj_vs_copy": t_copy / t_proj,
                "native_unit_vs_copy": t_copy / t_unit,
                "native_batch_vs_copy": t_copy / t_batch,
                "unit_vs_proj": t_proj / t_unit,
                "batch_vs_proj": t_proj / t_batch,
                "native_vs_reference": t_ours / t_native,
                "native_unit_cpu_vs_copy": cpu_s[0] / cpu_s[4],
            }
        )
        if t_base:
            rows[-1].update(base_gbps=nbytes / t_base[0] / 1e9, base_vs_copy=t_copy / t_base[0])
            rows[-1].update(base_unit_gbps=nbytes / t_base[1] / 1e9, base_unit_vs_copy=t_copy / t_base[1])
            rows[-1].update(base_unit_cpu_vs_copy=cpu_s[0] / cpu_s[7])
    host, threads = machine(), torch.get_num_threads()
    print(
        f"refitd bench/quant: {args.experts} experts of a Qwen3.5-35B-A3B layer, {nbytes / 2**20:.0f} MiB bf16, "
        f"{threads} threads, torch {torch.__version__}, CPU path: {done.impl}\n"
        f"machine: {host['cpu']}, {host['cores']} cores ({host['arch']}); copy (median of the formats' rounds) "
        f"{statistics.median(r['copy_gbps'] for r in rows):.2f} GB/s, "
        f"{statistics.median(r['copy_gbps'] for r in rows) / threads:.2f} GB/s a thread"
    )
    print(
        f"{'format':<16}{'reference':>10}{'native':>8}{'naive':>8}{'copy':>8}   GB/s |{'ref':>6}{'native':>8}"
        f"  of copy |{'native x ref':>13}"
    )
    for r in rows:
        print(
            f"{r['format']:<16}{r['ours_gbps']:>10.2f}{r['native_gbps']:>8.2f}{r['naive_gbps']:>8.2f}"
            f"{r['copy_gbps']:>8.2f}        |{r['vs_copy'] * 100:>5.0f}%{r['native_vs_copy'] * 100:>7.0f}%"
            f"          |{r['native_vs_reference']:>12.1f}x"
            + (
                f" | base {r['base_gbps']:.2f} GB/s, {r['base_vs_copy'] * 100:.0f}% of copy"
                if "base_gbps" in r
                else ""
            )
        )
    print(
        "\nthe daemon's call paths, same rounds (of copy; x: against one call per projection; GB/s of bf16 in)"
    )
    print(
        f"{'format':<16}{'n/proj':>8}{'n/unit':>8}{'n/batch':>9} |{'unit x proj':>12}{'batch x proj':>13} |"
        f"{'n/unit GB/s':>12}{'a thread':>9}{'copy GB/s':>10}{'a thread':>9} |{'n/unit cpu':>11}"
    )
    for r in rows:
        r["native_unit_gbps_per_thread"] = r["native_unit_gbps"] / threads
        r["copy_gbps_per_thread"] = r["copy_gbps"] / threads
        print(
            f"{r['format']:<16}{r['native_proj_vs_copy'] * 100:>7.0f}%{r['native_unit_vs_copy'] * 100:>7.0f}%"
            f"{r['native_batch_vs_copy'] * 100:>8.0f}% |{r['unit_vs_proj']:>11.2f}x{r['batch_vs_proj']:>12.2f}x |"
            f"{r['native_unit_gbps']:>12.2f}{r['native_unit_gbps_per_thread']:>9.2f}"
            f"{r['copy_gbps']:>10.2f}{r['copy_gbps_per_thread']:>9.2f} |{r['native_unit_cpu_vs_copy'] * 100:>10.0f}%"
            + (
                f" | base n/unit {r['base_unit_vs_copy'] * 100:.0f}% ({r['base_unit_gbps']:.2f} GB/s,"
                f" cpu {r['base_unit_cpu_vs_copy'] * 100:.0f}%)"
                if "base_unit_gbps" in r
                else ""
            )
        )
    if args.stages:
        scales = {k: cpu.nvfp4_global_scale(t) for k, t in slabs.items()}
        nv = outs[Format.NVFP4.value]
        t_copy, t_amax, t_kernel = timed_together(
            [
                lambda: [copies[k].copy_(t) for k, t in slabs.items()],
                lambda: [cpu.nvfp4_global_scale(t) for t in slabs.values()],
                lambda: [cpu.quantize_nvfp4(t, global_scale=scales[k], out=nv[k]) for k, t in slabs.items()],
            ],
            args.repeat,
        )
        print(
            f"nvfp4 stages (ms): copy {t_copy * 1e3:.2f}, global-amax pass {t_amax * 1e3:.2f}, "
            f"block kernel {t_kernel * 1e3:.2f} ({t_copy / t_kernel * 100:.0f}% of copy), "
            f"both {(t_amax + t_kernel) * 1e3:.2f} ({t_copy / (t_amax + t_kernel) * 100:.0f}% of copy)"
        )
    if args.json:
        meta = {"bytes_in": nbytes, "threads": torch.get_num_threads(), "torch": torch.__version__}
        meta["machine"] = platform.machine()
        meta.update(cpu=host["cpu"], cores=host["cores"])
        meta["baseline_lib"] = str(args.baseline_lib) if args.baseline_lib else None
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
