"""One command on a one-GPU machine: the Triton kernels checked and timed, and a colocated refit.

On the GPU machine (no network, no pyzmq there: ``make gpu-wheels`` here fills ``.whl/`` with the
wheels for its Python; only the e2e section needs pyzmq, in its own processes)::

    bash bench/gpu_run.sh --out bench/results/gpu-h200.json   # pip install --no-index --target, then this

It prints the environment first (Python, torch, Triton, driver, cuda-bindings, GPU), runs what the
packages it finds allow (saying what it skipped and why), and rewrites the JSON as each section
ends; e2e rounds not started within ``--minutes`` (8) are skipped, so a default run ends in ~9.

Here, the same code paths on CPU torch (shared-memory arenas, tiny shapes, under a minute)::

    python bench/gpu_check.py --device cpu --small

Five sections, each recorded even when another fails:

1. **correctness**: every kernel against the torch reference run on the same device, byte for byte
   (values through ``.view(torch.uint8)``, scales exact), on fresh random slabs (ragged and batched
   shapes, fp16/fp32, a strided view, a zeroed 128x128 block, one NaN), the edge-case table of
   sidecar/numerics/cases.py, and every timed Qwen3.5 layer. The GPU reference itself is checked against
   the CPU reference (docs/spec.md §0's division trap: it divides by device tensors, never Python scalars).
2. **timing** on a Qwen3.5-35B-A3B layer's routed experts (gate_up ``[256, 1024, 2048]`` + down
   ``[256, 2048, 512]``, bf16): a device-to-device copy of the same bytes, the torch reference per
   expert (as ``run_unit`` calls it) and batched, ``torch.compile`` of the reference, the kernels
   with their default tiles and a small sweep of others. CUDA events, warm-up, median of N. GB/s
   counts bytes moved (bf16 read + fp8 and scales written; the copy: read + written) and each row's
   fraction of the copy's GB/s (target: kernels >= 90%).
3. **e2e**: the real colocated path, once per format: ``python -m sidecar.cli serve --arena cuda
   --gpu 0 --hf-config <synthetic Qwen3.5-35B-A3B-shaped config.json> --world-size 1 --format F``
   in a subprocess (``--arena shm`` on CPU); a trainer process that builds BF16 weights on the GPU
   and pushes 2 steps with ``RefitClient(..., local=True).push_step(step, weights, wait="loaded")``
   (device-to-device into the staging arena); an engine process whose ``EngineWorker`` copies every
   published tensor into buffers allocated at attach and checks them (byte sums, and layer 0 against
   ``sidecar.numerics.reference`` on the same GPU). Routed experts at full size, as many layers as fit in free
   memory (trainer weights + staging, a ring of 4 layer groups on GPU by default (``--staging-regions``),
   + 2 generations + the engine's copy). Each phase's seconds
   (trainer -> staging copy, quantize, publish, from the StepResult; engine load) against the floor:
   the bytes each stage must read and write (staging: bf16 x 2; quantize: bf16 + published; engine:
   published x 2) over the copy bandwidth measured in the same run; target: within 2x. An e2e
   failure is recorded in the JSON; the other sections' results are still written.

2b. **fourbit** (bench/gpu_fourbit.py): the daemon's CUDA quantize path in NVFP4 (both names), MXFP4
   and INT4 (group 32 bf16, group 128 float32) on the same layer: the Triton slab kernels byte for
   byte against the torch reference on the device, each one's ms and fraction of a plain device
   copy of the same bytes (same run), and the peak device memory each allocates beyond the rings.
   Skipped kernels (CPU) are reported with the reason; ``--skip fourbit`` leaves the section out.

4. **tiers** (bench/gpu_tiers.py): the daemon's own arenas for a Qwen3.5-35B-A3B-shaped model
   (``--tiers-layers``, 4) with generations in page-locked host memory: the peak device memory
   against ``--tiers-budget`` (4 GiB) while a step streams through the staging and publish rings,
   byte-exactness of sampled groups, and the H2D rate of an engine load from the page-locked host
   generation against a plain pinned ``copy_`` of the same bytes, in the same run. On a device with
   several GPUs it then streams the same step on one GPU and on all of them (bench/gpu_spread.py:
   groups round-robin, one thread per GPU) and compares the time, each GPU's arenas against the
   budget and the two generations byte for byte; skipped on one GPU. On CPU it plans only.

Prints a table and writes JSON (``--out``). Exit status 0 when every check that ran passed. This
process imports neither pyzmq nor NIXL (the kernel and timing sections run without them); the
daemon, trainer and engine processes of the e2e section import pyzmq themselves.
"""

from __future__ import annotations

import argparse
import contextlib
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
for _p in (ROOT,):  # the repo (no install needed on the GPU machine); no test file is imported
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from sidecar.numerics import kernels  # noqa: E402
from sidecar.numerics import reference as quant  # noqa: E402
from sidecar.numerics.formats import FLT_MIN, FP8_DTYPE, FP8_FORMATS, FP8_MAX, Format  # noqa: E402


def _load_sibling(name: str):
    """bench/<name>.py as a module (bench/ is not put on sys.path: its transport.py would shadow
    the repo's transport package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"refitd_bench_{name}", Path(__file__).with_name(f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_tiers = _load_sibling("gpu_tiers")  # the memory-tier section
gpu_fourbit = _load_sibling("gpu_fourbit")  # the 4-bit section
FORMATS = list(FP8_FORMATS)  # what the Triton kernels cover
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
    """sidecar/numerics/cases.py through each implementation on ``device``, against the CPU reference."""
    from sidecar.numerics.cases import CASES

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
# section 3: end-to-end colocated refit (trainer process -> `refitd serve` -> engine process)
#
# The main process imports neither pyzmq nor NIXL: the daemon is `python -m sidecar.cli serve` in a
# subprocess, and the trainer (RefitClient) and the engine (EngineWorker) are spawned processes, each
# a fresh interpreter that imports zmq itself.


def _send(conn, msg: dict) -> None:
    import msgpack

    conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


def _recv(conn, timeout: float, proc=None, name: str = "peer") -> dict:
    """The next message on ``conn``; with ``proc`` (the process at the other end), RuntimeError as
    soon as it exits without answering instead of waiting out ``timeout``."""
    from multiprocessing.connection import wait

    import msgpack

    ready = wait([conn] if proc is None else [conn, proc.sentinel], timeout)
    if not ready:
        raise TimeoutError(f"no message from the {name} within {timeout:.0f} s")
    if conn in ready or conn.poll():
        try:
            return msgpack.unpackb(conn.recv_bytes(), raw=False)
        except EOFError:
            pass
    if proc is not None:
        proc.join(5)
    status = "" if proc is None else f" with status {proc.exitcode}"
    raise RuntimeError(f"the {name} process exited{status} without answering (see its output above)")


@dataclass
class Child:
    """A spawned trainer or engine process and the parent's end of its pipe."""

    name: str
    conn: Any
    proc: Any

    @classmethod
    def spawn(cls, ctx, name: str, target, *args) -> Child:
        """Start ``target(child_end, *args)``; the parent closes its copy of the child's end, so a
        dead child is seen (EOF, and its sentinel) instead of waited on until a timeout."""
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=f"gpu-check-{name}")
        proc.start()
        child.close()
        return cls(name, parent, proc)

    def send(self, msg: dict) -> None:
        _send(self.conn, msg)

    def recv(self, timeout: float) -> dict:
        return _recv(self.conn, timeout, self.proc, self.name)


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Byte sum of each tensor, with one host sync for all of them."""
    sums = [t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64) for t in tensors.values()]
    return dict(zip(tensors, torch.stack(sums).tolist())) if sums else {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _e2e_plan(config: dict, fmt: str):
    from sidecar.plan.build import RefitSpec, plan_from_hf_config

    return plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))


def _e2e_config(shape: LayerShape, layers: int) -> dict:
    from sidecar.cli.demo.synthetic import make_hf_config

    return make_hf_config(
        "qwen3_5_moe",
        num_layers=layers,
        hidden=shape.hidden,
        intermediate=shape.inter,
        num_experts=shape.experts,
        mtp_layers=0,
    )


def _fill(t: torch.Tensor, name: str, seed: int, step: int) -> torch.Tensor:
    """``t`` filled with step ``step``'s weight ``name``: deterministic, so the engine can redo it."""
    import zlib

    g = torch.Generator(device=t.device).manual_seed(
        (seed * 1_000_003 + step * 7919 + zlib.crc32(name.encode())) % 2**62
    )
    return t.normal_(0.0, 0.02, generator=g)


def _trainer_main(conn, device: str) -> None:
    """Trainer process: BF16 weights built on ``device``; each step pushed with
    ``RefitClient(local=True).push_step(..., wait="loaded")``; the StepResults sent back."""
    from sidecar.client.client import RefitClient

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    weights: dict[str, torch.Tensor] = {}
    while True:
        msg = _recv(conn, 3600)
        if msg.get("stop"):
            return
        try:
            plan = _e2e_plan(msg["config"], "bf16")
            if set(weights) != {i.name for i in plan.inputs}:
                weights.clear()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                weights.update({i.name: torch.empty(i.shape, dtype=i.dtype, device=dev) for i in plan.inputs})
            steps = []
            with RefitClient(msg["endpoint"], 0, 1, local=True, timeout=msg["timeout"]) as client:
                for step in range(msg["steps"]):
                    for name, t in weights.items():  # per tensor (per layer), on the device
                        _fill(t, name, msg["seed"], step)
                    _sync(dev)
                    t0 = time.perf_counter()
                    res = client.push_step(step, weights, wait="loaded", timeout=msg["timeout"])
                    wall = time.perf_counter() - t0
                    steps.append(
                        {
                            "step": res.step,
                            "generation": res.generation,
                            "bytes_in": res.bytes_in,
                            "bytes_out": res.bytes_out,
                            "seconds": dict(res.seconds),
                            "loads": list(res.loads),
                            "wall_s": wall,
                        }
                    )
            _send(conn, {"ok": True, "steps": steps})
        except Exception as err:
            _send(
                conn, {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
            )


def _engine_check(
    plan, gen_tensors, buffers, fmt: Format, seed: int, step: int, device
) -> tuple[list[str], int]:
    """(names that fail, how many layer-0 outputs were compared): every buffer's byte sum against
    the generation's, and layer 0's outputs against ``sidecar.numerics.reference`` run on this device over the
    regenerated BF16 inputs (passthroughs byte for byte against their source)."""
    want = _checksums(dict(gen_tensors))
    got = _checksums(buffers)
    bad = [n for n in buffers if got.get(n) != want.get(n)]
    sources = {o.source for o in plan.outputs if ".layers.0." in o.source}
    specs = {i.name: i for i in plan.inputs if i.name in sources}
    inputs = {
        n: _fill(torch.empty(s.shape, dtype=s.dtype, device=device), n, seed, step) for n, s in specs.items()
    }
    from sidecar.plan.build import Role

    sampled = 0
    for o in plan.outputs:
        if o.source not in inputs or o.role is Role.SCALE:
            continue
        x = o.source_view(inputs[o.source])
        if o.role is Role.PASSTHROUGH:
            same = torch.equal(_bits_any(x.to(o.dtype)), _bits_any(buffers[o.name]))
        else:
            if fmt is Format.FP8_PER_TENSOR:
                scale = quant.fp8_per_tensor_scale(inputs[o.source][o.expert])
                rq, rs = quant.quantize_fp8_per_tensor(x, scale=scale)
            else:
                rq, rs = quant.quantize(x, fmt)
            same = torch.equal(_bits(rq), _bits(buffers[o.name])) and torch.equal(
                _bits(rs.reshape(buffers[o.scale_name].shape)), _bits(buffers[o.scale_name])
            )
        if not same:
            bad.append(o.name)
        sampled += 1
    return bad, sampled


def _bits_any(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _engine_main(conn, device: str) -> None:
    """Engine process: an ``EngineWorker`` whose load copies every published tensor into buffers it
    allocated at attach (device to device on a GPU), then checks them (:func:`_engine_check`)."""
    from adapters.engine import EngineWorker
    from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    while True:
        msg = _recv(conn, 3600)
        if msg.get("stop"):
            return
        worker = None
        try:
            fmt = Format.parse(msg["fmt"])
            plan = _e2e_plan(msg["config"], msg["fmt"])
            buffers = {o.name: torch.empty(o.shape, dtype=o.dtype, device=dev) for o in plan.outputs}
            copies: dict[int, dict[str, Any]] = {}

            def load(gen, plan=plan, buffers=buffers, copies=copies, fmt=fmt, seed=msg["seed"]):
                t0 = time.perf_counter()
                for name, t in gen.tensors.items():
                    buffers[name].copy_(t, non_blocking=True)
                _sync(dev)
                copy_s = time.perf_counter() - t0
                bad, sampled = _engine_check(plan, gen.tensors, buffers, fmt, seed, gen.step, dev)
                nbytes = sum(t.numel() * t.element_size() for t in gen.tensors.values())
                copies[gen.step] = {
                    "copy_s": copy_s,
                    "bytes": nbytes,
                    "tensors": len(gen.tensors),
                    "mismatched": bad[:10],
                    "sampled": sampled,
                }
                if len(gen.tensors) != len(buffers):
                    raise ValueError(f"{len(gen.tensors)} tensors published, {len(buffers)} expected")
                if bad:
                    raise ValueError(f"{len(bad)} tensors differ, e.g. {bad[:3]}")

            manifest = Manifest(
                engine=EngineKind.REFERENCE,
                engine_version="gpu-check",
                moe_backend="none",
                expert_format=fmt,
                tensors=tuple(ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs),
            )
            worker = EngineWorker(
                msg["endpoint"], name="gpu-check-engine", manifest=manifest, load=load, timeout=msg["timeout"]
            )
            worker.attach(timeout=msg["timeout"])
            _send(conn, {"attached": True})
            results = []
            for step in range(msg["steps"]):
                r = worker.load_next(min_step=step, timeout=msg["timeout"])
                results.append({**r.to_dict(), **copies.get(r.step, {})})
            _send(conn, {"ok": all(r["ok"] for r in results), "steps": results})
        except Exception as err:
            _send(
                conn, {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
            )
        finally:
            if worker is not None:
                worker.detach()
            buffers = copies = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def _e2e_layers(
    device: torch.device, shape: LayerShape, small: bool, requested: int | None, regions: int = 0
) -> int:
    """As many Qwen3.5 layers (40 at most) as fit in free GPU memory: the trainer's BF16 weights, the
    daemon's staging (all of them, or ``regions`` layer groups of a staging ring), two published
    generations and the engine's copy of one, with headroom for four CUDA contexts and the engine's
    layer-0 check."""
    if requested:
        return requested
    if small or device.type != "cuda":
        return 2
    from sidecar.daemon.memory.staging import region_size, ring_groups

    one, two = (_e2e_plan(_e2e_config(shape, n), "mxfp8") for n in (1, 2))  # mxfp8: the most scale bytes

    def need(plan) -> int:
        bf16 = sum(i.nbytes for i in plan.inputs)
        staging = regions * region_size(ring_groups(plan)) if regions else bf16
        return bf16 + staging + 3 * sum(o.nbytes for o in plan.outputs)

    per_layer, base = need(two) - need(one), 2 * need(one) - need(two)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(40, int((free - 12 * GiB - base) // per_layer)))


def _copy_gbps(device: torch.device, nbytes: int) -> float:
    """Copy bandwidth (bytes read + written per second, in GB/s) of a ``nbytes`` buffer on ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = statistics.median(timer(device, 2, 10)(lambda a=dst, b=src: a.copy_(b)))
    src = dst = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _zmq_reason() -> str | None:
    """Why the trainer and engine processes cannot run (pyzmq or msgpack missing), or None. Asked
    in a subprocess: this process never imports zmq."""
    return _import_reason("import zmq, msgpack")


#: exits non-zero with the reason when the daemon could not allocate CUDA-IPC arenas here
_CUDA_IPC_CHECK = (
    "import sys\n"
    "from transport.cuda_driver import cuda_unavailable_reason\n"
    "r = cuda_unavailable_reason()\n"
    "sys.exit(r) if r else None\n"
)


def _import_reason(code: str) -> str | None:
    """Run ``code`` in a fresh interpreter (the children's environment); the last line of its
    error output when it fails, else None."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), cwd=ROOT, check=False
    )
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def _child_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _staging_regions(device: torch.device, args) -> int:
    """The daemon's staging ring in effect: ``--staging-regions``, else its default for the arena."""
    from sidecar.config.settings import DEFAULT_GPU_REGIONS

    if args.staging_regions is not None:
        return args.staging_regions
    return DEFAULT_GPU_REGIONS if device.type == "cuda" else 0


def _start_daemon(
    run_dir: Path, config_path: Path, fmt: str, device: torch.device, log: Path, regions: int = 0
):
    import subprocess

    cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(run_dir)]
    cmd += ["--hf-config", str(config_path), "--world-size", "1", "--format", fmt, "--log-level", "warning"]
    cmd += ["--staging-regions", str(regions)]
    if device.type == "cuda":
        cmd += [
            "--arena",
            "cuda",
            "--gpu",
            str(device.index if device.index is not None else torch.cuda.current_device()),
            # this section measures the device tier end to end (generations on the GPU, engines
            # copying device to device), as before the memory tiers; the tiers section measures
            # host-resident generations. The budget: the whole GPU (_e2e_layers sized the model)
            *("--generation-residency", "device"),
            *("--device-budget", str(torch.cuda.get_device_properties(device).total_memory)),
        ]
    else:
        cmd += ["--arena", "shm"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_child_env(), cwd=ROOT)
    return proc, cmd


def _stop_daemon(proc) -> int | None:
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def _stage_floor(step: dict[str, Any], gbps: float) -> dict[str, float]:
    """Seconds each stage needs at the copy bandwidth: the bytes it must read and write."""
    bw = gbps * 1e9
    bin_, bout = step["bytes_in"], step["bytes_out"]
    floor = {"copy": 2 * bin_ / bw, "quantize": (bin_ + bout) / bw, "load": 2 * bout / bw}
    floor["total"] = sum(floor.values())
    return floor


def _e2e_round(
    fmt: str, config: dict, ends: dict, tmp: Path, device: torch.device, args, gbps: float
) -> dict:
    """One daemon (``--format fmt``), one engine attach, ``args.e2e_steps`` trainer steps."""
    timeout = args.e2e_timeout
    run_dir, log = tmp / f"run-{fmt}", tmp / f"daemon-{fmt}.log"
    config_path = tmp / "config.json"
    daemon, cmd = _start_daemon(run_dir, config_path, fmt, device, log, _staging_regions(device, args))
    out: dict[str, Any] = {"fmt": fmt, "daemon": " ".join(cmd[1:]), "ok": False}
    try:
        sock = run_dir / "control.sock"
        deadline = time.monotonic() + timeout
        while not sock.exists():
            if daemon.poll() is not None:
                raise RuntimeError(
                    f"the daemon exited with status {daemon.returncode}: {log.read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon made no {sock} within {timeout:.0f} s")
            time.sleep(0.05)
        job = {
            "endpoint": f"ipc://{sock}",
            "config": config,
            "steps": args.e2e_steps,
            "seed": args.seed,
            "timeout": timeout,
        }
        ends["engine"].send({**job, "fmt": fmt})
        attached = ends["engine"].recv(timeout + 30)
        if not attached.get("attached"):
            raise RuntimeError(f"engine: {attached.get('error')}\n{attached.get('trace', '')}")
        ends["trainer"].send(job)
        trainer = ends["trainer"].recv(timeout * (args.e2e_steps + 1))
        engine = ends["engine"].recv(timeout)
        if not trainer.get("ok"):
            raise RuntimeError(f"trainer: {trainer.get('error')}\n{trainer.get('trace', '')}")
        if not engine.get("ok"):
            raise RuntimeError(
                f"engine: {engine.get('error') or engine.get('steps')}\n{engine.get('trace', '')}"
            )
        steps = []
        for t, e in zip(trainer["steps"], engine["steps"]):
            sec = t["seconds"]
            floor = _stage_floor(t, gbps)
            steps.append(
                {
                    "step": t["step"],
                    "bytes_in": t["bytes_in"],
                    "bytes_out": t["bytes_out"],
                    "daemon_seconds": sec,
                    "copy_s": sec.get("receive"),
                    "quantize_s": sec.get("quantize"),
                    "quantize_tail_s": sec.get("quantize_tail"),
                    "publish_s": sec.get("publish"),
                    "engine_load_s": e.get("copy_s"),
                    "engine_check_s": (e.get("seconds") or 0.0) - (e.get("copy_s") or 0.0),
                    "total_s": t["wall_s"],
                    "floor_s": floor,
                    "of_floor": t["wall_s"] / floor["total"],
                    "loads": t["loads"],
                    "engine": e,
                }
            )
        out.update(steps=steps, ok=all(s["engine"]["ok"] for s in steps) and len(steps) == args.e2e_steps)
    except Exception as err:
        out.update(status=f"error: {type(err).__name__}: {err}", trace=traceback.format_exc())
    finally:
        code = _stop_daemon(daemon)
        if code:
            out.update(ok=False, daemon_exit=code, daemon_log=log.read_text()[-4000:])
    return out


def run_e2e(device: torch.device, shape: LayerShape, args) -> dict[str, Any]:
    """The real colocated path, once per format: ``refitd serve --arena cuda|shm`` in a subprocess,
    a trainer process pushing ``args.e2e_steps`` steps with ``RefitClient(local=True)`` and
    ``wait="loaded"``, an engine process loading each generation through ``EngineWorker``. Returns
    each step's phase seconds against the floor, or {"status": "skipped: <reason>"} / an error."""
    import multiprocessing as mp
    import tempfile

    reason = _zmq_reason()
    if reason:
        return {"status": f"skipped: pyzmq/msgpack not importable ({reason})", "ok": None}
    if device.type == "cuda" and (reason := _import_reason(_CUDA_IPC_CHECK)):
        return {"status": f"skipped: the daemon's CUDA-IPC arenas cannot run ({reason})", "ok": None}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the timing section's cached blocks: the daemon's arenas are cudaMalloc'd
    result: dict[str, Any] = {"rounds": []}
    procs, ends = [], {}
    try:
        regions = _staging_regions(device, args)
        layers = _e2e_layers(device, shape, args.small, args.e2e_layers, regions)
        result["staging_regions"] = regions
        config = _e2e_config(shape, layers)
        result.update(layers=layers, shape=[shape.experts, shape.inter, shape.hidden])
        gbps = _copy_gbps(device, GiB if device.type == "cuda" and not args.small else (16 << 20))
        result["copy_gbps"] = gbps
        ctx = mp.get_context("spawn")
        for name, target in (("trainer", _trainer_main), ("engine", _engine_main)):
            ends[name] = Child.spawn(ctx, name, target, str(device))
            procs.append(ends[name].proc)
        with tempfile.TemporaryDirectory(prefix="refitd-gpu-check-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            for fmt in args.e2e_formats:
                if time.monotonic() > args.deadline:
                    result["rounds"].append(
                        {
                            "fmt": fmt,
                            "ok": None,
                            "status": f"skipped: past the --minutes {args.minutes:g} budget",
                        }
                    )
                    continue
                result["rounds"].append(_e2e_round(fmt, config, ends, Path(tmp), device, args, gbps))
        ran = [r for r in result["rounds"] if r["ok"] is not None]
        result["ok"] = bool(ran) and all(r["ok"] for r in ran)
        result["status"] = "ran"
    except Exception as err:
        result.update(ok=False, status=f"error: {type(err).__name__}: {err}", trace=traceback.format_exc())
    finally:
        for end in ends.values():
            with contextlib.suppress(Exception):
                end.send({"stop": True})
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return result


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
    print_e2e(report.get("e2e", {}))


def print_e2e(e2e: dict[str, Any]) -> None:
    """Each step's phases (ms) against the floor: the bytes each stage must read and write over the
    copy bandwidth measured in the same run."""
    print(f"\ne2e: {e2e.get('status')}")
    if "layers" in e2e:
        print(
            f"  {e2e['layers']} layers of [experts, I, H] = {e2e['shape']}, copy {e2e.get('copy_gbps', 0):.1f} GB/s"
            " (read + written); ms per phase (quantize: busy / after the last byte), floor in ()"
        )
        widths = [15, 5, 9, 9, 17, 21, 9, 17, 19, 8, 4]
        cols = ["format", "step", "GiB in", "GiB out", "copy->staging", "quantize/tail", "publish"]
        print("  " + _fmt_row([*cols, "engine load", "total", "x floor", "ok"], widths))
    for r in e2e.get("rounds", []):
        if "steps" not in r:
            print(f"  {r['fmt']:<15} FAILED {r.get('status')}")
            continue
        for s in r["steps"]:
            f = s["floor_s"]
            cells = [
                r["fmt"],
                s["step"],
                f"{s['bytes_in'] / GiB:.3f}",
                f"{s['bytes_out'] / GiB:.3f}",
                f"{1e3 * s['copy_s']:.1f} ({1e3 * f['copy']:.1f})",
                f"{1e3 * s['quantize_s']:.1f}/{1e3 * s['quantize_tail_s']:.1f} ({1e3 * f['quantize']:.1f})",
                f"{1e3 * s['publish_s']:.2f}",
                f"{1e3 * s['engine_load_s']:.1f} ({1e3 * f['load']:.1f})",
                f"{1e3 * s['total_s']:.1f} ({1e3 * f['total']:.1f})",
                f"{s['of_floor']:.2f}",
                "ok" if s["engine"].get("ok") else "FAIL",
            ]
            print("  " + _fmt_row(cells, widths))
        last = r["steps"][-1]
        verdict = "meets" if last["of_floor"] <= 2 else "misses"
        print(
            f"  {r['fmt']}: within {last['of_floor']:.2f}x of the floor (step {last['step']}; {verdict} the 2x target)"
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
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["correctness", "timing", "fourbit", "e2e", "tiers"]
    )
    ap.add_argument(
        "--tiers-layers", type=int, default=None, help="tiers: Qwen3.5 layers (default 4; --small 2)"
    )
    ap.add_argument(
        "--tiers-budget", default=None, help="tiers: the device budget (default 4GiB; --small 8MiB)"
    )
    ap.add_argument("--e2e-layers", type=int, default=None, help="default: as many as fit (40 at most)")
    ap.add_argument("--e2e-formats", nargs="*", default=[f.value for f in FORMATS], help="one daemon each")
    ap.add_argument("--e2e-steps", type=int, default=2, help="steps each trainer pushes")
    ap.add_argument(
        "--staging-regions",
        type=int,
        default=None,
        help="the daemon's staging ring (0: whole steps); default: the daemon's (4 on cuda, 0 on shm)",
    )
    ap.add_argument(
        "--e2e-timeout", type=float, default=120.0, help="seconds any one wait of the e2e section may take"
    )
    ap.add_argument(
        "--minutes",
        type=float,
        default=8.0,
        help="wall-clock budget: e2e rounds not started by then are skipped (recorded as such)",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.small = "cpu", True
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.compile = args.compile == "on" or (args.compile == "auto" and args.device.type == "cuda")
    args.seed = random.getrandbits(31) if args.seed is None else args.seed
    if args.small:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    args.out = args.out or ROOT / "bench" / "results" / f"gpu-check-{args.device.type}.json"
    from sidecar.config.values import parse_size

    args.tiers_layers = args.tiers_layers or (2 if args.small else 4)
    args.tiers_budget = parse_size(args.tiers_budget or ("8MiB" if args.small else "4GiB"))
    args.deadline = time.monotonic() + 60 * args.minutes  # later e2e rounds are skipped past it
    return args


def _version(module: str, dist: str | None = None) -> str:
    """``module``'s version, or why it cannot be imported (the check then skips what needs it)."""
    from importlib import metadata

    try:
        mod = __import__(module, fromlist=["_"])
    except Exception as err:  # missing, or broken: either way the sections that need it skip
        return f"missing ({type(err).__name__}: {err})"
    version = getattr(mod, "__version__", None)
    if version is None and dist is not None:
        with contextlib.suppress(metadata.PackageNotFoundError):
            version = metadata.version(dist)
    return str(version or "installed")


def _driver_version() -> str:
    """The NVIDIA driver's CUDA version (cuDriverGetVersion through libcuda), without cuda-bindings."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return "libcuda.so.1 loaded, cuDriverGetVersion failed"
        return f"CUDA {v.value // 1000}.{v.value % 1000 // 10}"
    except OSError as err:
        return f"none ({err})"


def environment(device: torch.device) -> dict[str, str]:
    """What this run stands on, printed before anything runs (and kept in the JSON): Python, torch,
    Triton, NumPy, the driver, cuda-bindings and cuda-pathfinder, pyzmq, msgpack, the GPU. pyzmq is
    asked in a subprocess: this process never imports it."""
    env = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "driver": _driver_version(),
        "cuda-bindings": _version("cuda.bindings", "cuda-bindings"),
        "cuda-pathfinder": _version("cuda.pathfinder", "cuda-pathfinder"),
        "msgpack": _version("msgpack", "msgpack"),
        "pyzmq": "importable" if (r := _import_reason("import zmq")) is None else f"missing ({r})",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
    }
    if device.type == "cuda":
        env["quantizer"] = kernels.unavailable_reason(device) or "triton kernels (probe launch passed)"
    return env


def _write(path: Path, report: dict[str, Any]) -> None:
    """The report so far, on disk: a section that fails or a run that is killed keeps the rest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


def _section(report: dict[str, Any], name: str, fn: Callable[[], Any], out: Path) -> None:
    """Run one section into ``report[name]``; an exception is recorded there (as an error row for
    the correctness list) and the run goes on. The JSON is rewritten after each section."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as err:  # recorded; later sections still run and the JSON is still written
        error = {"status": f"error: {type(err).__name__}: {err}", "trace": traceback.format_exc()}
        if name == "correctness":
            report[name].append({"impl": "-", "fmt": "-", "case": "section", "ok": False, **error})
        else:
            report[name] = {"ok": False, **error}
        print(f"{name}: {error['status']}", flush=True)
    else:
        if name == "correctness":
            report[name] += result
        else:
            report[name] = result
    report["meta"][f"{name}_s"] = report["meta"].get(f"{name}_s", 0.0) + time.perf_counter() - t0
    _write(out, report)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = SMALL if args.small else QWEN35
    env = environment(device)
    print("environment:", flush=True)
    for k, v in env.items():
        print(f"  {k:16s} {v}", flush=True)
    meta = {
        "device": str(device),
        "device_name": env["gpu"] if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": None if env["triton"].startswith("missing") else env["triton"],
        "environment": env,
        "seed": args.seed,
        "small": args.small,
        "iters": args.iters,
        "warmup": args.warmup,
        "default_configs": {f.value: repr(c) for f, c in kernels.DEFAULT_CONFIGS.items()},
    }
    impls = implementations(device)
    report: dict[str, Any] = {"meta": meta, "correctness": []}
    t0 = time.perf_counter()
    _write(args.out, report)
    if "correctness" not in args.skip:
        _section(report, "correctness", lambda: check_random(impls, device, args.small, args.seed), args.out)
        _section(report, "correctness", lambda: check_non_finite(impls, device), args.out)
        _section(report, "correctness", lambda: check_table(impls, device), args.out)
    if "timing" not in args.skip:
        _section(report, "timing", lambda: timing_section(device, shape, args, impls), args.out)
        if "checks" in report["timing"]:
            report["correctness"] += report["timing"].pop("checks")
    if "fourbit" not in args.skip:
        _section(report, "fourbit", lambda: gpu_fourbit.fourbit_section(device, shape, args, timer), args.out)
    if "e2e" not in args.skip:
        report["e2e"] = {"status": "running"}
        _section(report, "e2e", lambda: run_e2e(device, shape, args), args.out)
    if "tiers" not in args.skip:
        _section(report, "tiers", lambda: gpu_tiers.tiers_section(device, args), args.out)
    meta["total_s"] = time.perf_counter() - t0
    print_report(report)
    if "fourbit" in report:
        gpu_fourbit.print_fourbit(report["fourbit"])
    if "tiers" in report:
        gpu_tiers.print_tiers(report["tiers"])
    _write(args.out, report)
    print(f"\nwrote {args.out}")
    failed = [c for c in report["correctness"] if c.get("ok") is False]
    e2e_failed = report.get("e2e", {}).get("ok") is False
    tiers_failed = report.get("tiers", {}).get("ok") is False
    tiers_failed = tiers_failed or report.get("fourbit", {}).get("ok") is False
    timing_failed = "status" in report.get("timing", {})
    return 1 if failed or e2e_failed or timing_failed or tiers_failed else 0


if __name__ == "__main__":
    sys.exit(main())
