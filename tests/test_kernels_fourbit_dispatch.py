"""The daemon's unit runner sends the 4-bit formats to the Triton slab kernels on a GPU arena.

``sidecar.plan.run.run_unit`` -> ``sidecar.plan.launch.try_run_unit`` -> the slab kernels
(``sidecar/numerics/kernels/triton_fourbit_slab.py``), forced onto that path here on CPU tensors
under Triton's interpreter (``kernels.available`` patched to True, as tests/test_kernels.py does for
the FP8 worker): every output, byte for byte, equals what the torch reference writes through the same
``run_unit`` (native kernels turned off), for each 4-bit format and the format parameters an engine
may ask for: NVFP4 under both names (gate + up sharing one global scale, in a slab and as two
per-expert tensors), MXFP4, INT4 in several groups and scale dtypes. Units the kernels do not take
(a non-power-of-two INT4 group, an output buffer they cannot write) run on the reference instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from sidecar.numerics.formats import FP8_DTYPE, Format, FormatParams


def _enable_interpreter() -> str | None:
    """Import Triton and the slab kernels in interpreter mode (tests/test_kernels_fourbit.py)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.is_available():
        return "a GPU is present: bench/gpu_check.py checks the compiled kernels there"
    if "triton" in sys.modules:
        import triton

        if not triton.knobs.runtime.interpret:
            return "triton was imported before this module could enable its interpreter; run this file alone"
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        triton.knobs.runtime.interpret = True
        from sidecar.numerics.kernels import triton_fourbit_slab  # noqa: F401
    except Exception as err:
        return f"the Triton interpreter cannot be used here: {err!r}"
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    return None


SKIP = _enable_interpreter()
pytestmark = [
    pytest.mark.skipif(SKIP is not None, reason=str(SKIP)),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

from sidecar.numerics import kernels, native  # noqa: E402
from sidecar.numerics.checks import NonFiniteError  # noqa: E402
from sidecar.numerics.kernels import fourbit_slab, triton_quant  # noqa: E402
from sidecar.plan import launch  # noqa: E402
from sidecar.plan.build import RefitPlan, RefitSpec  # noqa: E402
from sidecar.plan.run import run_unit  # noqa: E402

CT = FormatParams(nvfp4_names="compressed_tensors")
VARIANTS = {
    "nvfp4-modelopt": (Format.NVFP4, FormatParams()),
    "nvfp4-ct": (Format.NVFP4, CT),
    "mxfp4": (Format.MXFP4, FormatParams()),
    "int4-g32-bf16": (Format.INT4_W4A16, FormatParams()),
    "int4-g64-f32": (Format.INT4_W4A16, FormatParams(int4_group=64, int4_scale_dtype="float32")),
    "int4-g128-bf16": (Format.INT4_W4A16, FormatParams(int4_group=128)),
}


def _slab_layer(experts=2, inter=32, hidden=64, seed=5):
    """A Qwen3.5 layer's grouped experts with a wide range of magnitudes, zeros, -0.0 and subnormals."""
    prefix = "model.language_model.layers.0.mlp.experts"
    g = torch.Generator().manual_seed(seed)

    def make(*shape):
        x = torch.randn(*shape, generator=g)
        x *= torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1), generator=g).float())
        x.view(-1)[::13] = 0.0
        x.view(-1)[::29] = -0.0
        x.view(-1)[7::31] = 1e-40
        return x.bfloat16()

    return {
        f"{prefix}.gate_up_proj": make(experts, 2 * inter, hidden),
        f"{prefix}.down_proj": make(experts, hidden, inter),
    }


def _per_expert(experts=2, inter=32, hidden=64, seed=6):
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.0.mlp.experts.{e}.{p}.weight": (scale * torch.randn(shape, generator=g)).bfloat16()
        for e in range(experts)
        for p, shape, scale in (
            ("gate_proj", (inter, hidden), 1.0),
            ("up_proj", (inter, hidden), 50.0),  # up's amax decides the shared global scale
            ("down_proj", (hidden, inter), 0.01),
        )
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _run(plan, tensors, monkeypatch, *, triton: bool):
    """Every unit of ``plan`` through run_unit: forced onto the kernels, or on the torch reference
    (no kernels, native CPU kernels off). Returns (outputs, units the kernels ran)."""
    monkeypatch.setattr(kernels, "available", lambda device=None: triton)
    monkeypatch.setattr(native, "load", lambda: None)  # the native CPU kernels off: the torch reference
    ran: list[int] = []
    real = launch._try_run_fourbit

    def spy(unit, inputs, outputs):
        done = real(unit, inputs, outputs)
        if done:
            ran.append(unit.index)
        return done

    monkeypatch.setattr(launch, "_try_run_fourbit", spy)
    outs = plan.allocate(device="cpu")
    for t in outs.values():  # stale bytes a kernel forgot to write would show
        t.reshape(-1).view(torch.uint8).fill_(0xA5)
    for unit in plan.units:
        run_unit(unit, tensors, outs)
    return outs, ran


def _assert_identical(plan, got, want):
    for o in plan.outputs:
        assert got[o.name].dtype == want[o.name].dtype, o.name
        assert torch.equal(_bits(got[o.name]), _bits(want[o.name])), o.name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_slab_units_run_on_the_kernels_byte_identical_to_the_reference(variant, monkeypatch):
    fmt, params = VARIANTS[variant]
    g = params.int4_group if fmt is Format.INT4_W4A16 else 32
    tensors = _slab_layer(inter=g, hidden=max(64, g))  # every K a multiple of the group
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=fmt, params=params))
    calls: list = []
    real_launch = triton_quant.launch
    monkeypatch.setattr(triton_quant, "launch", lambda cs: calls.extend(cs) or real_launch(cs))
    got, ran = _run(plan, tensors, monkeypatch, triton=True)
    monkeypatch.setattr(triton_quant, "launch", real_launch)
    want, none = _run(plan, tensors, monkeypatch, triton=False)
    assert sorted(ran) == [u.index for u in plan.units] and none == []
    _assert_identical(plan, got, want)
    # one launch per slab (+ NVFP4's amax pass), with the format's parameters as constexprs
    quantize = [c for c in calls if c.kernel.fn.__name__ != "_amax_kernel"]
    assert len(quantize) == 2 and {c.kwargs["PARTS"] for c in quantize} == {1, 2}
    amax_passes = [c for c in calls if c.kernel.fn.__name__ == "_amax_kernel"]
    assert len(amax_passes) == (2 if fmt is Format.NVFP4 else 0)
    for c in quantize:
        if fmt is Format.INT4_W4A16:
            assert c.kwargs["G"] == params.int4_group
            assert c.kwargs["SCALE_BF16"] is (params.int4_scale_dtype == "bfloat16")
        if fmt is Format.NVFP4:
            assert c.kwargs["RECIPROCAL"] is (params is CT)


@pytest.mark.parametrize("params", [FormatParams(), CT], ids=["modelopt", "compressed-tensors"])
def test_per_expert_gate_and_up_share_one_global_scale_on_the_kernels(params, monkeypatch):
    """Per-expert checkpoints: gate_proj and up_proj are two tensors whose NVFP4 global scale is one
    (their amax passes meet in one int32); the kernels take these units (the FP8 path leaves
    fp8_per_tensor's pair to the reference) and match it byte for byte."""
    tensors = _per_expert()
    plan = RefitPlan.build(
        list(tensors.items()), RefitSpec(model_type="qwen3_moe", fmt=Format.NVFP4, params=params)
    )
    assert any(len(g) == 2 for u in plan.units for g in u.scale_groups)
    got, ran = _run(plan, tensors, monkeypatch, triton=True)
    want, _ = _run(plan, tensors, monkeypatch, triton=False)
    assert sorted(ran) == [u.index for u in plan.units if u.fmt is not None]
    _assert_identical(plan, got, want)
    leaf = params.global_scale_leaf()
    gate = got[f"model.layers.0.mlp.experts.1.gate_proj.{leaf}"]
    up = got[f"model.layers.0.mlp.experts.1.up_proj.{leaf}"]
    assert torch.equal(gate, up)  # shared, decided by up's larger values


def test_units_the_kernels_cannot_take_run_on_the_reference(monkeypatch):
    """A non-power-of-two INT4 group (48) and an output buffer that is not contiguous: try_run_unit
    declines before any launch and run_unit's reference writes the bytes."""
    tensors = _slab_layer(inter=96, hidden=192)
    params = FormatParams(int4_group=48)
    plan = RefitPlan.build(
        list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=Format.INT4_W4A16, params=params)
    )
    got, ran = _run(plan, tensors, monkeypatch, triton=True)
    want, _ = _run(plan, tensors, monkeypatch, triton=False)
    assert ran == []
    _assert_identical(plan, got, want)
    assert "power-of-two" in fourbit_slab.supports(Format.INT4_W4A16, params)

    tensors = _slab_layer()
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=Format.MXFP4))
    outs = plan.allocate(device="cpu")
    unit = plan.units[0]
    name = next(o.name for o in unit.outputs if o.scale_name)
    wide = torch.empty((outs[name].shape[1], outs[name].shape[0]), dtype=outs[name].dtype)
    outs[name] = wide.t()  # right shape and dtype, column-major
    monkeypatch.setattr(kernels, "available", lambda device=None: True)
    assert not launch.try_run_unit(unit, tensors, outs)


def test_non_finite_is_refused_naming_the_tensor_through_the_flag_group(monkeypatch):
    """An Inf in expert 1's up rows: inside the worker's collecting block the launch checks nothing
    itself; the group's one read names the checkpoint tensor and its row."""
    tensors = _slab_layer()
    gate_up = next(n for n in tensors if "gate_up" in n)
    tensors[gate_up][1, 32 + 3, 17] = float("inf")
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=Format.NVFP4))
    monkeypatch.setattr(kernels, "available", lambda device=None: True)
    real_check = fourbit_slab.FourBitLaunch.check
    monkeypatch.setattr(
        fourbit_slab.FourBitLaunch, "check", lambda self: pytest.fail("a launch was checked on its own")
    )
    outs = plan.allocate(device="cpu")
    group = kernels.FlagGroup()
    for unit in plan.units:
        with kernels.collecting(group, unit.index):
            assert launch.try_run_unit(unit, tensors, outs)
    errors = group.check()
    bad = next(u.index for u in plan.units if gate_up in u.inputs)
    assert list(errors) == [bad]
    message = str(errors[bad])
    assert ".experts.1.up_proj.weight" in message and "first in row 3 " in message
    monkeypatch.setattr(fourbit_slab.FourBitLaunch, "check", real_check)
    with pytest.raises(NonFiniteError, match=r"experts\.1\.up_proj\.weight' holds NaN or Inf"):
        launch.try_run_unit(plan.units[bad], tensors, outs)  # outside a group: checked at once


@pytest.mark.parametrize("variant", ["nvfp4-ct", "mxfp4", "int4-g128-bf16"])
def test_the_probe_slab_matches_the_reference(variant):
    """The GPU probe's own launch and comparison (run here on CPU under the interpreter)."""
    fmt, params = VARIANTS[variant]
    fourbit_slab._probe_launch(torch.device("cpu"), fmt, params)


def test_a_failed_probe_sends_the_format_to_the_reference_once(monkeypatch):
    """The 4-bit kernels fail to compile on some GPU: the probe says why, once per device, format and
    parameters, and try_run_unit declines (the reference writes the bytes)."""
    import contextlib

    tries = []

    def broken(device, fmt, params):
        tries.append((device, fmt))
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(fourbit_slab, "_probe_launch", broken)
    monkeypatch.setattr(fourbit_slab, "_probed", {})
    monkeypatch.setattr(kernels, "device_scope", lambda device: contextlib.nullcontext())
    reason = fourbit_slab.probe("cuda:2", Format.MXFP4)
    assert "mxfp4 Triton kernels failed their probe on cuda:2" in reason and "PassManager" in reason
    assert fourbit_slab.probe(torch.device("cuda", 2), Format.MXFP4) == reason and len(tries) == 1
    assert fourbit_slab.probe("cuda:2", Format.NVFP4) is not None and len(tries) == 2
    assert fourbit_slab.probe("cpu", Format.MXFP4) is None and len(tries) == 2

    tensors = _slab_layer()
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=Format.MXFP4))
    monkeypatch.setattr(launch, "probe", lambda device, fmt, params: reason)
    got, ran = _run(plan, tensors, monkeypatch, triton=True)
    want, _ = _run(plan, tensors, monkeypatch, triton=False)
    assert ran == []
    _assert_identical(plan, got, want)
    # warm-up (before READY): the plan's 4-bit format is probed; status then names the reference
    monkeypatch.setattr(
        kernels, "warm_up", lambda launches, device, compile=None: kernels.WarmUp(str(device), "triton")
    )
    done = launch.warm_up(plan, "cuda:0")
    assert (done.impl, done.reason) == ("torch", reason)
    monkeypatch.setattr(launch, "probe", lambda device, fmt, params: None)
    assert launch.warm_up(plan, "cuda:0").impl == "triton"


_AOT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sidecar.numerics.kernels import triton_fourbit_slab as tk

def build(fn, sig, consts, div16, warps=4):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    count = lambda pat: len(re.findall(pat, ptx))
    return {"div_rn": count(r"div\.rn\.f32"), "div_other": count(r"div\.(full|approx)"), "ftz": count(r"\.ftz"),
            "fma": count(r"\bfma\.rn\.f32"), "ld_v4": count(r"ld\.global(\.[a-z0-9]+)*\.v4"), "ld_v2": count(r"ld\.global(\.[a-z0-9]+)*\.v2"), "ld_1": count(r"ld\.global(\.[a-z0-9]+)*\.[bu]16\b"), "st_v": count(r"st\.global(\.[a-z0-9]+)*\.v[24]"), "st_b8": count(r"st\.global(\.[a-z0-9]+)*\.[bu]8\b"), "atom": count(r"atom\.")}

base = {"x_ptr": "*bf16", "se": "i32", "sr": "i32", "q_tab": "*i64", "s_tab": "*i64"}
hints = ["x_ptr", "se", "sr", "q_tab", "s_tab", "K"]
out = {}
for parts in (1, 2):
    for rec in (False, True):
        sig = {**base, "g_tab": "*i64", "amax_ptr": "*i32", "flag_ptr": "*i32", "rows": "i32", "K": "i32", "n_pc": "i32"}
        out[f"nvfp4 parts={parts} reciprocal={rec}"] = build(tk._nvfp4_kernel, sig, {"PARTS": parts, "IS_BF16": True, "RECIPROCAL": rec, "NB": tk.blocks_per_program(16)}, hints)
    sig = {**base, "flag_ptr": "*i32", "rows": "i32", "K": "i32", "n_pc": "i32"}
    out[f"mxfp4 parts={parts}"] = build(tk._mxfp4_kernel, sig, {"PARTS": parts, "IS_BF16": True, "NB": tk.blocks_per_program(32)}, hints)
    for g, bf in ((32, True), (128, False), (1024, True)):
        sig = {**base, "shape_tab": "*i64", "flag_ptr": "*i32", "rows": "i32", "K": "i32", "n_pc": "i32"}
        out[f"int4 parts={parts} g={g} bf16={bf}"] = build(tk._int4_kernel, sig, {"PARTS": parts, "IS_BF16": True, "G": g, "SCALE_BF16": bf, "NB": tk.blocks_per_program(g)}, hints)
sig = {"x_ptr": "*bf16", "se": "i32", "sr": "i32", "amax_ptr": "*i32", "total_rows": "i32", "K": "i32", "n_chunks": "i32"}
out["amax"] = build(tk._amax_kernel, sig, {"BR": 8, "BK": 256, "ROW_ITERS": 8, "COL_ITERS": 8, "IS_BF16": True}, ["x_ptr", "se", "sr", "K"])
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_slab_kernels_compile_for_hopper_with_exact_arithmetic():
    """Every 4-bit slab kernel (both part counts, both NVFP4 names, INT4 groups 32 / 128 / 1024 in
    both scale dtypes, the amax pass) compiles to sm_90 PTX here, without a GPU: correctly rounded
    division only (``div.rn.f32``, never ``div.full``/``div.approx``), no flush-to-zero, no fused
    multiply-add (SPEC rounds every step), and bf16 loads 16 bytes at a time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _AOT], capture_output=True, text=True, timeout=600, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(facts) == 13
    for name, f in facts.items():
        assert f["ftz"] == 0 and f["div_other"] == 0 and f["fma"] == 0, (name, f)
        assert f["ld_v4"] > 0 and f["atom"] > 0, (name, f)
        if name.startswith(("nvfp4", "int4")):
            assert f["div_rn"] > 0, (name, f)


def test_quantize_worker_runs_a_fourbit_layer_on_the_kernels_with_one_flag_read(monkeypatch):
    """The daemon's quantize worker (sidecar.daemon.worker.QuantWorker) on a queued NVFP4 layer: the
    units go to the kernels, no launch is checked on its own, one group read reports every unit;
    the unit whose slab held a NaN fails naming its checkpoint tensor, the other's bytes equal the
    reference's."""
    import threading

    import zmq

    from sidecar.daemon.worker import QuantWorker

    tensors = _slab_layer()
    want, _ = _run(
        RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=Format.NVFP4)),
        tensors,
        monkeypatch,
        triton=False,
    )
    down = next(n for n in tensors if "down" in n)
    tensors[down][1, 5, 7] = float("nan")
    plan = RefitPlan.build(list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=Format.NVFP4))
    monkeypatch.setattr(kernels, "available", lambda device=None: True)
    monkeypatch.setattr(
        fourbit_slab.FourBitLaunch, "check", lambda self: pytest.fail("a launch was checked on its own")
    )
    reads = []
    real_check = kernels.FlagGroup.check
    monkeypatch.setattr(kernels.FlagGroup, "check", lambda self: reads.append(len(self)) or real_check(self))
    outputs = plan.allocate(device="cpu")
    ctx = zmq.Context()
    wake = ctx.socket(zmq.PULL)
    wake.bind("inproc://test-fourbit-flags")
    worker = QuantWorker(ctx, "inproc://test-fourbit-flags")
    try:
        release = threading.Event()
        first = plan.units[0]

        class Held(dict):
            def __getitem__(self, name):
                release.wait(30)  # the other unit queues up behind this one: one batch
                return super().__getitem__(name)

        worker.submit(0, first, Held({n: tensors[n] for n in first.inputs}), outputs)
        for unit in plan.units[1:]:
            worker.submit(0, unit, {n: tensors[n] for n in unit.inputs}, outputs)
        release.set()
        done = {d.unit: d for d in (worker.results.get(timeout=300) for _ in plan.units)}
    finally:
        worker.close()
        wake.close(linger=0)
        ctx.term()
    assert reads == [len(plan.units)]  # one read for the batch: one quantize launch per slab unit
    for unit in plan.units:
        if down in unit.inputs:
            assert isinstance(done[unit.index].error, NonFiniteError)
            assert ".1.down_proj.weight" in str(done[unit.index].error)
        else:
            assert done[unit.index].error is None, done[unit.index].error
            for o in unit.outputs:
                assert torch.equal(_bits(outputs[o.name]), _bits(want[o.name])), o.name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_warm_up_compiles_a_fourbit_plans_specialisations_once(variant, monkeypatch):
    """Before READY the daemon compiles each distinct 4-bit launch of its plan (a second layer adds
    nothing; gate_up's two parts and down's one are different kernels), with the plan's format
    parameters, every call's arguments matching its kernel's signature."""
    import contextlib

    fmt, params = VARIANTS[variant]
    g = params.int4_group if fmt is Format.INT4_W4A16 else 32
    one = _slab_layer(inter=g, hidden=max(64, g))
    two = {**one, **{k.replace("layers.0", "layers.1"): v for k, v in one.items()}}
    monkeypatch.setattr(
        kernels, "warm_up", lambda launches, device, compile=None: kernels.WarmUp(str(device), "triton")
    )
    monkeypatch.setattr(launch, "probe", lambda device, fmt, params: None)
    monkeypatch.setattr(kernels, "device_scope", lambda device: contextlib.nullcontext())
    counts = []
    for tensors in (one, two):
        plan = RefitPlan.build(
            list(tensors.items()), RefitSpec(model_type="qwen3_5_moe", fmt=fmt, params=params)
        )
        compiled: list = []
        done = launch.warm_up(plan, "cuda:0", compile=compiled.extend)
        assert done.impl == "triton" and done.compiled == len(compiled)
        counts.append(len(compiled))
        for call in compiled:
            constexprs = {k: v for k, v in call.kwargs.items() if k not in ("num_warps", "enable_fp_fusion")}
            assert len(call.args) + len(constexprs) == len(call.kernel.arg_names), call.kernel.fn.__name__
        quantize = [c for c in compiled if c.kernel.fn.__name__ != "_amax_kernel"]
        assert {c.kwargs["PARTS"] for c in quantize} == {1, 2}
        if fmt is Format.INT4_W4A16:
            assert {c.kwargs["G"] for c in quantize} == {params.int4_group}
        assert any(c.kernel.fn.__name__ == "_amax_kernel" for c in compiled) is (fmt is Format.NVFP4)
    assert counts[0] == counts[1] > 0


def test_an_engines_new_format_parameters_are_probed_when_the_plan_is_adopted(monkeypatch):
    """Red-team check: an engine attaching with other INT4 parameters than the daemon started with
    (group 128 for group 32) makes the daemon adopt a new plan with no step in progress. Its kernels
    are probed then, so status names the quantizer that runs it: here the probe for group 128 fails,
    and status says the torch reference, with the reason (it kept saying the warm-up's Triton
    kernels, while every unit ran on the reference). A plan in the same parameters probes nothing."""
    import contextlib
    from types import SimpleNamespace

    from sidecar.daemon import loop as daemon_loop

    tensors = _slab_layer(inter=128, hidden=128)

    def plan_in(params):
        spec = RefitSpec(model_type="qwen3_5_moe", fmt=Format.INT4_W4A16, params=params)
        return RefitPlan.build(list(tensors.items()), spec)

    failed = "the int4_w4a16 Triton kernels failed their probe on cuda:0 (RuntimeError: bytes differ)"
    probed = []
    monkeypatch.setattr(
        launch,
        "probe",
        lambda device, fmt, params: probed.append(params) or (failed if params.int4_group == 128 else None),
    )
    monkeypatch.setattr(
        kernels, "warm_up", lambda launches, device, compile=None: kernels.WarmUp(str(device), "triton")
    )
    monkeypatch.setattr(launch, "_warm_up_fourbit", lambda plan, device, compile: 3)
    monkeypatch.setattr(kernels, "device_scope", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(daemon_loop, "freeze_long_lived", lambda: None)
    staging = SimpleNamespace(device=0)
    arenas = SimpleNamespace(
        kind=daemon_loop.ArenaKind.CUDA_IPC,
        staging=staging,
        stagings=[staging],
        apply_plan=lambda p: None,
        invalidate=lambda: None,
    )
    daemon = SimpleNamespace(plan=plan_in(FormatParams()), arenas=arenas)
    daemon._warm_up = lambda: daemon_loop.Daemon._warm_up(daemon)
    daemon.quantizer = daemon._warm_up()
    assert daemon.quantizer.impl == "triton" and len(probed) == 1

    daemon_loop.Daemon.adopt_plan(daemon, plan_in(FormatParams()), invalidate=True)  # same parameters
    assert daemon.quantizer.impl == "triton" and len(probed) == 1
    daemon_loop.Daemon.adopt_plan(daemon, plan_in(FormatParams(int4_group=128)), invalidate=True)
    assert (daemon.quantizer.impl, daemon.quantizer.reason) == ("torch", failed)
    assert probed[-1] == FormatParams(int4_group=128)
    # the metrics gauge follows on the next tick: the reference with its reason, the old labels gone
    from sidecar.ops.metrics import MetricsObserver

    m = MetricsObserver("127.0.0.1:0")
    try:
        m.on_ready(SimpleNamespace(quantizer=kernels.WarmUp("cuda:0", "triton"), engines={}))
        daemon.engines = {}
        m.on_tick(daemon, 0.0)
        sample = m.registry.get_sample_value
        assert sample("refitd_quantizer", {"impl": "torch", "device": "cuda:0", "reason": failed}) == 1.0
        assert sample("refitd_quantizer", {"impl": "triton", "device": "cuda:0", "reason": ""}) is None
    finally:
        m.close()


ADVERSARIAL = {
    **VARIANTS,
    "int4-g8-bf16": (Format.INT4_W4A16, FormatParams(int4_group=8)),
    "int4-g2048-f32": (Format.INT4_W4A16, FormatParams(int4_group=2048, int4_scale_dtype="float32")),
}


@pytest.mark.parametrize("variant", list(ADVERSARIAL))
def test_slab_kernels_on_odd_shapes_and_edge_values(variant):
    """Red-team check (found no defect; kept as a regression test): the slab kernels straight, byte for
    byte against the reference per (expert, part), with 3 experts, K at the format's smallest multiple
    and with a partial last program, a strided slab (rows of a wider tensor, experts skipped), every
    input dtype, and zeros, -0.0, bf16 subnormals, float32 values whose NVFP4 global scale underflows
    to 0 and magnitudes spread over 2^±40 (an up row's amax in the last, partial piece)."""
    from sidecar.numerics import fourbit

    fmt, params = ADVERSARIAL[variant]
    g = torch.Generator().manual_seed(11)
    kmin = params.k_multiple(fmt)

    def reference(slab, parts):
        rows, want = slab.shape[1] // parts, []
        for e in range(slab.shape[0]):
            gs = fourbit.nvfp4_global_scale(slab[e]) if fmt is Format.NVFP4 else None
            row = []
            for p in range(parts):
                x = slab[e, p * rows : (p + 1) * rows]
                if fmt is Format.NVFP4:
                    q, s, gg = fourbit.quantize_nvfp4(x, global_scale=gs)
                    row.append((q, s, torch.reciprocal(gg).reshape(1) if params is CT else gg))
                elif fmt is Format.MXFP4:
                    row.append(fourbit.quantize_mxfp4(x))
                else:
                    kw = {"group": params.int4_group, "scale_dtype": params.int4_scale_torch_dtype}
                    row.append(fourbit.quantize_int4(x, **kw))
            want.append(row)
        return want

    def check(slab, parts):
        want = reference(slab, parts)
        outs = [[tuple(torch.full_like(t, 0).view(torch.uint8).fill_(0xA5).view(t.dtype) if t.dim() else torch.full_like(t, 7.0) for t in w) for w in row] for row in want]  # fmt: skip
        amax = torch.zeros(slab.shape[0], dtype=torch.int32)
        if fmt is Format.NVFP4:
            fourbit_slab.amax_slab(slab, amax)
        names = [[f"e{e}.p{p}" for p in range(parts)] for e in range(slab.shape[0])]
        fourbit_slab.quantize_slab_fourbit(slab, fmt, outs, names=names, params=params, amax=amax)
        for e, row in enumerate(want):
            for p, bufs in enumerate(row):
                for got, ref in zip(outs[e][p], bufs, strict=True):
                    assert torch.equal(_bits(got).reshape(-1), _bits(ref).reshape(-1)), (e, p, slab.dtype)

    tiny = float.fromhex("0x1p-149")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        k = kmin if kmin >= 1024 else kmin * (1024 // kmin + 1)  # K: one full program and a partial one
        for kk in {kmin, k}:
            x = torch.randn(3, 4, kk, generator=g)
            x *= torch.exp2(torch.randint(-40, 40, x.shape, generator=g).float())
            x.view(-1)[::5] = 0.0
            x.view(-1)[1::7] = -0.0
            x.view(-1)[2::11] = float.fromhex("0x1p-133")  # the smallest bf16 subnormal
            x[1, 3, -1] = 1e30  # an up row's amax, in its last piece
            if dtype is torch.float16:
                x = x.clamp(-60000, 60000)
            check(x.to(dtype), 2)
        if dtype is torch.float32:  # amax 3 * 2^-149: NVFP4's gs = amax / 2688 underflows to 0
            check(torch.tensor([tiny, -tiny, 0.0, 3 * tiny] * (kmin // 2)).reshape(1, 2, kmin), 2)
        wide = (100 * torch.randn(5, 9, 3 * kmin, generator=g)).to(dtype)
        check(wide[::2, 1:9, kmin : 2 * kmin], 2)  # expert and row strides of a wider tensor
