"""The Triton slab kernels (sidecar.numerics.kernels) against the torch reference, as far as each machine allows.

Three tiers, each skipped with its reason where it cannot run:

* host side, everywhere: capability predicate, lazy imports, tile geometry, output checks, pointer
  tables, dispatch declining CPU tensors;
* Triton's CPU interpreter (TRITON_INTERPRET=1), when triton is installed and there is no GPU. It runs
  the real kernels on CPU tensors, and is trusted for: scales (block ``scale_inv``, E8M0 bytes,
  per-tensor scale) byte for byte; the NaN/Inf flag and the tensor and tile it names; where every
  byte lands (each expert's outputs, nothing outside them); and every float32 value *before* the
  fp8 cast. It is NOT trusted for fp8 value bytes: its float32 -> e4m3 cast rounds half up and drops
  the carry out of the mantissa (triton 3.9.0: -31.56 becomes -16, not -32), and its bfloat16 ->
  float32 upcast mangles bf16 subnormals. So values are compared with the reference's pre-cast
  float32 values (from the input as the interpreter loads it) pushed through the interpreter's own
  cast function: that checks our arithmetic bit for bit and leaves the real casts to the GPU tier;
* compiled kernels on a GPU (``kernels.available()``): the shared edge-case table and random slabs,
  every value byte and scale byte against the reference run on the same GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from typing import ClassVar

import numpy as np
import pytest
import torch

from sidecar.numerics import kernels
from sidecar.numerics import reference as quant
from sidecar.numerics.formats import FP8_DTYPE, FP8_FORMATS, Format
from sidecar.numerics.kernels import slab as slab_mod
from sidecar.numerics.kernels.slab import SlabGeometry, TileConfig
from sidecar.plan import launch

QUANTIZED = list(FP8_FORMATS)  # the Triton kernels cover the FP8 formats
#: the interpreter computes in numpy, which warns when a NaN/Inf test input meets a multiply
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in multiply:RuntimeWarning")


def _enable_interpreter() -> str | None:
    """Import Triton and the kernels in interpreter mode; the reason it can't be done, or None.

    TRITON_INTERPRET must be set before the first ``import triton`` (Triton decorates its own
    library functions then). It is set only for that import and kept as a knob inside this
    process, so subprocesses started by other tests do not inherit it.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed: the kernels cannot run here (host-side tests still do)"
    if torch.cuda.is_available():
        return "a GPU is present: the compiled kernels are tested instead of the interpreter"
    if "triton" in sys.modules:
        import triton

        if not triton.knobs.runtime.interpret:
            return "triton was imported before this module could enable its interpreter; run this file alone"
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        from sidecar.numerics.kernels import triton_quant  # noqa: F401  (decorated in interpreter mode)

        triton.knobs.runtime.interpret = True
        from triton.runtime.interpreter import _convert_float, _ir  # noqa: F401  (its casts, modelled below)
    except Exception as err:  # a broken install, or a Triton whose interpreter moved its casts
        return f"the Triton interpreter cannot be used here: {err!r}"
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    return None


NO_INTERPRETER = _enable_interpreter()
NO_GPU = kernels.unavailable_reason()
gpu = pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU))
#: where the kernel tiers run: the GPU if any, else the CPU under the interpreter
DEVICE = "cuda" if NO_GPU is None else "cpu"
EXACT_VALUES = NO_GPU is None  # compiled kernels: value bytes must match the reference exactly


# --------------------------------------------------------------------------------------------------
# helpers: reference results, the interpreter's cast, outputs


def _interp_cast(pre: torch.Tensor) -> torch.Tensor:
    """The interpreter's float32 -> e4m3 cast of ``pre``, as uint8 bytes."""
    import triton.language as tl
    from triton.runtime.interpreter import _convert_float, _ir

    arr = pre.detach().cpu().contiguous().numpy()
    out = _convert_float(arr, tl.float32, tl.float8e4nv, _ir.ROUNDING_MODE.RTNE).view(np.uint8)
    return torch.from_numpy(out.copy()).view(pre.shape)


def _interp_load(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 the way the interpreter loads it: its bfloat16 -> float32 upcast mangles bf16
    subnormals (triton 3.9.0: 1.01e-39 becomes 4.41e-39); float16 and float32 load exactly."""
    if x.dtype != torch.bfloat16:
        return x.float()
    import triton.language as tl
    from triton.runtime.interpreter import _convert_float

    bits = x.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    out = _convert_float(bits, tl.bfloat16, tl.float32, None).view(np.float32)
    return torch.from_numpy(out.copy()).view(x.shape)


def _precast(x: torch.Tensor, s: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The reference's float32 value before the fp8 cast: clamp(x * multiplier, -448, 448)."""
    x = x.float()
    if fmt is Format.BLOCK_FP8:
        n, k = x.shape[-2:]
        r = torch.reciprocal(s).repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]
    elif fmt is Format.MXFP8:
        r = quant._pow2_from_exponent(127 - s.to(torch.int32)).repeat_interleave(32, -1)
    else:
        r = torch.reciprocal(s)
    return (x * r).clamp(-448.0, 448.0)


def _reference(slab: torch.Tensor, fmt: Format, parts: int):
    """outs[e][p] of the torch reference (per-tensor: one scale over an expert's parts)."""
    rows = slab.shape[1] // parts
    out = []
    for e in range(slab.shape[0]):
        views = [slab[e, p * rows : (p + 1) * rows] for p in range(parts)]
        if fmt is Format.FP8_PER_TENSOR:
            scale = quant.fp8_per_tensor_scale(*views)
            out.append([quant.quantize_fp8_per_tensor(v, scale=scale) for v in views])
        else:
            out.append([quant.quantize(v, fmt) for v in views])
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.uint8)


def _assert_matches(x: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor], ref, fmt: Format, what: str):
    """Scales bit for bit; values bit for bit (GPU) or through the interpreter's cast (CPU)."""
    q, s = got
    rq, rs = ref
    assert torch.equal(_bits(s), _bits(rs)), f"{what}: scales differ"
    if EXACT_VALUES:
        assert torch.equal(_bits(q), _bits(rq)), f"{what}: value bytes differ"
        return
    xl = _interp_load(x.cpu())
    pre = _precast(xl, rs.cpu(), fmt)
    cast = _interp_cast(pre)
    assert torch.equal(_bits(q), cast), f"{what}: pre-cast float32 values differ"
    # dequantization within half an e4m3 step wherever the interpreter loaded and cast exactly
    agrees = cast == pre.to(FP8_DTYPE).view(torch.uint8)
    assert float(agrees.float().mean()) > 0.5, (
        f"{what}: the interpreter's cast disagreed with RNE almost everywhere"
    )
    ok = agrees & (xl == x.cpu().float())
    err = (quant.dequantize(q.cpu(), s.cpu(), fmt) - xl).abs()
    step = torch.exp2(torch.floor(torch.log2(pre.abs().clamp_min(2.0**-6))) - 3) / 2
    mult = (xl / pre).abs().nan_to_num(0.0)
    assert bool((err[ok] <= step[ok] * mult[ok] * (1 + 2.0**-20) + 1e-30).all()), what


def _alloc(experts: int, parts: int, rows: int, cols: int, fmt: Format, device=DEVICE):
    shape = (rows, cols)
    return [
        [
            (
                torch.empty(shape, dtype=FP8_DTYPE, device=device),
                torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype, device=device),
            )
            for _ in range(parts)
        ]
        for _ in range(experts)
    ]


def _slab(e: int, r: int, k: int, *, seed: int = 0, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, r, k, generator=g) * scale).to(dtype).to(DEVICE)


# --------------------------------------------------------------------------------------------------
# host side (every machine)


def test_capability_predicate_on_cpu_tensors():
    """A CPU tensor never goes to the kernels, whatever is installed."""
    assert not kernels.available("cpu")
    assert "CUDA tensors only" in kernels.unavailable_reason(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert not kernels.available()


def test_import_sidecar_without_triton():
    """`import sidecar`, `sidecar.numerics.kernels` and `sidecar.plan.run` work where Triton cannot be imported,
    and importing them does not import Triton where it can."""
    code = textwrap.dedent(
        """
        import sys
        if sys.argv[1] == "block":
            sys.modules["triton"] = None  # as if not installed: find_spec None, import raises
        import sidecar, sidecar.numerics.kernels, sidecar.plan.run
        assert sys.modules.get("triton") is None
        import torch
        print(sidecar.numerics.kernels.available(), sidecar.numerics.kernels.available(torch.device("cpu")))
        """
    )
    for mode in ("block", "plain"):
        out = subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120, check=False
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[1] == "False"


def test_geometry_tiles_round_trip():
    """Every tile id decodes to the (expert, part, rows, cols) the kernels' numbering gives it."""
    geom = SlabGeometry(experts=3, parts=2, rows=130, cols=259)
    n_rt, n_ct = geom.tiles(128, 128)
    assert (n_rt, n_ct) == (2, 3)
    assert geom.programs(128, 128) == 3 * 2 * 2 * 3
    seen = set()
    for tid in range(geom.programs(128, 128)):
        t = geom.tile(tid, 128, 128)
        assert ((t.expert * 2 + t.part) * n_rt + t.rows[0] // 128) * n_ct + t.cols[0] // 128 == tid
        seen.add((t.expert, t.part, t.rows, t.cols))
    assert len(seen) == geom.programs(128, 128)
    assert geom.tile(geom.programs(128, 128) - 1, 128, 128).rows == (128, 130)
    with pytest.raises(ValueError, match="outside"):
        geom.tile(geom.programs(128, 128), 128, 128)


@pytest.mark.parametrize("rows,parts,block_rows,chunks", [(1024, 2, 32, 32), (130, 1, 32, 32), (5, 2, 32, 8)])
def test_amax_chunks_cover_each_row_once(rows, parts, block_rows, chunks):
    """The per-tensor first pass reads each row of an expert exactly once, in at most amax_chunks programs."""
    geom = SlabGeometry(experts=2, parts=parts, rows=rows, cols=64)
    cfg = TileConfig(block_rows=block_rows, block_cols=64, amax_chunks=chunks)
    n, per = geom.amax_chunks(cfg)
    assert n <= chunks and per % block_rows == 0
    covered = [r for c in range(n) for r in range(*geom.amax_rows(c, cfg))]
    assert covered == list(range(parts * rows))


def test_tile_config_validation():
    DEFAULTS = kernels.DEFAULT_CONFIGS
    for fmt, cfg in DEFAULTS.items():
        cfg.validate(fmt)
    with pytest.raises(ValueError, match="128 rows"):
        TileConfig(block_rows=64, block_cols=128).validate(Format.BLOCK_FP8)
    with pytest.raises(ValueError, match="powers of two"):
        TileConfig(block_rows=48, block_cols=256).validate(Format.MXFP8)
    with pytest.raises(ValueError, match="multiple of 32"):
        TileConfig(block_rows=32, block_cols=16).validate(Format.MXFP8)
    with pytest.raises(ValueError, match="amax_chunks"):
        TileConfig(block_rows=32, block_cols=256, amax_chunks=0).validate(Format.FP8_PER_TENSOR)


def test_output_checks_list_every_problem():
    """Wrong shape, dtype, device or strides: refused with each output's name and what to fix."""
    slab = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    fmt = Format.MXFP8
    outs = _alloc(2, 2, 4, 64, fmt, device="cpu")
    names = slab_mod.default_names(2, 2, "layers.0.gate_up")
    slab_mod.check_outputs(slab, fmt, outs, names)
    outs[0][1] = (torch.empty(4, 64, dtype=torch.bfloat16), outs[0][1][1])
    outs[1][0] = (outs[1][0][0], torch.empty(2, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="2 output buffer problem") as err:
        slab_mod.check_outputs(slab, fmt, outs, names)
    assert "layers.0.gate_up[0] part 1: values buffer is torch.bfloat16" in str(err.value)
    assert "layers.0.gate_up[1] part 0: scales buffer is not contiguous" in str(err.value)
    assert slab_mod.prepare_outputs(slab, fmt, outs, lambda: names, strict=False) is None
    with pytest.raises(ValueError, match="one row per expert"):
        slab_mod.check_outputs(slab, fmt, outs[:1], names)
    with pytest.raises(ValueError, match="multiple of 32"):
        slab_mod.check_slab(torch.zeros(1, 2, 48), fmt, 1, "x")
    with pytest.raises(ValueError, match="equal parts"):
        slab_mod.check_slab(torch.zeros(1, 3, 64), fmt, 2, "x")
    with pytest.raises(ValueError, match="dtype"):
        slab_mod.check_slab(torch.zeros(1, 2, 64, dtype=torch.int32), fmt, 1, "x")


def test_pointer_table_holds_base_addresses():
    ts = [torch.empty(16, dtype=torch.uint8) for _ in range(5)]
    table = slab_mod.pointer_table(ts, "cpu")
    assert table.dtype == torch.int64 and table.tolist() == [t.data_ptr() for t in ts]


def test_prepared_outputs_are_cached_by_identity_not_kept_alive():
    """The same output tensors again: the checked entry is reused (no re-check, same tables);
    other tensors, even at equal shapes, are checked anew; the cache holds no tensor alive."""
    import gc
    import weakref

    slab = torch.zeros(4, 16, 64, dtype=torch.bfloat16)
    fmt = Format.MXFP8
    outs = _alloc(4, 2, 8, 64, fmt, device="cpu")
    calls = []

    def names():
        calls.append(1)
        return slab_mod.default_names(4, 2)

    first = slab_mod.prepare_outputs(slab, fmt, outs, names)
    assert slab_mod.prepare_outputs(slab, fmt, outs, names) is first and len(calls) == 1
    assert first.q_table.tolist() == [q.data_ptr() for row in outs for q, _ in row]
    assert first.s_table.tolist() == [s.data_ptr() for row in outs for _, s in row]
    other = _alloc(4, 2, 8, 64, fmt, device="cpu")
    assert slab_mod.prepare_outputs(slab, fmt, other, names) is not first and len(calls) == 2
    probe = weakref.ref(outs[0][0][0])
    del outs, first
    gc.collect()
    assert probe() is None


def test_a_cached_launch_checks_its_outputs_once(monkeypatch):
    """A 256-expert gate_up slab's outputs are checked once (milliseconds of Python, where the
    kernels take about 0.4 ms on an H200 for a whole layer): a repeat with the same output tensors
    returns the entry made the first time, and neither names them, checks them nor builds their
    pointer tables again."""
    slab = torch.zeros(256, 2, 64, dtype=torch.bfloat16)
    outs = _alloc(256, 2, 1, 64, Format.BLOCK_FP8, device="cpu")
    names = slab_mod.default_names(256, 2)
    first = slab_mod.prepare_outputs(slab, Format.BLOCK_FP8, outs, lambda: names)
    redone: list[str] = []
    monkeypatch.setattr(slab_mod, "check_outputs", lambda *a, **k: redone.append("check"))
    monkeypatch.setattr(slab_mod, "pointer_table", lambda *a, **k: redone.append("pointer table"))
    for _ in range(10):
        again = slab_mod.prepare_outputs(
            slab, Format.BLOCK_FP8, outs, lambda: redone.append("names") or names
        )
        assert again is first
    assert redone == []
    fresh = _alloc(256, 2, 1, 64, Format.BLOCK_FP8, device="cpu")  # other tensors: checked anew
    slab_mod.prepare_outputs(slab, Format.BLOCK_FP8, fresh, lambda: redone.append("names") or names)
    assert redone == ["names", "check", "pointer table", "pointer table"]


def test_wide_offsets_only_when_needed():
    assert not slab_mod.needs_wide_offsets(torch.empty(256, 1024, 2048, dtype=torch.bfloat16, device="meta"))
    assert slab_mod.needs_wide_offsets(torch.empty(2, 65536, 32768, dtype=torch.bfloat16, device="meta"))
    # a transposed view: column stride 2^28, so 8 columns span 7 * 2^28 elements, 9 reach 2^31
    assert not slab_mod.needs_wide_offsets(torch.empty(1, 8, 2**28, device="meta").transpose(1, 2)[:, :4])
    assert slab_mod.needs_wide_offsets(torch.empty(1, 9, 2**28, device="meta").transpose(1, 2)[:, :4])


def test_try_run_unit_declines_cpu_tensors():
    """run_unit's hook returns False on CPU, so the reference runs (and the output is the reference's)."""
    from sidecar.plan.build import RefitPlan, RefitSpec
    from sidecar.plan.run import run_unit

    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = {
        name: torch.randn(2, 64, 64).bfloat16(),
        name.replace("gate_up", "down"): torch.randn(2, 64, 32).bfloat16(),
    }
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))
    outputs = plan.allocate()
    for unit in plan.units:
        assert not launch.try_run_unit(unit, tensors, outputs)
        run_unit(unit, tensors, outputs)


def test_quantize_slab_refuses_cpu_outside_the_interpreter():
    """quantize_slab takes CPU tensors only under the interpreter; elsewhere it points to sidecar.numerics.reference."""
    slab = torch.zeros(1, 2, 64)
    outs = _alloc(1, 1, 2, 64, Format.MXFP8, device="cpu")
    if NO_INTERPRETER is not None:
        with pytest.raises(ValueError, match="CUDA tensors"):
            kernels.quantize_slab(slab, "mxfp8", outs)
        return
    import triton

    triton.knobs.runtime.interpret = False
    try:
        with pytest.raises(ValueError, match="CUDA tensors"):
            kernels.quantize_slab(slab, "mxfp8", outs)
    finally:
        triton.knobs.runtime.interpret = True
        os.environ.pop("TRITON_INTERPRET", None)


# --------------------------------------------------------------------------------------------------
# the compiler, without a GPU: Triton builds PTX for Hopper on any machine

_AOT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sidecar.numerics.kernels import triton_quant as tq

def build(fn, sig, consts, div16, warps):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    count = lambda pat: len(re.findall(pat, ptx))
    return {"st_v4": count(r"st\.global(\.[a-z0-9]+)*\.v4"), "st_b8": count(r"st\.global(\.[a-z0-9]+)*\.[bu]8\b"),
            "ld_v4": count(r"ld\.global(\.[a-z0-9]+)*\.v4"), "div_rn": count(r"div\.rn\.f32"),
            "div_other": count(r"div\.(full|approx)"), "ftz": count(r"\.ftz"),
            "cvt_e4m3": count(r"cvt\.rn\.satfinite\.e4m3x2\.f32"), "mul_rn": count(r"mul\.rn\.f32"),
            "shared": k.metadata.shared}

ptrs = {"x_ptr": "*bf16", "q_tab": "*i64", "s_tab": "*i64", "flag_ptr": "*i32"}
ints = {"stride_e": "i32", "stride_r": "i32", "stride_k": "constexpr", "rows": "i32", "cols": "i32", "n_rt": "i32", "n_ct": "i32"}
hints = ["x_ptr", "q_tab", "s_tab", "flag_ptr", "stride_e", "stride_r", "rows", "cols", "n_ct"]
out = {}
for aligned in (True, False):
    sig = {**ptrs, **ints, "n_cg": "i32", "PARTS": "constexpr", "TILES_K": "constexpr", "ALIGNED": "constexpr", "WIDE": "constexpr"}
    out[f"block_fp8 aligned={aligned}"] = build(tq._block_fp8_kernel, sig,
        {"stride_k": 1, "PARTS": 2, "TILES_K": 1, "ALIGNED": aligned, "WIDE": False}, hints + ["n_cg"], 8)
    sig = {**ptrs, **ints, "PARTS": "constexpr", "BR": "constexpr", "BK": "constexpr", "ALIGNED": "constexpr", "WIDE": "constexpr"}
    out[f"mxfp8 aligned={aligned}"] = build(tq._mxfp8_kernel, sig,
        {"stride_k": 1, "PARTS": 2, "BR": 32, "BK": 256, "ALIGNED": aligned, "WIDE": False}, hints, 4)
sig = {"x_ptr": "*bf16", "part_ptr": "*i32", "flag_ptr": "*i32", "stride_e": "i32", "stride_r": "i32", "stride_k": "constexpr",
       "total_rows": "i32", "cols": "i32", "rows_per_chunk": "i32", "n_chunks": "i32", "BR": "constexpr", "BK": "constexpr", "ROW_ITERS": "constexpr",
       "COL_ITERS": "constexpr", "WIDE": "constexpr"}
out["amax"] = build(tq._amax_kernel, sig, {"stride_k": 1, "BR": 32, "BK": 256, "ROW_ITERS": 4, "COL_ITERS": 16, "WIDE": True},
                    ["x_ptr", "part_ptr", "stride_e", "stride_r", "total_rows", "cols", "rows_per_chunk"], 4)
sig = {**ptrs, **ints, "n_chunks": "i32", "PARTS": "constexpr", "BR": "constexpr", "BK": "constexpr", "CHUNKS": "constexpr",
       "ALIGNED": "constexpr", "WIDE": "constexpr"}
sig["part_ptr"] = sig.pop("flag_ptr")
out["fp8_per_tensor aligned=True"] = build(tq._per_tensor_kernel, sig,
    {"stride_k": 1, "PARTS": 2, "BR": 32, "BK": 256, "CHUNKS": 32, "ALIGNED": True, "WIDE": False},
    [h for h in hints if h != "flag_ptr"], 4)
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_compile_for_hopper_with_exact_arithmetic():
    """Every kernel compiles to sm_90 PTX here, without a GPU, and the PTX shows SPEC's arithmetic:
    correctly rounded division (``div.rn.f32``, never ``div.full``/``div.approx``), no flush-to-zero
    anywhere, round-to-nearest-even e4m3 casts, uncontracted multiplies; and with 16-byte aligned
    outputs the fp8 values are stored 16 bytes at a time (the alignment hint on a loaded pointer)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _AOT], capture_output=True, text=True, timeout=600, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, f in facts.items():
        assert f["ftz"] == 0 and f["div_other"] == 0, (name, f)
        assert f["ld_v4"] > 0, (name, f)  # bf16 loads, 16 bytes at a time
        if name != "amax":
            assert f["div_rn"] >= 2 and f["cvt_e4m3"] > 0 and f["mul_rn"] > 0, (name, f)
        if "aligned=True" in name:  # values 16 bytes at a time; at most MXFP8's scale bytes alone
            assert f["st_v4"] > 0 and f["st_b8"] <= 2, (name, f)
    assert facts["block_fp8 aligned=False"]["st_b8"] > 0  # the fallback stores bytes: correct, slower


# --------------------------------------------------------------------------------------------------
# kernels: interpreter on CPU, compiled on a GPU

kernel_tier = pytest.mark.skipif(
    NO_INTERPRETER is not None and NO_GPU is not None, reason=f"{NO_INTERPRETER}; {NO_GPU}"
)


@kernel_tier
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
@pytest.mark.parametrize(
    "shape,parts,dtype",
    [
        ((2, 260, 160), 2, torch.bfloat16),  # gate_up, ragged I = 130 and K = 160
        ((3, 96, 64), 1, torch.float16),  # down, batched
        ((1, 256, 256), 2, torch.float32),  # whole tiles
    ],
    ids=["gate_up-ragged-bf16", "down-f16", "whole-f32"],
)
def test_slab_matches_reference(fmt, shape, parts, dtype):
    """Random slabs with a zeroed 128x128 region: every expert's outputs equal the reference's."""
    slab = _slab(*shape, seed=sum(shape), dtype=dtype)
    slab[0, :128, :128] = 0  # a zero block (an all-zero MX row block; a zero tile)
    outs = _alloc(shape[0], parts, shape[1] // parts, shape[2], fmt)
    kernels.quantize_slab(slab, fmt, outs)
    ref = _reference(slab, fmt, parts)
    rows = shape[1] // parts
    for e in range(shape[0]):
        for p in range(parts):
            x = slab[e, p * rows : (p + 1) * rows]
            _assert_matches(x, outs[e][p], ref[e][p], fmt, f"expert {e} part {p}")


@kernel_tier
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
def test_non_contiguous_slab_and_small_tiles(fmt):
    """A transposed slab view (strided loads) and a non-default tile config give the same bytes."""
    base = _slab(2, 96, 192, seed=7)
    slab = base.transpose(1, 2)  # [2, 192, 96], stride_k = 192
    cfg = {
        Format.BLOCK_FP8: TileConfig(block_rows=128, block_cols=256, num_warps=4),
        Format.MXFP8: TileConfig(block_rows=16, block_cols=64, num_warps=4),
        Format.FP8_PER_TENSOR: TileConfig(block_rows=16, block_cols=32, num_warps=4, amax_chunks=4),
    }[fmt]
    outs = _alloc(2, 2, 96, 96, fmt)
    kernels.quantize_slab(slab, fmt, outs, config=cfg)
    ref = _reference(slab, fmt, 2)
    for e in range(2):
        for p in range(2):
            _assert_matches(slab[e, p * 96 : (p + 1) * 96], outs[e][p], ref[e][p], fmt, f"{e}/{p}")


@kernel_tier
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
@pytest.mark.parametrize("misalign", [0, 4], ids=["aligned", "misaligned"])
def test_placement_in_a_shared_pool(fmt, misalign):
    """Outputs carved out of one byte pool in shuffled order, with guard bytes between them (as the
    daemon's arena places them): each expert's bytes land in its own tensors and nowhere else."""
    experts, parts, rows, cols = 3, 2, 40, 96
    shape = (rows, cols)
    sizes = []
    for _ in range(experts * parts):
        sizes += [rows * cols, 4 * max(1, int(np.prod(fmt.scale_shape(shape))))]
    order = np.random.default_rng(0).permutation(len(sizes))
    offsets, cursor = {}, 64
    for i in order:
        offsets[int(i)] = cursor + misalign
        cursor += -(-(sizes[i] + misalign) // 64) * 64 + 64  # a guard gap after each
    pool = torch.full((cursor + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
    outs, k = [], 0
    for _ in range(experts):
        row = []
        for _ in range(parts):
            q = pool[offsets[k] : offsets[k] + sizes[k]].view(FP8_DTYPE).view(shape)
            so = offsets[k + 1] - misalign  # scales stay 4-byte aligned
            nbytes = int(np.prod(fmt.scale_shape(shape))) * fmt.scale_dtype.itemsize
            s = pool[so : so + nbytes].view(fmt.scale_dtype).view(fmt.scale_shape(shape))
            row.append((q, s))
            k += 2
        outs.append(row)
    assert slab_mod.is_aligned([p[0] for r in outs for p in r]) == (misalign == 0)
    slab = _slab(experts, parts * rows, cols, seed=3)
    kernels.quantize_slab(slab, fmt, outs)
    ref = _reference(slab, fmt, parts)
    written = torch.zeros_like(pool, dtype=torch.bool)
    for e in range(experts):
        for p in range(parts):
            q, s = outs[e][p]
            _assert_matches(slab[e, p * rows : (p + 1) * rows], (q, s), ref[e][p], fmt, f"{e}/{p}")
            for t in (q, s):
                start = t.data_ptr() - pool.data_ptr()
                written[start : start + t.numel() * t.element_size()] = True
    assert bool((pool[~written] == 0xA5).all()), "a byte outside the outputs was written"


@kernel_tier
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_is_refused_naming_the_tensor(fmt, bad):
    """One NaN/Inf in expert 1's up rows: NonFiniteError names that output and a tile holding it."""
    experts, rows, cols = 3, 130, 128
    slab = _slab(experts, 2 * rows, cols, seed=5)
    slab[1, rows + 129, 70] = bad  # up part, row 129
    names = [[f"e{e}.gate_proj.weight", f"e{e}.up_proj.weight"] for e in range(experts)]
    with pytest.raises(quant.NonFiniteError, match="NaN or Inf") as err:
        kernels.quantize_slab(slab, fmt, _alloc(experts, 2, rows, cols, fmt), names=names)
    msg = str(err.value)
    assert "e1.up_proj.weight" in msg and "e0." not in msg and "e2." not in msg, msg
    if fmt is Format.BLOCK_FP8:
        assert "tile rows 128..129, cols 0..127" in msg
    elif fmt is Format.MXFP8:
        assert "rows 128..129" in msg


@kernel_tier
def test_non_finite_reports_the_first_tile():
    """Two bad tiles: the flag keeps the smallest tile id, so the error names the first one."""
    slab = _slab(2, 256, 256, seed=6)
    slab[1, 200, 200] = float("nan")
    slab[0, 130, 3] = float("inf")
    names = [["a.weight"], ["b.weight"]]
    with pytest.raises(quant.NonFiniteError, match=re.escape("tile rows 128..255, cols 0..127")) as err:
        kernels.quantize_slab(slab, "block_fp8", _alloc(2, 1, 256, 256, Format.BLOCK_FP8), names=names)
    assert "'a.weight'" in str(err.value)


@kernel_tier
def test_edge_values_scales_and_bytes():
    """Subnormal, tiny, huge and saturating blocks: scales as the reference (E8M0 never byte 0)."""
    slab = torch.zeros(1, 4, 128, dtype=torch.float32)
    slab[0, 0, :32] = 1e-40  # subnormal amax
    slab[0, 0, 32:64] = 3.0e38  # huge: byte 247
    slab[0, 0, 64:96] = 449.0  # ceil, not nearest: byte 128
    slab[0, 1, :] = 1.0234375  # saturates at 448 under block scaling
    slab[0, 2, :32] = 2.0**-149  # smallest subnormal
    slab = slab.to(DEVICE)
    for fmt in QUANTIZED:
        outs = _alloc(1, 1, 4, 128, fmt)
        kernels.quantize_slab(slab, fmt, outs)
        ref = _reference(slab, fmt, 1)
        _assert_matches(slab[0], outs[0][0], ref[0][0], fmt, fmt.value)
        if fmt is Format.MXFP8:
            assert outs[0][0][1][0].tolist() == [1, 247, 128, 1]
            assert int(outs[0][0][1].min()) >= 1


@kernel_tier
def test_empty_slabs():
    """Zero experts, zero rows or zero columns: nothing to do; an empty per-tensor scale is 1.0."""
    for shape in ((0, 4, 64), (2, 0, 64), (2, 4, 0)):
        slab = torch.zeros(shape, device=DEVICE)
        for fmt in QUANTIZED:
            outs = _alloc(shape[0], 1, shape[1], shape[2], fmt)
            kernels.quantize_slab(slab, fmt, outs)
            if fmt is Format.FP8_PER_TENSOR:
                assert all(float(s) == 1.0 for row in outs for _, s in row)


def _planned_reference(o, tensors, fmt):
    """The reference's (values, scales) of one planned weight output (per-tensor: gate and up share
    the scale of their whole expert matrix, down has its own)."""
    x = o.source_view(tensors[o.source])
    if fmt is Format.FP8_PER_TENSOR:
        whole = tensors[o.source] if o.expert is None else tensors[o.source][o.expert]
        return quant.quantize_fp8_per_tensor(x, scale=quant.fp8_per_tensor_scale(whole))
    return quant.quantize(x, fmt)


def _layer(experts=3, inter=64, hidden=96, seed=9):
    prefix = "model.language_model.layers.0.mlp.experts"
    g = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}.gate_up_proj": torch.randn(experts, 2 * inter, hidden, generator=g).bfloat16().to(DEVICE),
        f"{prefix}.down_proj": torch.randn(experts, hidden, inter, generator=g).bfloat16().to(DEVICE),
    }


@kernel_tier
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
def test_plan_slab_units_through_the_kernels(fmt):
    """A planned Qwen3.5 layer: the dispatcher's arrangement of each slab unit's outputs (experts in
    order, gate before up) quantized by the kernels equals the reference, output by output."""
    from sidecar.plan.build import RefitPlan, RefitSpec, UnitKind

    tensors = _layer()
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    got = plan.allocate(device=DEVICE)
    for unit in plan.units:
        assert unit.kind is UnitKind.SLAB
        outs, names = launch.slab_outs(unit, got)
        if "gate_up" in unit.inputs[0]:
            assert names[1][0].endswith(".1.gate_proj.weight") and names[1][1].endswith(".1.up_proj.weight")
        kernels.quantize_slab(tensors[unit.inputs[0]], fmt, outs, names=names)
    for o in plan.outputs:
        if o.scale_name:
            x = o.source_view(tensors[o.source])
            ref = _planned_reference(o, tensors, fmt)
            _assert_matches(x, (got[o.name], got[o.scale_name]), ref, fmt, o.name)


# --------------------------------------------------------------------------------------------------
# the shared edge-case table


def _table_cases():
    from sidecar.numerics.cases import CASES

    return CASES


def _on_cuda(w, *, fmt, **kw):
    return kernels.quantize(w.cuda(), fmt, **kw)


@kernel_tier
@pytest.mark.parametrize("case", _table_cases(), ids=lambda c: c.id)
def test_edge_case_table(case):
    """Every case of sidecar/numerics/cases.py through ``kernels.quantize`` (a slab launch per tensor).

    On a GPU this is the shared table's own test with the "triton" implementation registered; under
    the interpreter scales and errors are exact and values are checked through its cast."""
    w = case.make().to(DEVICE)
    if EXACT_VALUES:
        import test_quant

        test_quant.IMPLEMENTATIONS.setdefault(
            "triton", {f: functools.partial(_on_cuda, fmt=f) for f in QUANTIZED}
        )
        test_quant.test_edge_case_table(case, "triton")
        return
    if case.error:
        with pytest.raises(ValueError, match=case.error) as err:
            kernels.quantize(w, case.fmt, name="model.layers.0.mlp.experts.0.up_proj.weight")
        assert "model.layers.0.mlp.experts.0.up_proj.weight" in str(err.value)
        return
    q, s = kernels.quantize(w, case.fmt)
    rq, rs = quant.quantize(w, case.fmt)
    assert tuple(q.shape) == tuple(w.shape) and tuple(s.shape) == tuple(rs.shape)
    _assert_matches(w, (q, s), (rq, rs), case.fmt, case.id)
    if case.scales is not None:
        assert s.reshape(-1).tolist() == list(case.scales)


# --------------------------------------------------------------------------------------------------
# GPU only: dispatch from run_unit


@gpu
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
def test_try_run_unit_on_cuda_matches_reference(fmt):
    """On a GPU the hook takes slab units (one launch each) and per-expert units; results equal the
    reference bit for bit."""
    from sidecar.plan.build import RefitPlan, RefitSpec

    tensors = _layer(experts=4, inter=192, hidden=256)
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    got = plan.allocate(device="cuda")
    for unit in plan.units:
        assert launch.try_run_unit(unit, tensors, got)
    for o in plan.outputs:
        if o.scale_name:
            rq, rs = _planned_reference(o, tensors, fmt)
            assert torch.equal(_bits(got[o.name]), _bits(rq)), o.name
            assert torch.equal(_bits(got[o.scale_name]), _bits(rs)), o.scale_name
    per_expert = {
        f"model.layers.0.mlp.experts.{e}.{p}.weight": t
        for e in range(2)
        for p, t in (
            ("gate_proj", torch.randn(256, 128)),
            ("up_proj", torch.randn(256, 128)),
            ("down_proj", torch.randn(128, 256)),
        )
    }
    per_expert = {k: v.bfloat16().cuda() for k, v in per_expert.items()}
    plan = RefitPlan.build(list(per_expert.items()), RefitSpec(model_type="qwen3_moe", fmt=fmt))
    got = plan.allocate(device="cuda")
    for unit in plan.units:
        shared = any(len(grp) > 1 for grp in unit.scale_groups)
        assert launch.try_run_unit(unit, per_expert, got) is not shared


# --------------------------------------------------------------------------------------------------
# the GPU path's host side, with fakes: device, probe, flags, scratch, warm-up


class _FakeCuda:
    """A stand-in for torch.cuda's current device: ``scope(device)`` makes it current for a block,
    and whatever ran records the device that was current then."""

    def __init__(self):
        self.current = torch.device("cuda", 0)
        self.seen: list[tuple[str, torch.device]] = []

    def scope(self, device):
        import contextlib

        @contextlib.contextmanager
        def entered():
            previous, self.current = self.current, torch.device(device)
            try:
                yield
            finally:
                self.current = previous

        return entered()

    def record(self, what):
        self.seen.append((what, self.current))


def test_launches_and_allocations_run_with_the_slabs_device_current(monkeypatch):
    """A daemon on its second GPU: quantize_slab makes the slab's device current around the pointer
    tables, the scratch, the flag and the launch (Triton launches on the current device and its
    stream), and gives the previous device back after."""
    fake = _FakeCuda()
    real_prepare, real_scratch = kernels.prepare_outputs, kernels.scratch

    class FakeTq:
        CALLS: ClassVar = {f.value: (lambda *a, **k: ["call"]) for f in QUANTIZED}

        @staticmethod
        def partials_size(geom, cfg):
            return 8

        @staticmethod
        def launch(calls):
            fake.record("launch")
            return []

    def prepare(*a, **k):
        fake.record("pointer tables")
        return real_prepare(*a, **k)

    def scratch(device, n):
        fake.record("scratch")
        return real_scratch(device, n)

    monkeypatch.setattr(kernels, "device_scope", fake.scope)
    monkeypatch.setattr(kernels, "_interpreting", lambda: True)
    monkeypatch.setattr(kernels, "_load", lambda: FakeTq)
    monkeypatch.setattr(kernels, "prepare_outputs", prepare)
    monkeypatch.setattr(kernels, "scratch", scratch)
    for fmt in QUANTIZED:
        slab = torch.zeros(2, 4, 64)
        kernels.quantize_slab(slab, fmt, _alloc(2, 1, 4, 64, fmt, device="cpu"))
    assert fake.seen and {d for _, d in fake.seen} == {torch.device("cpu")}, fake.seen
    assert [w for w, _ in fake.seen].count("launch") == 3 and ("scratch", torch.device("cpu")) in fake.seen
    assert fake.current == torch.device("cuda", 0)  # restored


def test_device_scope_enters_the_cuda_device_and_nothing_for_cpu(monkeypatch):
    entered = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Device)
    with kernels.device_scope(torch.device("cuda", 1)):
        pass
    with kernels.device_scope("cpu"):
        pass
    assert entered == [torch.device("cuda", 1)]


def test_a_triton_that_cannot_launch_falls_back_to_the_reference_once(monkeypatch):
    """Triton imports but its first launch fails (no compiler for the launcher, no libcuda): the
    probe says why, once per device; try_run_unit declines (the reference runs); warm-up reports the
    torch quantizer with the reason for status and metrics."""
    from sidecar.plan.build import RefitPlan, RefitSpec

    tries = []

    def broken(device):
        tries.append(device)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(kernels, "_triton_missing", lambda: None)
    monkeypatch.setattr(kernels, "_load", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_probe_launch", broken)
    monkeypatch.setattr(kernels, "_probed", {})
    monkeypatch.setattr(kernels, "device_scope", lambda device: _FakeCuda().scope(device))
    reason = kernels.unavailable_reason("cuda:3")
    assert "cannot launch a kernel on cuda:3" in reason and "Failed to find C compiler" in reason
    assert "C compiler" in reason and "TRITON_CACHE_DIR" in reason
    assert not kernels.available(torch.device("cuda", 3)) and tries == [torch.device("cuda", 3)]
    assert kernels.probe("cuda:2") is not None and len(tries) == 2  # each device probed once
    tensors = _layer()
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8"))
    done = launch.warm_up(plan, "cuda:3")
    assert (done.impl, done.reason, done.compiled) == ("torch", reason, 0) and len(tries) == 2
    assert done.to_dict()["impl"] == "torch"


def test_a_probe_that_passes_is_remembered(monkeypatch):
    monkeypatch.setattr(kernels, "_probed", {})
    monkeypatch.setattr(kernels, "device_scope", lambda device: _FakeCuda().scope(device))
    calls = []
    monkeypatch.setattr(kernels, "_probe_launch", calls.append)
    assert kernels.probe("cuda:1") is None and kernels.probe(torch.device("cuda", 1)) is None
    assert calls == [torch.device("cuda", 1)]


def _flagged_launch(name="w"):
    geom = SlabGeometry(experts=1, parts=1, rows=256, cols=256)
    cfg = kernels.DEFAULT_CONFIGS[Format.BLOCK_FP8]
    return lambda flag: kernels.SlabLaunch(flag, Format.BLOCK_FP8, geom, cfg, lambda: [[name]])


def test_flag_group_reads_every_launchs_flag_with_one_copy(monkeypatch):
    """Many launches' flags in one group: slots run past a buffer's end into a second buffer, the
    check reads each device's slots once (no .item() per launch), names the first bad launch of each
    tag, and leaves the slots clear for the next group (the buffers are reused, not reallocated)."""
    monkeypatch.setattr(kernels.FlagGroup, "CHUNK", 4)
    monkeypatch.setattr(
        kernels.SlabLaunch, "check", lambda self: pytest.fail("a launch was checked on its own")
    )
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or real_tolist(self))
    group = kernels.FlagGroup()
    device = torch.device("cpu")
    for i in range(10):
        flag, slot = group.slot(device)
        if i in (4, 5, 9):  # what a kernel's atomic_min leaves: the first bad tile's id
            flag.fill_(3 if i == 4 else 0)
        group.add(i // 3, device, slot, _flagged_launch(f"unit{i // 3}.w{i}")(flag))
    buffers = list(group._buffers[device])
    errors = group.check()
    assert reads == [10] and sorted(errors) == [1, 3]
    assert isinstance(errors[1], quant.NonFiniteError) and "unit1.w4" in str(errors[1])
    assert "tile rows 128..255, cols 128..255" in str(errors[1])
    assert "unit3.w9" in str(errors[3]) and len(group) == 0
    for _ in range(10):
        group.slot(device)
    assert len(group._buffers[device]) == len(buffers)
    assert all(a is b for a, b in zip(group._buffers[device], buffers))
    assert all((b == slab_mod.FLAG_CLEAR).all() for b in buffers)
    aligned = kernels.FlagGroup()  # every flag 16-byte aligned: one specialisation for all launches
    assert all(aligned.slot(device)[0].data_ptr() % 16 == 0 for _ in range(9))
    assert group.check() == {}  # slots taken but no launch added: nothing to read


def test_per_tensor_scratch_is_reused_until_a_launch_needs_more():
    device = torch.device("cpu")
    kernels._scratch.pop((device, 0), None)
    a = kernels.scratch(device, 10)
    assert kernels.scratch(device, 1024) is a and a.numel() >= 1024
    b = kernels.scratch(device, 5000)
    assert b is not a and b.numel() == 5000 and kernels.scratch(device, 7) is b


@kernel_tier
def test_worker_checks_the_kernels_flags_once_per_batch(monkeypatch):
    """The quantize worker runs a whole queued layer through the kernels (the interpreter here): no
    launch is checked on its own, one group read reports every unit, and the unit whose slab held
    a NaN fails naming its checkpoint tensor while the other completes."""
    import threading

    import zmq

    from sidecar.daemon.worker import QuantWorker
    from sidecar.plan.build import RefitPlan, RefitSpec

    monkeypatch.setattr(kernels, "available", lambda device=None: True)
    monkeypatch.setattr(
        kernels.SlabLaunch, "check", lambda self: pytest.fail("a launch was checked on its own")
    )
    reads = []
    real_check = kernels.FlagGroup.check
    monkeypatch.setattr(kernels.FlagGroup, "check", lambda self: reads.append(len(self)) or real_check(self))
    tensors = _layer()
    down = next(n for n in tensors if "down" in n)
    tensors[down][1, 5, 7] = float("inf")
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt="fp8_per_tensor"))
    outputs = plan.allocate(device=DEVICE)
    ctx = zmq.Context()
    wake = ctx.socket(zmq.PULL)
    wake.bind("inproc://test-kernel-flags")
    worker = QuantWorker(ctx, "inproc://test-kernel-flags")
    try:
        release = threading.Event()
        first = plan.units[0]

        class Held(dict):
            def __getitem__(self, name):
                release.wait(30)  # the other units queue up behind this one and run as one batch
                return super().__getitem__(name)

        worker.submit(0, first, Held({n: tensors[n] for n in first.inputs}), outputs)
        for unit in plan.units[1:]:
            worker.submit(0, unit, {n: tensors[n] for n in unit.inputs}, outputs)
        release.set()
        done = {d.unit: d for d in (worker.results.get(timeout=120) for _ in plan.units)}
    finally:
        worker.close()
        wake.close(linger=0)
        ctx.term()
    bad = {u.index for u in plan.units if down in u.inputs}
    assert reads == [len(plan.units)]  # one read, one launch pair per slab unit
    for index, d in done.items():
        if index in bad:
            assert isinstance(d.error, quant.NonFiniteError) and ".1.down_proj.weight" in str(d.error)
        else:
            assert d.error is None, d.error


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_warm_up_compiles_each_distinct_specialisation_of_the_plan_once(monkeypatch):
    """Two layers of grouped experts need two specialisations per format (gate_up has two parts,
    down one; the second layer repeats the first); a per-expert plan's nine launches need at most
    two (gate and up are alike; down differs only where Triton's integer traits do; per-tensor
    gate and up run on the reference). Warm-up
    compiles exactly those before READY, and reserves the per-tensor scratch; on a CPU device it
    does nothing."""
    from sidecar.plan.build import RefitPlan, RefitSpec

    slabs = {**_layer(), **{k.replace("layers.0", "layers.1"): v for k, v in _layer(seed=3).items()}}
    per_expert = {
        f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.zeros(shape, dtype=torch.bfloat16)
        for e in range(3)
        for p, shape in (("gate_proj", (64, 96)), ("up_proj", (64, 96)), ("down_proj", (96, 64)))
    }
    compiled: list = []
    monkeypatch.setattr(kernels, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(kernels, "device_scope", lambda device: _FakeCuda().scope(device))
    reserved = []
    monkeypatch.setattr(kernels, "scratch", lambda device, n: reserved.append((device, n)))
    for fmt in QUANTIZED:
        for tensors, model, want in ((slabs, "qwen3_5_moe", (2,)), (per_expert, "qwen3_moe", (1, 2))):
            plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type=model, fmt=fmt))
            # fp8_per_tensor's gate + up share one scale: the reference runs them, only down launches
            launches = 4 if model == "qwen3_5_moe" else 3 if fmt is Format.FP8_PER_TENSOR else 9
            assert len(list(launch.plan_launches(plan))) == launches
            specs = kernels.specialisations(launch.plan_launches(plan))
            assert len(specs) in want, (fmt, model, list(specs))
            want = len(specs)
            compiled.clear()
            done = launch.warm_up(plan, "cuda:1", compile=compiled.append)
            assert (done.impl, done.compiled, len(compiled)) == ("triton", want, want)
            kernels_called = {c.kernel.fn.__name__ for calls in compiled for c in calls}
            want_kernels = {
                Format.BLOCK_FP8: {"_block_fp8_kernel"},
                Format.MXFP8: {"_mxfp8_kernel"},
                Format.FP8_PER_TENSOR: {"_amax_kernel", "_per_tensor_kernel"},
            }[fmt]
            assert kernels_called == want_kernels
    assert reserved and all(d == torch.device("cuda", 1) and n > 0 for d, n in reserved)
    monkeypatch.undo()
    cpu = launch.warm_up(plan, "cpu", compile=pytest.fail)
    assert cpu.impl == "torch" and "CUDA tensors only" in cpu.reason


@kernel_tier
def test_amax_kernel_runs_where_the_interpreter_cannot_index_a_tensor(monkeypatch):
    """Triton 3.6's interpreter turns a tensor into a Python int with int(ndarray of shape (1,)),
    which NumPy >= 2.4 refuses: a loop over tensor bounds fails there. Modelled here on this
    Triton; the per-tensor kernels loop over constexpr trip counts and still match the reference."""
    if NO_INTERPRETER is not None:
        pytest.skip(NO_INTERPRETER)
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def like_triton_3_6(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", like_triton_3_6)
    slab = _slab(2, 200, 300, seed=4)  # several row blocks per chunk, a ragged column tile
    cfg = TileConfig(block_rows=32, block_cols=128, num_warps=4, amax_chunks=2)
    outs = _alloc(2, 2, 100, 300, Format.FP8_PER_TENSOR)
    kernels.quantize_slab(slab, "fp8_per_tensor", outs, config=cfg)
    for e in range(2):
        want = quant.fp8_per_tensor_scale(slab[e])
        assert all(torch.equal(s, want.reshape(s.shape)) for _, s in outs[e])


def test_daemon_status_and_metrics_name_the_quantizer(tmp_path):
    """A daemon on host arenas says it quantizes with the native CPU kernels (loaded before READY),
    or with the torch reference and why; the metrics show the same as a labelled gauge."""
    from types import SimpleNamespace

    from support.daemons import RunningDaemon

    from sidecar.cli.demo.synthetic import make_hf_config
    from sidecar.cli.serve import render_status
    from sidecar.ops.metrics import MetricsObserver

    d = RunningDaemon(tmp_path, hf_config=make_hf_config("qwen3_5_moe", num_layers=1, num_experts=2))
    try:
        status = d.status()
    finally:
        d.close()
    q = status["quantizer"]
    from sidecar.numerics import native

    if native.load() is not None:  # host arenas: the native CPU kernels, loaded before READY
        assert (q["impl"], q["device"], q["reason"]) == ("native", "cpu", None)
        assert "quantizer: native kernels on cpu (loaded in" in render_status(status)
    else:
        assert (
            q["impl"] == "torch"
            and q["device"] == "cpu"
            and "native CPU quantizers unavailable" in q["reason"]
        )
        assert "quantizer: torch reference on cpu (native CPU quantizers unavailable" in render_status(status)
    status["quantizer"] = kernels.WarmUp("cpu", "torch", "the kernels run on CUDA tensors only").to_dict()
    assert "quantizer: torch reference on cpu (the kernels run on CUDA tensors only" in render_status(status)
    status["quantizer"] = kernels.WarmUp("cuda:1", "triton", None, 4, 2.0).to_dict()
    assert "quantizer: triton kernels on cuda:1 (4 specialisations compiled in 2.0 s)" in render_status(
        status
    )
    m = MetricsObserver("127.0.0.1:0")
    try:
        m.on_ready(SimpleNamespace(quantizer=kernels.WarmUp("cuda:1", "triton", None, 4, 2.0), engines={}))
        assert (
            m.registry.get_sample_value(
                "refitd_quantizer", {"impl": "triton", "device": "cuda:1", "reason": ""}
            )
            == 1.0
        )
    finally:
        m.close()


@kernel_tier
def test_the_probe_launch_matches_the_reference_where_kernels_run():
    """The probe's own input through the real kernel (the GPU, or the interpreter here) equals the
    torch reference, so a healthy Triton is never mistaken for a broken one."""
    kernels._probe_launch(torch.device(DEVICE))
