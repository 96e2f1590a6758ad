"""One command on a one-GPU machine: the Triton kernels checked and timed, and a colocated refit.

    python bench/gpu_check.py --out bench/results/gpu-h200.json      # on the GPU machine
    python bench/gpu_check.py --device cpu --small                    # the same code path, CPU torch

Three sections, each recorded even when another fails:

1. **correctness**: every kernel against the torch reference run on the same device, byte for byte
   (values through ``.view(torch.uint8)``, scales exact), on fresh random slabs (ragged and batched
   shapes, fp16/fp32, a strided view, a zeroed 128x128 block, one NaN), the edge-case table of
   tests/quant_cases.py, and every timed Qwen3.5 layer. The GPU reference itself is checked against
   the CPU reference (SPEC.md's division trap: it divides by device tensors, never Python scalars).
2. **timing** on a Qwen3.5-35B-A3B layer's routed experts (gate_up ``[256, 1024, 2048]`` + down
   ``[256, 2048, 512]``, bf16): a device-to-device copy of the same bytes, the torch reference per
   expert (as ``run_unit`` calls it) and batched, ``torch.compile`` of the reference, the kernels
   with their default tiles and a small sweep of others. CUDA events, warm-up, median of N. GB/s
   counts bytes moved (bf16 read + fp8 and scales written; the copy: read + written) and each row's
   fraction of the copy's GB/s (target: kernels >= 90%).
3. **e2e**: a trainer process writes a synthetic Qwen3.5-35B-A3B-shaped model (routed experts at
   full size, as many layers as fit) into a staging arena, this process (the daemon) quantizes it
   into a published arena, an engine process copies every tensor out and checks it. CUDA IPC arenas
   on a GPU (``transport.cuda_ipc``), POSIX shared memory on CPU; skipped with its reason when the
   arena cannot be had. :func:`run_e2e` is the one function to rewire to the daemon's own arenas.

Prints a table and writes JSON (``--out``). Exit status 0 when every check that ran passed. The
kernel and timing parts import neither pyzmq nor NIXL.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):  # the repo (no install needed on the GPU machine) and quant_cases
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from sidecar import kernels, quant  # noqa: E402
from sidecar.formats import FLT_MIN, FP8_DTYPE, FP8_MAX, Format  # noqa: E402

FORMATS = [f for f in Format if f.quantized]
GiB = 2**30


@dataclass(frozen=True)
class LayerShape:
    experts: int
    inter: int
    hidden: int

    @property
    def gate_up(self) -> tuple[int, int, int]:
        return (self.experts, 2 * self.inter, self.hidden)

    @property
    def down(self) -> tuple[int, int, int]:
        return (self.experts, self.hidden, self.inter)

    @property
    def numel(self) -> int:
        return 3 * self.experts * self.inter * self.hidden


QWEN35 = LayerShape(256, 512, 2048)  # Qwen3.5-35B-A3B: 40 layers, 256 experts, I = 512, H = 2048
SMALL = LayerShape(8, 128, 256)

#: tile configs timed besides the default (each also checked byte for byte)
SWEEP: dict[Format, list[kernels.TileConfig]] = {
    Format.BLOCK_FP8: [
        kernels.TileConfig(block_rows=128, block_cols=128, num_warps=4),
        kernels.TileConfig(block_rows=128, block_cols=256, num_warps=8),
        kernels.TileConfig(block_rows=128, block_cols=256, num_warps=16),
    ],
    Format.MXFP8: [
        kernels.TileConfig(block_rows=64, block_cols=256, num_warps=8),
        kernels.TileConfig(block_rows=16, block_cols=512, num_warps=4),
        kernels.TileConfig(block_rows=32, block_cols=512, num_warps=8),
        kernels.TileConfig(block_rows=128, block_cols=128, num_warps=8),
    ],
    Format.FP8_PER_TENSOR: [
        kernels.TileConfig(block_rows=64, block_cols=256, num_warps=8, amax_chunks=32),
        kernels.TileConfig(block_rows=32, block_cols=512, num_warps=8, amax_chunks=64),
        kernels.TileConfig(block_rows=16, block_cols=512, num_warps=4, amax_chunks=16),
    ],
}


# --------------------------------------------------------------------------------------------------
# implementations under test, all with quantize_slab's signature: (slab, fmt, outs, names)


def torch_slab(slab, fmt, outs, names, config=None) -> None:
    """The torch reference through the slab interface, one call per (expert, part), as run_unit
    calls it; per-tensor shares one scale over an expert's parts."""
    parts = len(outs[0]) if outs else 1
    rows = slab.shape[1] // parts
    for e, row in enumerate(outs):
        views = [slab[e, p * rows : (p + 1) * rows] for p in range(parts)]
        if fmt is Format.FP8_PER_TENSOR:
            scale = quant.fp8_per_tensor_scale(*views, name=" + ".join(names[e]))
            for p, view in enumerate(views):
                quant.quantize_fp8_per_tensor(view, scale=scale, out=row[p], name=names[e][p])
        else:
            for p, view in enumerate(views):
                quant.quantize(view, fmt, out=row[p], name=names[e][p])


def triton_slab(slab, fmt, outs, names, config=None) -> None:
    kernels.quantize_slab(slab, fmt, outs, names=names, config=config)


def implementations(device: torch.device) -> dict[str, Callable | str]:
    """name -> implementation, or the reason it is skipped. Where the kernels cannot run, the
    reference through the slab interface stands in for them, so this script's own paths still run."""
    reason = kernels.unavailable_reason(device)
    if reason is None:
        return {"triton": triton_slab}
    return {"triton": f"skipped: {reason}", "torch-slab": torch_slab}


# --------------------------------------------------------------------------------------------------
# outputs and comparison


class Stacked:
    """Outputs of one slab as two stacked buffers ``[E, P, rows, cols]`` / ``[E, P, *scale]`` whose
    per-(expert, part) views are the ``outs`` the implementations write (contiguous, expert after
    expert), so a whole slab compares in one operation. Filled with sentinels (NaN bytes) first, so
    an unwritten byte shows as a mismatch."""

    def __init__(self, slab_shape, parts: int, fmt: Format, device):
        e, r, k = slab_shape
        self.shape = (r // parts, k)
        self.fmt = fmt
        self.q = torch.empty((e, parts, *self.shape), dtype=FP8_DTYPE, device=device)
        self.s = torch.empty((e, parts, *fmt.scale_shape(self.shape)), dtype=fmt.scale_dtype, device=device)
        self.outs = [[(self.q[i, p], self.s[i, p]) for p in range(parts)] for i in range(e)]
        self.names = [[f"layers.0.mlp.experts.{i}.part{p}.weight" for p in range(parts)] for i in range(e)]
        self.poison()

    def poison(self) -> None:
        self.q.view(torch.uint8).fill_(0x7F)
        if self.s.dtype == torch.uint8:
            self.s.fill_(255)
        else:
            self.s.fill_(float("nan"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def compare(got: Stacked, want: Stacked) -> dict[str, Any]:
    """Mismatch counts of values and scales, and where the first one is."""
    qd = _bits(got.q) != _bits(want.q)
    sd = _bits(got.s) != _bits(want.s)
    out: dict[str, Any] = {"values_mismatched": int(qd.sum()), "scales_mismatched": int(sd.sum())}
    for what, diff, a, b in (("values", qd, got.q, want.q), ("scales", sd, got.s, want.s)):
        if out[f"{what}_mismatched"]:
            idx = tuple(int(i) for i in torch.nonzero(diff)[0])
            out["first"] = {
                "what": what,
                "expert": idx[0],
                "part": idx[1],
                "index": idx[2:],
                "got": int(_bits(a)[idx]),
                "want": int(_bits(b)[idx]),
            }
            break
    out["ok"] = not (out["values_mismatched"] or out["scales_mismatched"])
    return out


# --------------------------------------------------------------------------------------------------
# section 1: correctness


def check_slabs(
    small: bool,
) -> list[tuple[str, Callable[[torch.device, torch.Generator], torch.Tensor], int]]:
    """(label, make(device, generator) -> slab, parts): fresh random slabs, each with a zeroed tile."""

    def randn(shape, dtype=torch.bfloat16, scale=1.0, transpose=False):
        def make(device, g):
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(scale).to(dtype)
            t = t.transpose(1, 2) if transpose else t
            t[0, :128, :128] = 0
            return t

        return make

    e = 2 if small else 6
    cases = [
        ("gate_up ragged (I=200, K=320)", randn((e, 400, 320)), 2),
        ("down ragged (H=320, K=224)", randn((e, 320, 224)), 1),
        ("gate_up fp16, strided view", randn((e, 256, 384), torch.float16, transpose=True), 2),
        ("down fp32, subnormal scale", randn((e, 256, 160), torch.float32, 1e-39), 1),
        ("down fp32, huge", randn((e, 256, 160), torch.float32, 1e36), 1),
    ]
    if not small:
        cases += [
            ("gate_up batched (32 experts)", randn((32, 1024, 2048)), 2),
            ("down batched (32 experts)", randn((32, 2048, 512)), 1),
        ]
    return cases


def _run_case(impl, slab, fmt, parts, device, config=None):
    got = Stacked(slab.shape, parts, fmt, device)
    impl(slab, fmt, got.outs, got.names, config)
    return got


def check_random(impls, device, small: bool, seed: int) -> list[dict[str, Any]]:
    rows = []
    g = torch.Generator(device=device).manual_seed(seed)
    for label, make, parts in check_slabs(small):
        slab = make(device, g)
        for fmt in FORMATS:
            want = _run_case(torch_slab, slab, fmt, parts, device)
            if device.type == "cuda" and slab.numel() <= 8 << 20:  # the GPU oracle follows SPEC
                cpu = _run_case(torch_slab, slab.cpu(), fmt, parts, torch.device("cpu"))
                res = compare(_to(cpu, device), want)
                rows.append({"impl": "torch-gpu vs torch-cpu", "case": label, "fmt": fmt.value, **res})
            for name, impl in impls.items():
                if isinstance(impl, str):
                    rows.append({"impl": name, "case": label, "fmt": fmt.value, "ok": None, "status": impl})
                    continue
                res = _guarded(lambda: compare(_run_case(impl, slab, fmt, parts, device), want))  # noqa: B023
                rows.append({"impl": name, "case": label, "fmt": fmt.value, **res})
    return rows


def _to(st: Stacked, device) -> Stacked:
    st.q, st.s = st.q.to(device), st.s.to(device)
    return st


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as err:
        return {
            "ok": False,
            "status": f"error: {type(err).__name__}: {err}",
            "trace": traceback.format_exc(limit=3),
        }


def check_non_finite(impls, device) -> list[dict[str, Any]]:
    """One NaN / Inf in expert 1's up rows: refused, naming that output."""
    rows = []
    for bad in (float("nan"), float("inf")):
        slab = torch.randn(3, 2 * 130, 128, device=device).bfloat16()
        slab[1, 130 + 129, 70] = bad
        for fmt in FORMATS:
            for name, impl in impls.items():
                if isinstance(impl, str):
                    continue
                st = Stacked(slab.shape, 2, fmt, device)
                try:
                    impl(slab, fmt, st.outs, st.names)
                    ok, status = False, "not refused"
                except quant.NonFiniteError as err:
                    ok, status = st.names[1][1] in str(err), str(err).split(";")[0]
                except Exception as err:
                    ok, status = False, f"error: {type(err).__name__}: {err}"
                rows.append(
                    {"impl": name, "case": f"one {bad}", "fmt": fmt.value, "ok": ok, "status": status}
                )
    return rows


def check_table(impls, device) -> list[dict[str, Any]]:
    """tests/quant_cases.py through each implementation on ``device``, against the CPU reference."""
    from quant_cases import CASES

    table_impls: dict[str, Callable | str] = {"torch-" + device.type: quant.quantize}
    if "triton" in impls:
        table_impls["triton"] = kernels.quantize if not isinstance(impls["triton"], str) else impls["triton"]
    rows = []
    for case in CASES:
        for name, fn in table_impls.items():
            if isinstance(fn, str):
                rows.append({"impl": name, "case": case.id, "fmt": case.fmt.value, "ok": None, "status": fn})
                continue
            rows.append(
                {"impl": name, "case": case.id, "fmt": case.fmt.value, **_table_case(case, fn, device)}
            )
    return rows


def _table_case(case, fn, device) -> dict[str, Any]:
    w = case.make()
    label = "model.layers.0.mlp.experts.0.up_proj.weight"
    try:
        if case.error:
            try:
                fn(w.to(device), case.fmt, name=label)
            except ValueError as err:
                ok = case.error in str(err) and label in str(err)
                return {"ok": ok, "status": "refused" if ok else f"wrong message: {err}"}
            return {"ok": False, "status": "not refused"}
        q, s = fn(w.to(device), case.fmt)
        rq, rs = quant.quantize(w, case.fmt)
        bad_q = int((_bits(q.cpu()) != _bits(rq)).sum())
        bad_s = int((_bits(s.cpu().contiguous()) != _bits(rs.contiguous())).sum())
        for index, byte in case.q_bytes.items():
            bad_q += int(int(q.cpu().view(torch.uint8)[index]) != byte)
        if case.scales is not None:
            bad_s += int(s.cpu().reshape(-1).tolist() != list(case.scales))
        return {"ok": not (bad_q or bad_s), "values_mismatched": bad_q, "scales_mismatched": bad_s}
    except Exception as err:
        return {"ok": False, "status": f"error: {type(err).__name__}: {err}"}


# --------------------------------------------------------------------------------------------------
# section 2: timing


def timer(device: torch.device, warmup: int, iters: int) -> Callable[[Callable[[], Any]], list[float]]:
    """A function timing ``fn`` ``iters`` times after ``warmup`` calls; milliseconds per call
    (CUDA events on a GPU, perf_counter on CPU)."""

    def run(fn):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return samples

    return run


def bytes_moved(shape: LayerShape, fmt: Format) -> int:
    """bf16 read + fp8 written + scales written, for both slabs of a layer."""
    n = shape.numel
    scales = 0
    for (e, r, k), parts in ((shape.gate_up, 2), (shape.down, 1)):
        per = fmt.scale_shape((r // parts, k))
        count = 1
        for d in per:
            count *= d
        scales += e * parts * count * fmt.scale_dtype.itemsize
    return 2 * n + n + scales


def compiled_reference(fmt: Format) -> Callable:
    """The reference's arithmetic as whole-slab torch code for torch.compile (no chunking, no
    per-expert loop; divides by a tensor argument). Slabs must be 128-aligned for block-FP8."""

    def block(w, fp8_max):
        e, n, k = w.shape
        x = w.float().view(e, n // 128, 128, k // 128, 128)
        amax = x.abs().amax(dim=(2, 4))
        s = torch.where(amax == 0, torch.ones_like(amax), torch.clamp_min(amax / fp8_max, FLT_MIN))
        q = (x * torch.reciprocal(s)[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q.view(e, n, k), s

    def mx(w, fp8_max):
        x = w.float().unflatten(-1, (-1, 32))
        bits = (x.abs().amax(-1) / fp8_max).view(torch.int32)
        byte = (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()).clamp(1, 254)
        mult = torch.where(byte == 254, 1 << 22, (254 - byte) << 23).view(torch.float32)
        q = (x * mult[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(-2)
        return q, byte.to(torch.uint8)

    def per_tensor(w, fp8_max):  # one scale per expert matrix: gate and up share it
        x = w.float()
        amax = x.abs().amax(dim=(1, 2))
        s = torch.where(amax == 0, torch.ones_like(amax), torch.clamp_min(amax / fp8_max, FLT_MIN))
        return (x * torch.reciprocal(s)[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s

    return {Format.BLOCK_FP8: block, Format.MXFP8: mx, Format.FP8_PER_TENSOR: per_tensor}[fmt]


def _compiled_matches(fmt, outs, want: dict[str, Stacked], shape: LayerShape) -> int:
    """Mismatched bytes of torch.compile's outputs against the reference's."""
    bad = 0
    for key, (q, s) in outs.items():
        w = want[key]
        e, parts = w.q.shape[:2]
        bad += int((_bits(q.reshape(w.q.shape)) != _bits(w.q)).sum())
        if fmt is Format.FP8_PER_TENSOR:
            bad += int((_bits(s[:, None].expand(e, parts).contiguous()) != _bits(w.s)).sum())
        elif fmt is Format.BLOCK_FP8:
            bad += int((_bits(s.reshape(e, parts, -1, s.shape[-1])) != _bits(w.s)).sum())
        else:
            bad += int((_bits(s.reshape(w.s.shape)) != _bits(w.s)).sum())
    return bad


def kernel_stats(compiled: list[Any]) -> list[dict[str, Any]]:
    """Registers, spills and store widths of the compiled kernels (from Triton's objects)."""
    out = []
    for k in compiled:
        try:
            ptx = k.asm.get("ptx", "")
            out.append(
                {
                    "name": getattr(k, "name", "?"),
                    "regs": getattr(k, "n_regs", None),
                    "spills": getattr(k, "n_spills", None),
                    "st.global.v4": ptx.count("st.global.v4"),
                    "st.global.v2": ptx.count("st.global.v2"),
                    "st.global.b8": ptx.count("st.global.b8") + ptx.count("st.global.u8"),
                    "ld.global.v4": ptx.count("ld.global.v4"),
                }
            )
        except Exception as err:  # diagnostics only
            out.append({"error": repr(err)})
    return out


def timing_section(device, shape: LayerShape, args, impls) -> dict[str, Any]:
    run = timer(device, args.warmup, args.iters)
    slow = timer(device, 1, max(1, args.iters // 5))
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    slabs = {
        "gate_up": torch.randn(shape.gate_up, generator=g, device=device).mul_(0.02).bfloat16(),
        "down": torch.randn(shape.down, generator=g, device=device).mul_(0.02).bfloat16(),
    }
    parts = {"gate_up": 2, "down": 1}
    copy_bytes = 2 * 2 * shape.numel
    t_copy = _time_copy(slabs, run)
    copy_gbps = copy_bytes / t_copy / 1e6
    result: dict[str, Any] = {
        "layer": {"gate_up": list(shape.gate_up), "down": list(shape.down), "bf16_bytes": 2 * shape.numel},
        "copy": {"ms": t_copy, "gbps": copy_gbps, "bytes": copy_bytes},
        "rows": [],
        "checks": [],
    }

    def row(fmt, what, ms, **extra):
        gbps = bytes_moved(shape, fmt) / ms / 1e6
        result["rows"].append(
            {"fmt": fmt.value, "what": what, "ms": ms, "gbps": gbps, "of_copy": gbps / copy_gbps, **extra}
        )

    for fmt in FORMATS:
        want = {k: _run_case(torch_slab, t, fmt, parts[k], device) for k, t in slabs.items()}
        mine = {k: Stacked(t.shape, parts[k], fmt, device) for k, t in slabs.items()}

        def per_expert(fmt=fmt, mine=mine):
            for k, t in slabs.items():
                torch_slab(t, fmt, mine[k].outs, mine[k].names)

        row(fmt, "torch reference, per expert (run_unit)", statistics.median(slow(per_expert)))
        if fmt is not Format.FP8_PER_TENSOR:  # batched: one call per projection over all experts

            def batched(fmt=fmt, mine=mine):
                for k, t in slabs.items():
                    p = parts[k]
                    rows = t.shape[1] // p
                    for i in range(p):
                        quant.quantize(
                            t[:, i * rows : (i + 1) * rows], fmt, out=(mine[k].q[:, i], mine[k].s[:, i])
                        )

            row(fmt, "torch reference, batched", statistics.median(slow(batched)))
        if args.compile:
            _time_compiled(fmt, slabs, want, shape, run, row, result)
        if isinstance(impls.get("triton"), str):
            result["rows"].append({"fmt": fmt.value, "what": "triton", "status": impls["triton"]})
            continue
        for cfg in [kernels.DEFAULT_CONFIGS[fmt]] + (SWEEP[fmt] if args.sweep else []):
            _time_triton(fmt, cfg, slabs, parts, mine, want, run, row, result)
    return result


def _time_copy(slabs: dict[str, torch.Tensor], run) -> float:
    """Median ms of ``dst.copy_(src)`` over the layer's slabs, into existing buffers."""
    copies = {k: torch.empty_like(t) for k, t in slabs.items()}
    return statistics.median(run(lambda: [copies[k].copy_(t) for k, t in slabs.items()]))


def _time_compiled(fmt, slabs, want, shape, run, row, result) -> None:
    fn = torch.compile(compiled_reference(fmt), dynamic=False)
    fp8_max = torch.full((), FP8_MAX, device=next(iter(slabs.values())).device)
    try:
        t0 = time.perf_counter()
        outs = {k: fn(t, fp8_max) for k, t in slabs.items()}
        compile_s = time.perf_counter() - t0
        ms = statistics.median(run(lambda: [fn(t, fp8_max) for t in slabs.values()]))
        bad = _compiled_matches(fmt, outs, want, shape)
        row(fmt, "torch.compile of the reference", ms, compile_s=compile_s, mismatched_bytes=bad)
    except Exception as err:
        what = "torch.compile of the reference"
        result["rows"].append({"fmt": fmt.value, "what": what, "status": f"error: {err!r}"[:300]})


def _time_triton(fmt, cfg, slabs, parts, mine, want, run, row, result) -> None:
    label = f"triton {cfg.block_rows}x{cfg.block_cols} w{cfg.num_warps}" + (
        f" c{cfg.amax_chunks}" if fmt is Format.FP8_PER_TENSOR else ""
    )
    try:
        launches: list[kernels.SlabLaunch] = []

        def layer():
            launches.clear()
            for k, t in slabs.items():
                launches.append(
                    kernels.quantize_slab(t, fmt, mine[k].outs, names=mine[k].names, config=cfg, wait=False)
                )

        for st in mine.values():
            st.poison()
        layer()
        for launch in launches:
            launch.check()
        checks = {k: compare(mine[k], want[k]) for k in slabs}
        ok = all(c["ok"] for c in checks.values())
        result["checks"].append(
            {"impl": label, "case": "timed layer", "fmt": fmt.value, "ok": ok, "detail": checks}
        )
        gpu_ms = statistics.median(run(layer))
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps):
            layer()
            for launch in launches:
                launch.check()
        call_ms = (time.perf_counter() - t0) * 1e3 / reps
        stats = kernel_stats([k for launch in launches for k in launch.compiled])
        row(fmt, label, gpu_ms, exact=ok, call_ms_with_sync=call_ms, kernels=stats)
    except Exception as err:
        result["rows"].append(
            {"fmt": fmt.value, "what": label, "status": f"error: {type(err).__name__}: {err}"}
        )
        result["checks"].append(
            {"impl": label, "case": "timed layer", "fmt": fmt.value, "ok": False, "status": repr(err)}
        )


# --------------------------------------------------------------------------------------------------
# section 3: end-to-end colocated refit (trainer process -> daemon -> engine process)


def _arena_backend(device: torch.device):
    """(create(name, layout), open(handle, writable), unlink(arena)) for ``device``, or a reason."""
    if device.type == "cuda":
        try:
            from transport import cuda_ipc
        except Exception as err:
            return None, f"transport.cuda_ipc is not importable ({type(err).__name__}: {err})"
        reason = cuda_ipc.cuda_unavailable_reason() if hasattr(cuda_ipc, "cuda_unavailable_reason") else None
        if reason:
            return None, f"CUDA IPC arena unavailable: {reason}"
        idx = torch.cuda.current_device()
        return (
            lambda name, layout: cuda_ipc.CudaIpcArena.create(name, layout, gpu=idx),
            lambda handle, writable: cuda_ipc.open_any_arena(handle, writable=writable),
            lambda arena: None,
        ), None
    try:
        from transport.shm import ShmArena, open_arena
    except Exception as err:
        return None, f"transport.shm is not importable ({type(err).__name__}: {err})"
    return (
        ShmArena.create,
        lambda handle, writable: open_arena(handle, writable=writable),
        lambda a: a.unlink(),
    ), None


def _send(conn, msg: dict) -> None:
    import msgpack

    conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


def _recv(conn, timeout: float) -> dict:
    import msgpack

    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout:.0f} s")
    return msgpack.unpackb(conn.recv_bytes(), raw=False)


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Byte sum of each tensor, with one host sync for all of them."""
    sums = [t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64) for t in tensors.values()]
    return dict(zip(tensors, torch.stack(sums).tolist())) if sums else {}


def _trainer_main(conn, device: str) -> None:
    """Trainer process: open the staging arena, write every weight (seeded), report."""
    try:
        _, open_arena = _arena_backend(torch.device(device))[0][:2]
        msg = _recv(conn, 600)
        arena = open_arena(msg["staging"], True)
        g = torch.Generator(device=device).manual_seed(msg["seed"])
        t0 = time.perf_counter()
        nbytes = 0
        for t in arena.tensors().values():
            t.normal_(0.0, 0.02, generator=g)
            nbytes += t.numel() * t.element_size()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        _send(conn, {"ok": True, "write_s": time.perf_counter() - t0, "bytes": nbytes})
        arena.close()
    except Exception as err:
        _send(conn, {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})


def _engine_main(conn, device: str) -> None:
    """Engine process: for each published generation, copy every tensor into its own buffers, check
    the bytes against the daemon's checksums, acknowledge."""
    try:
        _, open_arena = _arena_backend(torch.device(device))[0][:2]
        while True:
            msg = _recv(conn, 1800)
            if msg.get("stop"):
                return
            arena = open_arena(msg["published"], False)
            views = arena.tensors()
            params = {n: torch.empty_like(t) for n, t in views.items()}
            run = timer(torch.device(device), 1, 3)
            load_ms = statistics.median(run(lambda v=views, p=params: [p[n].copy_(t) for n, t in v.items()]))
            got = _checksums(params)
            bad = [n for n, c in msg["checksums"].items() if got.get(n) != c]
            nbytes = sum(t.numel() * t.element_size() for t in views.values())
            del views, params
            arena.close()
            _send(conn, {"ok": not bad, "load_ms": load_ms, "bytes": nbytes, "mismatched": bad[:10]})
    except Exception as err:
        _send(conn, {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})


def _e2e_layers(device: torch.device, shape: LayerShape, small: bool, requested: int | None) -> int:
    """As many Qwen3.5 layers (40 at most) as fit: staging bf16 + published + the engine's copy."""
    if requested:
        return requested
    if small or device.type != "cuda":
        return 2
    per_layer = 2 * shape.numel + 2 * (shape.numel + shape.numel // 128)  # bf16 + 2 x (fp8 + scales)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(40, int((free - 16 * GiB) // int(per_layer * 1.1))))


def run_e2e(device: torch.device, shape: LayerShape, args) -> dict[str, Any]:
    """Trainer process -> daemon (this process) -> engine process, on one device.

    The daemon side is the plan plus ``kernels.try_run_unit`` (falling back to ``run_unit``) over
    arenas; the lead rewires ``_arena_backend`` / this function to the daemon's own serve loop once
    the CUDA arena lands there. Returns the timings, or {"status": "skipped: <reason>"}.
    """
    backend, reason = _arena_backend(device)
    if backend is None:
        return {"status": f"skipped: {reason}"}
    try:
        import msgpack  # noqa: F401
    except ImportError:
        return {"status": "skipped: msgpack is not installed"}
    import multiprocessing as mp

    from sidecar.convert import run_unit
    from sidecar.plan import RefitSpec, plan_from_hf_config
    from sidecar.synthetic import make_hf_config
    from transport.shm import Layout

    create, _, unlink = backend
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the timing section's cached blocks: the arenas are cudaMalloc'd
    layers = _e2e_layers(device, shape, args.small, args.e2e_layers)
    config = make_hf_config(
        "qwen3_5_moe",
        num_layers=layers,
        hidden=shape.hidden,
        intermediate=shape.inter,
        num_experts=shape.experts,
        mtp_layers=0,
    )
    ctx = mp.get_context("spawn")
    procs, arenas, result = [], [], {"layers": layers, "rounds": []}
    try:
        plan0 = plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt="bf16"))
        staging = create(
            f"refitd-check-staging-{args.seed}",
            Layout.build((i.name, i.dtype, i.shape) for i in plan0.inputs),
        )
        arenas.append(staging)
        result["staging_bytes"] = sum(i.nbytes for i in plan0.inputs)
        ends = {}
        for name, target in (("trainer", _trainer_main), ("engine", _engine_main)):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, str(device)), daemon=True, name=f"gpu-check-{name}")
            p.start()
            procs.append(p)
            ends[name] = parent
        t0 = time.perf_counter()
        _send(ends["trainer"], {"staging": staging.handle(), "seed": args.seed})
        reply = _recv(ends["trainer"], 900)
        if not reply.get("ok"):
            raise RuntimeError(f"trainer failed: {reply.get('error')}\n{reply.get('trace', '')}")
        result["trainer"] = {
            "write_s": reply["write_s"],
            "bytes": reply["bytes"],
            "wall_s": time.perf_counter() - t0,
        }
        inputs = staging.tensors()
        for fmt in args.e2e_formats:
            plan = plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
            published = create(
                f"refitd-check-{fmt}-{args.seed}",
                Layout.build((o.name, o.dtype, o.shape) for o in plan.outputs),
            )
            arenas.append(published)
            outputs = published.tensors()
            step_s = []
            for _ in range(2):  # the first step also checks the outputs and builds pointer tables
                t1 = time.perf_counter()
                on_kernels = _quantize_step(plan, inputs, outputs, run_unit, device)
                step_s.append(time.perf_counter() - t1)
            sample = _e2e_sample_check(plan, inputs, outputs, Format.parse(fmt))
            checksums = _checksums(outputs)
            _send(ends["engine"], {"published": published.handle(), "checksums": checksums})
            reply = _recv(ends["engine"], 900)
            result["rounds"].append(
                {
                    "fmt": fmt,
                    "units": len(plan.units),
                    "units_on_kernels": on_kernels,
                    "quantize_s": step_s[1],
                    "first_step_s": step_s[0],
                    "bytes_in": sum(u.bytes_in for u in plan.units),
                    "bytes_out": sum(o.nbytes for o in plan.outputs),
                    "sample_layer_exact": sample,
                    "engine": reply,
                    "ok": bool(reply.get("ok")) and sample,
                }
            )
            del outputs
            published.close()
            unlink(published)
            arenas.remove(published)
        _send(ends["engine"], {"stop": True})
        result["ok"] = all(r["ok"] for r in result["rounds"])
        result["status"] = "ran"
    except Exception as err:
        result.update(ok=False, status=f"error: {type(err).__name__}: {err}", trace=traceback.format_exc())
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        for a in arenas:
            a.close()
            unlink(a)
    return result


def _quantize_step(plan, inputs, outputs, run_unit, device) -> int:
    """Every unit of the plan, on the kernels where they take it; returns how many they took."""
    on_kernels = 0
    for unit in plan.units:
        if kernels.try_run_unit(unit, inputs, outputs):
            on_kernels += 1
        else:
            run_unit(unit, inputs, outputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return on_kernels


def _e2e_sample_check(plan, inputs, outputs, fmt: Format) -> bool:
    """Layer 0's quantized outputs equal the torch reference's, byte for byte."""
    from sidecar.plan import Role

    for o in plan.outputs:
        if o.role is not Role.WEIGHT or o.expert is None or ".layers.0." not in o.name:
            continue
        x = o.source_view(inputs[o.source])
        if fmt is Format.FP8_PER_TENSOR:
            rq, rs = quant.quantize_fp8_per_tensor(
                x, scale=quant.fp8_per_tensor_scale(inputs[o.source][o.expert])
            )
        else:
            rq, rs = quant.quantize(x, fmt)
        if not (
            torch.equal(_bits(rq), _bits(outputs[o.name]))
            and torch.equal(_bits(rs), _bits(outputs[o.scale_name]))
        ):
            return False
    return True


# --------------------------------------------------------------------------------------------------
# report


def _fmt_row(cells, widths) -> str:
    return "  ".join(str(c)[:w].ljust(w) for c, w in zip(cells, widths))


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"refitd gpu_check on {meta['device_name']} (torch {meta['torch']}, triton {meta['triton']}), seed {meta['seed']}"
    )
    checks = report["correctness"]
    ran = [c for c in checks if c.get("ok") is not None]
    failed = [c for c in ran if not c["ok"]]
    skipped = sorted({c["status"] for c in checks if c.get("ok") is None})
    print(
        f"\ncorrectness: {len(ran) - len(failed)}/{len(ran)} passed"
        + (f"; {'; '.join(skipped)}" if skipped else "")
    )
    for c in failed[:30]:
        print(
            "  FAIL",
            _fmt_row(
                [c["impl"], c["fmt"], c["case"], c.get("status") or c.get("first") or ""], [22, 15, 34, 80]
            ),
        )
    t = report.get("timing", {})
    if "copy" in t:
        layer = t["layer"]
        print(
            f"\ntiming: gate_up {layer['gate_up']} + down {layer['down']} bf16 ({layer['bf16_bytes'] / GiB:.2f} GiB)"
        )
        print(f"  copy: {t['copy']['ms']:.3f} ms, {t['copy']['gbps']:.1f} GB/s (read + written)")
        print("  " + _fmt_row(["format", "what", "ms", "GB/s", "of copy", "note"], [15, 40, 9, 8, 8, 30]))
        for r in t["rows"]:
            if "ms" not in r:
                print(
                    "  "
                    + _fmt_row(
                        [r["fmt"], r["what"], "-", "-", "-", r.get("status", "")], [15, 40, 9, 8, 8, 60]
                    )
                )
                continue
            note = []
            if "exact" in r:
                note.append("exact" if r["exact"] else "NOT EXACT")
            if "mismatched_bytes" in r:
                note.append(f"{r['mismatched_bytes']} bytes differ" if r["mismatched_bytes"] else "exact")
                note.append(f"compile {r['compile_s']:.0f} s")
            if "call_ms_with_sync" in r:
                note.append(f"call+sync {r['call_ms_with_sync']:.3f} ms")
            cells = [
                r["fmt"],
                r["what"],
                f"{r['ms']:.3f}",
                f"{r['gbps']:.0f}",
                f"{100 * r['of_copy']:.0f}%",
                ", ".join(note),
            ]
            print("  " + _fmt_row(cells, [15, 40, 9, 8, 8, 60]))
    elif t:
        print(f"\ntiming: {t.get('status')}")
    e2e = report.get("e2e", {})
    print(f"\ne2e: {e2e.get('status')}")
    for r in e2e.get("rounds", []):
        eng = r["engine"]
        print(
            f"  {r['fmt']:<15} {e2e['layers']} layers, {r['bytes_in'] / GiB:.2f} GiB in -> {r['bytes_out'] / GiB:.2f} GiB: "
            f"quantize {r['quantize_s'] * 1e3:.1f} ms (first step {r['first_step_s'] * 1e3:.0f} ms; "
            f"{r['units_on_kernels']}/{r['units']} units on kernels), "
            f"engine load {eng.get('load_ms', float('nan')):.1f} ms, {'ok' if r['ok'] else 'FAILED ' + str(eng.get('mismatched') or eng.get('error'))}"
        )


# --------------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU dry run)")
    ap.add_argument("--dry-run", action="store_true", help="same as --device cpu --small")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default bench/results/gpu-check-<device>.json)"
    )
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for cuda")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="time the default tiles only")
    ap.add_argument("--skip", nargs="*", default=[], choices=["correctness", "timing", "e2e"])
    ap.add_argument("--e2e-layers", type=int, default=None, help="default: as many as fit (40 at most)")
    ap.add_argument("--e2e-formats", nargs="*", default=[f.value for f in FORMATS])
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.small = "cpu", True
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.compile = args.compile == "on" or (args.compile == "auto" and args.device.type == "cuda")
    args.seed = random.getrandbits(31) if args.seed is None else args.seed
    if args.small:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    args.out = args.out or ROOT / "bench" / "results" / f"gpu-check-{args.device.type}.json"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = SMALL if args.small else QWEN35
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    meta = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "seed": args.seed,
        "small": args.small,
        "iters": args.iters,
        "warmup": args.warmup,
        "default_configs": {f.value: repr(c) for f, c in kernels.DEFAULT_CONFIGS.items()},
    }
    impls = implementations(device)
    report: dict[str, Any] = {"meta": meta, "correctness": []}
    t0 = time.perf_counter()
    if "correctness" not in args.skip:
        report["correctness"] += check_random(impls, device, args.small, args.seed)
        report["correctness"] += check_non_finite(impls, device)
        report["correctness"] += check_table(impls, device)
    meta["correctness_s"] = time.perf_counter() - t0
    if "timing" not in args.skip:
        try:
            report["timing"] = timing_section(device, shape, args, impls)
            report["correctness"] += report["timing"].pop("checks")
        except Exception as err:
            report["timing"] = {
                "status": f"error: {type(err).__name__}: {err}",
                "trace": traceback.format_exc(),
            }
    meta["timing_s"] = time.perf_counter() - t0 - meta["correctness_s"]
    if "e2e" not in args.skip:
        report["e2e"] = run_e2e(device, shape, args)
    meta["total_s"] = time.perf_counter() - t0
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    failed = [c for c in report["correctness"] if c.get("ok") is False]
    e2e_failed = report.get("e2e", {}).get("ok") is False
    timing_failed = "status" in report.get("timing", {})
    return 1 if failed or e2e_failed or timing_failed else 0


if __name__ == "__main__":
    sys.exit(main())
