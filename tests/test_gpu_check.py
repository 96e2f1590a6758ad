"""bench/gpu_check.py on the CPU: the one-command GPU check runs its own code paths with tiny shapes.

The GPU machine runs the same script once (``python bench/gpu_check.py --out ...``), so everything
that does not need a GPU is exercised here: argument handling, the comparison and its report of the
first mismatch, byte accounting, the torch.compile baseline's arithmetic (run eagerly), the engine's
check, and a full ``--device cpu --small`` run: correctness and timing with pyzmq and NIXL made
unimportable in the checking process, and the real trainer -> ``refitd serve --arena shm`` ->
engine round trip, whose processes import pyzmq themselves.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sidecar.numerics import reference as quant
from sidecar.numerics.formats import FP8_FORMATS, Format

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


gc = _load()


def test_cpu_dry_run_end_to_end(tmp_path):
    """`gpu_check.py --device cpu --small` runs every section without pyzmq or NIXL, writes JSON, and
    reports the kernels as skipped with the capability predicate's reason; its refit stages through
    a ring of two regions, as a GPU run does by default."""
    out = tmp_path / "check.json"
    argv = [str(SCRIPT), "--device", "cpu", "--small", "--iters", "1", "--warmup", "0", "--out", str(out)]
    argv += ["--staging-regions", "2"]  # the staging ring GPU arenas use by default
    code = (
        "import runpy, sys\n"
        "sys.modules['zmq'] = None; sys.modules['nixl'] = None  # the GPU machine has neither\n"
        f"sys.argv = {argv!r}\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = report["correctness"]
    assert checks and all(c["ok"] is not False for c in checks), [c for c in checks if c["ok"] is False][:3]
    ran = {(c["impl"], c["fmt"]) for c in checks if c["ok"]}
    assert {("torch-slab", f.value) for f in FP8_FORMATS} <= ran
    skipped = [c for c in checks if c["ok"] is None]
    assert skipped and all("CUDA tensors only" in c["status"] for c in skipped)
    timing = report["timing"]
    assert timing["copy"]["gbps"] > 0
    whats = {(r["fmt"], r["what"]) for r in timing["rows"]}
    assert ("block_fp8", "torch reference, per expert (run_unit)") in whats
    assert ("mxfp8", "triton") in whats
    e2e = report["e2e"]
    assert e2e["status"] == "ran" and e2e["ok"], e2e
    assert [r["fmt"] for r in e2e["rounds"]] == ["block_fp8", "mxfp8", "fp8_per_tensor"]
    assert e2e["copy_gbps"] > 0 and e2e["staging_regions"] == 2
    assert report["tiers"]["status"].startswith("planned only") and report["tiers"]["ok"] is True
    fourbit = report["fourbit"]  # the 4-bit section: the fallback timed against the copy, kernels skipped
    assert fourbit["ok"] is True and fourbit["copy"]["gbps"] > 0
    variants = {r["variant"] for r in fourbit["rows"]}
    assert {"nvfp4", "nvfp4 (compressed-tensors)", "mxfp4", "int4 g32 bf16", "int4 g128 f32"} == variants
    assert all("CUDA tensors only" in r["status"] for r in fourbit["rows"] if r["impl"] == "triton")
    assert all(r["of_copy"] > 0 for r in fourbit["rows"] if r["impl"] != "triton")
    for r in e2e["rounds"]:
        assert "--arena shm" in r["daemon"] and "--world-size 1" in r["daemon"], r["daemon"]
        assert "--staging-regions 2" in r["daemon"], r["daemon"]
        assert [s["step"] for s in r["steps"]] == [0, 1], r
        for s in r["steps"]:
            assert s["engine"]["ok"] and not s["engine"]["mismatched"] and s["engine"]["sampled"] > 0, s
            assert [ld["ok"] for ld in s["loads"]] == [True], s["loads"]  # wait="loaded": the engine's ack
            assert s["bytes_in"] > s["bytes_out"] > 0 and s["engine"]["bytes"] == s["bytes_out"]
            for phase in ("copy_s", "quantize_s", "publish_s", "engine_load_s", "total_s"):
                assert s[phase] >= 0, (phase, s)
            assert s["floor_s"]["total"] > 0 and s["of_floor"] == s["total_s"] / s["floor_s"]["total"]
    assert "correctness:" in proc.stdout and "e2e: ran" in proc.stdout
    assert "of the floor" in proc.stdout


@pytest.mark.parametrize("fmt", [f for f in FP8_FORMATS], ids=lambda f: f.value)
def test_engine_check_catches_a_flipped_byte(fmt):
    """The engine's check: the regenerated layer-0 inputs through sidecar.numerics.reference equal the daemon's
    conversion, and one flipped byte in a layer-0 expert (or a copy that differs) is named."""
    from sidecar.plan.build import RefitSpec
    from sidecar.plan.run import convert

    config = gc._e2e_config(gc.SMALL, 2)
    plan = gc._e2e_plan(config, fmt.value)
    state = {
        i.name: gc._fill(torch.empty(i.shape, dtype=i.dtype), i.name, 5, 1)
        for i in gc._e2e_plan(config, "bf16").inputs
    }
    published = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt=fmt.value))
    buffers = {n: t.clone() for n, t in published.items()}
    bad, sampled = gc._engine_check(plan, published, buffers, fmt, 5, 1, torch.device("cpu"))
    assert not bad and sampled > 2 * gc.SMALL.experts
    name = next(o.name for o in plan.outputs if ".layers.0." in o.name and o.expert == 3 and o.scale_name)
    buffers[name].view(torch.uint8).reshape(-1)[7] ^= 1
    bad, _ = gc._engine_check(plan, published, buffers, fmt, 5, 1, torch.device("cpu"))
    assert name in bad
    assert gc._engine_check(plan, published, buffers, fmt, 5, 2, torch.device("cpu"))[
        0
    ]  # another step's weights


def test_stage_floor_counts_reads_and_writes():
    f = gc._stage_floor({"bytes_in": 4e9, "bytes_out": 2e9}, gbps=100.0)
    assert f["copy"] == 0.08 and f["quantize"] == 0.06 and f["load"] == 0.04
    assert abs(f["total"] - 0.18) < 1e-12


def test_args_defaults():
    args = gc.parse_args(["--dry-run"])
    assert args.device.type == "cpu" and args.small and not args.compile
    assert args.out.name == "gpu-check-cpu.json" and args.out.parent.name == "results"
    assert gc.parse_args(["--device", "cpu", "--compile", "on"]).compile
    assert gc.parse_args(["--seed", "7"]).seed == 7


def test_compare_names_the_first_mismatch():
    """A single flipped value byte and a single scale bit: counted, and located."""
    slab = torch.randn(3, 64, 64).bfloat16()
    want = gc._run_case(gc.torch_slab, slab, Format.BLOCK_FP8, 2, torch.device("cpu"))
    got = gc._run_case(gc.torch_slab, slab, Format.BLOCK_FP8, 2, torch.device("cpu"))
    assert gc.compare(got, want)["ok"]
    got.q.view(torch.uint8)[2, 1, 5, 7] ^= 1
    got.s.view(torch.int32)[0, 0, 0, 0] ^= 1
    res = gc.compare(got, want)
    assert not res["ok"] and res["values_mismatched"] == 1 and res["scales_mismatched"] == 1
    assert res["first"]["what"] == "values" and (res["first"]["expert"], res["first"]["part"]) == (2, 1)
    assert res["first"]["index"] == (5, 7)


def test_unwritten_outputs_show_as_mismatches():
    """Outputs start as NaN bytes: an implementation that skips an expert cannot pass."""
    slab = torch.randn(2, 64, 64).bfloat16()
    want = gc._run_case(gc.torch_slab, slab, Format.MXFP8, 1, torch.device("cpu"))

    def lazy(slab, fmt, outs, names, config=None):
        gc.torch_slab(slab[:1], fmt, outs[:1], names[:1])

    res = gc.compare(gc._run_case(lazy, slab, Format.MXFP8, 1, torch.device("cpu")), want)
    assert not res["ok"] and res["first"]["expert"] == 1


def test_bytes_moved_for_a_qwen35_layer():
    shape = gc.QWEN35
    n = 3 * 256 * 512 * 2048
    assert shape.numel == n
    assert gc.bytes_moved(shape, Format.FP8_PER_TENSOR) == 3 * n + 4 * 256 * 3
    assert gc.bytes_moved(shape, Format.MXFP8) == 3 * n + n // 32
    blocks = 256 * (2 * 4 * 16 + 16 * 4)  # gate and up [512, 2048]: 4 x 16 tiles; down [2048, 512]: 16 x 4
    assert gc.bytes_moved(shape, Format.BLOCK_FP8) == 3 * n + 4 * blocks


@pytest.mark.parametrize("fmt", [f for f in FP8_FORMATS], ids=lambda f: f.value)
def test_compile_baseline_arithmetic_is_the_reference(fmt):
    """The whole-slab function handed to torch.compile equals the reference when run eagerly, so a
    mismatch reported on the GPU is the compiler's (e.g. a division it does not round correctly)."""
    g = torch.Generator().manual_seed(1)
    slab = (torch.randn(3, 256, 384, generator=g) * 0.05).bfloat16()
    slab[0, :128, :128] = 0
    want = {"s": gc._run_case(gc.torch_slab, slab, fmt, 2, torch.device("cpu"))}
    q, s = gc.compiled_reference(fmt)(slab, torch.full((), 448.0))
    assert gc._compiled_matches(fmt, {"s": (q, s)}, want, gc.SMALL) == 0
    if fmt is Format.BLOCK_FP8:
        rq, _ = quant.quantize_block_fp8(slab)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_a_dead_child_is_noticed_at_once_not_after_the_timeout():
    """An engine process that dies before answering: the parent closed its copy of the child's pipe
    end and waits on the process sentinel too, so the wait ends with the exit status instead of
    hanging for the whole timeout (up to ~7.5 min on the GPU machine)."""
    import multiprocessing as mp

    # sys.exit(<its pipe end>): a child that exits with status 1 without sending anything
    child = gc.Child.spawn(mp.get_context("spawn"), "engine", sys.exit)
    try:
        with pytest.raises(RuntimeError, match="the engine process exited with status 1 without answering"):
            child.recv(timeout=600)
    finally:
        child.proc.join(10)
        child.conn.close()


def test_a_failing_section_is_recorded_and_the_json_written_as_each_section_ends(tmp_path, monkeypatch):
    """The GPU torch reference raising in the correctness section: the error is a row of the report,
    the next sections still run, the JSON on disk already holds each finished section when the next
    starts, and the exit status says something failed. The environment is printed first."""
    out = tmp_path / "check.json"
    seen_on_disk = {}

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def timing(device, shape, args, impls):
        seen_on_disk.update(json.loads(out.read_text()))
        return {"rows": [], "checks": []}

    monkeypatch.setattr(gc, "check_random", broken)
    monkeypatch.setattr(gc, "timing_section", timing)
    code = gc.main(["--device", "cpu", "--small", "--skip", "e2e", "--out", str(out)])
    assert code == 1
    report = json.loads(out.read_text())
    errors = [c for c in report["correctness"] if c["ok"] is False]
    assert len(errors) == 1 and "illegal memory access" in errors[0]["status"]
    assert any(c["ok"] for c in report["correctness"])  # the non-finite and table checks still ran
    assert "illegal memory access" in json.dumps(seen_on_disk["correctness"])
    env = report["meta"]["environment"]
    for key in ("python", "torch", "triton", "numpy", "driver", "cuda-bindings", "pyzmq", "msgpack", "gpu"):
        assert key in env, key


def test_environment_names_what_is_missing():
    assert gc._version("refitd_no_such_module").startswith("missing (ModuleNotFoundError")
    assert gc._version("shlex") == "installed"  # importable, no version to tell
    assert gc._driver_version().startswith(("none", "CUDA", "libcuda"))


def test_tiers_section_plans_a_qwen3_5_shaped_model_within_the_budget_on_cpu(capsys):
    """The tiers section (bench/gpu_tiers.py) without a GPU: its defaults, the real Qwen3.5-35B-A3B
    layers cut to 4, and the device tier the 4 GiB budget gives (what a GPU run then allocates and
    measures); the report prints."""
    args = gc.parse_args(["--device", "cpu", "--skip", "correctness", "timing", "e2e"])
    assert (args.tiers_layers, args.tiers_budget) == (4, 4 << 30)
    plan = gc.gpu_tiers.tiers_plan(4, small=False)
    assert plan.num_hidden_layers == 4
    assert any(i.name.endswith("layers.3.mlp.experts.gate_up_proj") for i in plan.inputs)
    t = gc.gpu_tiers.tiers_section(torch.device("cpu"), args)
    assert t["status"].startswith("planned only") and t["ok"] is True
    p = t["plan"]
    assert p["device_bytes"] <= 4 << 30 and p["regions"] >= 2 and p["split"]
    assert p["staging_region"] >= 1 << 30  # a grouped gate_up slab (1 GiB) is never cut
    gc.gpu_tiers.print_tiers(t)
    assert "ring regions" in capsys.readouterr().out
