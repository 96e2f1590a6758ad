"""``refitd plan``: the report on the real configs, its JSON form, and its exit codes."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from sidecar.cli import plan as plan_cli
from sidecar.cli.demo.synthetic import make_hf_config

DATA = Path(__file__).parent / "data"
QWEN3_5 = str(DATA / "qwen3.5-35b-a3b.config.json")
QWEN3 = str(DATA / "qwen3-30b-a3b.config.json")
GIB = 2**30


def run_plan(*argv: str) -> int:
    """Parse and run ``refitd plan ARGV`` the way sidecar.cli.main does."""
    parser = argparse.ArgumentParser(prog="refitd")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def run_json(capsys, *argv: str) -> dict:
    assert run_plan(*argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_5_text_report(capsys):
    assert run_plan(QWEN3_5, "--format", "block_fp8") == 0
    out = capsys.readouterr().out
    assert "model qwen3_5_moe, 40 layers; routed experts -> block_fp8" in out
    assert "82 grouped slabs + 0 per-expert tensors -> 31488 FP8 weights" in out
    assert "33,017,561,088 params: 61.50 GiB in" in out  # 40 layers + MTP, 1.5 GiB each
    assert "mtp.0" in out and "linear_attention" in out and "shared_expert" in out
    assert "largest inputs:" in out and "gate_up_proj [256x1024x2048]" in out
    assert "Traceback" not in out


def test_qwen3_5_json_totals(capsys):
    s = run_json(capsys, QWEN3_5, "--format", "mxfp8", "--last-bf16", "2", "--ignore", "mtp.*")
    assert s["model_type"] == "qwen3_5_moe" and s["format"] == "mxfp8" and s["num_hidden_layers"] == 40
    assert s["routed_expert_params"] == 41 * 805_306_368
    assert s["quantized"]["params"] == 38 * 805_306_368
    assert s["kept_bf16_experts"] == {"ignore_pattern": 2, "last_layers": 4}
    assert [row["layer"] for row in s["layers"]] == [*map(str, range(40)), "mtp.0", "-"]
    layer0 = s["layers"][0]
    assert layer0["quantized_inputs"] == 2 and layer0["passthrough_inputs"] == 16
    assert s["layers"][39]["quantized_inputs"] == 0
    assert s["totals"]["bytes_in"] == sum(row["bytes_in"] for row in s["layers"])
    assert s["totals"]["ratio"] == pytest.approx(s["totals"]["bytes_out"] / s["totals"]["bytes_in"])
    assert s["ignore_patterns"] == ["mtp.*"]


def test_qwen3_json_totals(capsys):
    s = run_json(capsys, QWEN3, "--format", "block_fp8")
    assert s["num_hidden_layers"] == 48
    assert s["quantized"]["params"] == s["routed_expert_params"] == 28_991_029_248
    assert s["quantized"]["bytes_in"] == 54 * GIB
    assert s["quantized"]["expert_tensors"] == 48 * 128 * 3 and s["quantized"]["slabs"] == 0
    assert s["quantized"]["bytes_out"] == 27 * GIB + 6.75 * 2**20  # FP8 values + FP32 block scales
    assert s["passthrough"]["attention"]["tensors"] == 48 * 6
    assert len(s["layers"]) == 49


def test_qwen3_text_report_with_exclusions(capsys):
    assert (
        run_plan(QWEN3, "--format", "fp8_per_tensor", "--first-bf16", "1", "--ignore", "*.experts.0.*") == 0
    )
    out = capsys.readouterr().out
    assert "first 1, last 0 layers; ignore patterns: *.experts.0.*" in out
    assert "routed-expert tensors kept BF16: 525 (first_layers 384, ignore_pattern 141)" in out
    assert f"{47 * 127 * 3 * 768 * 2048:,} params" in out  # layers 1..47, experts 1..127


def test_plan_errors_exit_1_with_the_message(capsys, tmp_path):
    assert run_plan(QWEN3, "--format", "block_fp8", "--first-bf16", "30", "--last-bf16", "30") == 1
    err = capsys.readouterr().err
    assert "exceeds the model's 48 layers" in err and "Traceback" not in err
    unaligned = tmp_path / "odd.json"
    unaligned.write_text(json.dumps(make_hf_config("qwen3_5_moe", hidden=100, intermediate=40)))
    assert run_plan(str(unaligned), "--format", "mxfp8") == 1
    err = capsys.readouterr().err
    assert "mxfp8 needs the input dim to be a multiple of 32" in err
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in err
    other = tmp_path / "llama.json"
    other.write_text(json.dumps({"model_type": "llama"}))
    assert run_plan(str(other), "--format", "mxfp8") == 1
    assert "unknown model type 'llama'" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys, tmp_path):
    assert run_plan(str(tmp_path / "missing.json"), "--format", "bf16") == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_plan(str(bad), "--format", "bf16") == 2
    assert "not valid JSON" in capsys.readouterr().err
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert run_plan(str(listed), "--format", "bf16") == 2
    with pytest.raises(SystemExit) as exit_:
        run_plan(QWEN3, "--format", "int4")
    assert exit_.value.code == 2
    assert "unknown format 'int4'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        run_plan(QWEN3, "--format", "bf16", "--last-bf16", "-1")
    assert exit_.value.code == 2


@pytest.mark.skipif(
    importlib.util.find_spec("sidecar.cli.demo.command") is None,
    reason="sidecar.cli.demo.command not written yet",
)
def test_through_the_refitd_entry_point(capsys):
    from sidecar.cli.main import main

    assert main(["plan", QWEN3, "--format", "mxfp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "mxfp8"


def test_plan_says_what_the_daemon_allocates_with_and_without_a_staging_ring(capsys):
    """Qwen3.5-35B-A3B: staging a whole step is 66 GiB; the default GPU ring of four layer groups
    is 6.3 GiB, so the daemon's GPU needs 77 GiB instead of 137 GiB with its two generations."""
    s = run_json(capsys, QWEN3_5, "--format", "block_fp8")
    m = s["memory"]
    assert m["staging_whole"] >= s["totals"]["bytes_in"] and m["generation"] >= s["totals"]["bytes_out"]
    assert (m["ring_groups"], m["ring_regions"], m["generations"]) == (48, 4, 2)
    assert m["staging_ring"] == 4 * m["ring_region"] < m["staging_whole"] / 10
    assert run_plan(QWEN3_5, "--format", "block_fp8") == 0
    out = capsys.readouterr().out
    assert "generation_residency = device): 2 generations of 35.39 GiB, plus staging:" in out
    assert "whole steps (staging_regions = 0; shm default)" in out and "136.92 GiB" in out
    assert "ring of 4 x 1.57 GiB, 48 layer groups" in out and "77.06 GiB" in out


# ---- the DeepSeek-V3 family and GLM-4.5 real configs, with a node's share
#
# One run per config (each plans ~46-70k tensors). Published block-FP8 checkpoint sizes to compare:
# deepseek-ai/DeepSeek-V3 holds 688.6 GB of safetensors (weights + weight_scale_inv; the plan's 688.57e9
# bytes of outputs are those same tensors).

DEEPSEEK_V3 = str(DATA / "deepseek_v3.config.json")
KIMI_K2 = str(DATA / "kimi-k2.config.json")
GLM4_5 = str(DATA / "glm-4.5.config.json")


def test_deepseek_v3_block_fp8_and_a_node_of_ep16_over_two_nodes(capsys):
    """DeepSeek-V3 follows its block-FP8 checkpoint (496 linears FP8 beside the routed experts); one
    of two nodes of an EP=16 engine needs about half the whole model's bytes per generation."""
    s = run_json(capsys, DEEPSEEK_V3, "--format", "block_fp8", "--engine-ep", "16", "--nodes", "2")
    assert s["model_type"] == "deepseek_v3" and s["num_hidden_layers"] == 61 and s["quantize_linears"]
    assert s["routed_expert_params"] == 59 * 256 * 3 * 2048 * 7168  # 58 MoE layers + the MTP layer
    assert s["linears"]["tensors"] == 496 and s["linears"]["params"] == 15_387_983_872
    assert s["totals"]["bytes_in"] == 1_368_979_721_216
    assert s["totals"]["bytes_out"] == 688_574_839_360  # 641.29 GiB, the size of the FP8 checkpoint
    assert s["passthrough"]["router"]["tensors"] == 118  # 59 gates + 59 FP32 biases
    share = s["node_share"]
    assert (share["ep"], share["nodes"], share["node"]) == (16, 2, 0)
    assert share["dropped_inputs"] == 59 * 128 * 3
    ratio = share["memory"]["generation"] / s["memory"]["generation"]
    assert 0.5 < ratio < 0.53 and share["memory"]["generation"] == 355_902_128_128  # 331.46 GiB
    assert_tiers_fit(s["tiers"], generation=355_902_128_128)


def assert_tiers_fit(t: dict, *, generation: int, regions: int = 2) -> None:
    """The default 8 x H200 node: the rings within the 4 GiB budget on the GPU, the node's two
    generations in host memory (what `refitd serve` with the new defaults allocates)."""
    assert t["shape"]["name"] == "8 x H200" and t["budget"] == 4 * GIB and t["residency"] == "host"
    assert t["fits"] and t["problems"] == []
    gpu = t["gpu"]
    assert gpu["device_bytes"] <= 4 * GIB and gpu["generations"] == 0 and gpu["regions"] == regions
    assert gpu["staging_ring"] == gpu["regions"] * gpu["staging_region"]
    assert t["generation"] == generation and t["host_generations"] == 2 * generation


def test_kimi_k2_a_node_of_ep32_over_four_nodes(capsys):
    s = run_json(capsys, KIMI_K2, "--format", "block_fp8", "--engine-ep", "32", "--nodes", "4")
    assert s["model_type"] == "deepseek_v3" and s["num_hidden_layers"] == 61
    assert s["routed_expert_params"] == 60 * 384 * 3 * 2048 * 7168
    assert s["totals"]["bytes_out"] == 1_029_173_249_888  # 958.5 GiB
    share = s["node_share"]
    assert share["memory"]["generation"] == 267_972_955_136  # 249.6 GiB, 0.26 of the whole
    assert share["dropped_inputs"] == 60 * 288 * 3
    assert_tiers_fit(s["tiers"], generation=267_972_955_136, regions=1)  # its 2.19 GiB embedding: one region


def test_glm4_5_bf16_checkpoint_quantizes_routed_experts_only(capsys):
    s = run_json(capsys, GLM4_5, "--format", "block_fp8", "--engine-ep", "16", "--nodes", "2")
    assert s["model_type"] == "glm4_moe" and s["num_hidden_layers"] == 92 and not s["quantize_linears"]
    assert s["linears"]["tensors"] == 0
    assert s["routed_expert_params"] == 90 * 160 * 3 * 1536 * 5120
    assert s["totals"]["bytes_in"] == 716_675_611_392
    assert s["totals"]["bytes_out"] == 377_019_931_392
    assert s["node_share"]["memory"]["generation"] == 207_111_923_712
    assert_tiers_fit(s["tiers"], generation=207_111_923_712)


def test_the_done_when_command_reports_memory_per_tier_and_what_does_not_fit(capsys):
    """`refitd plan qwen3.5 --format block_fp8 --engine-ep 16 --nodes 2`: per GPU within the budget,
    per node the host generations; a GB200 tray with too little host memory or a budget above the
    HBM says plainly what does not fit and what to change."""
    argv = (QWEN3_5, "--format", "block_fp8", "--engine-ep", "16", "--nodes", "2")
    assert run_plan(*argv) == 0
    out = capsys.readouterr().out
    assert "memory per tier on 8 x H200: 8 GPUs x 131.32 GiB HBM, 2048.00 GiB host" in out
    assert "of a 4.00 GiB budget: fits" in out
    assert "per node: 2 host generations x 20.01 GiB = 40.02 GiB page-locked, of 2048.00 GiB: fits" in out
    assert "does not fit" not in out
    s = run_json(capsys, *argv, "--node-shape", "gb200", "--host-ram", "30GiB", "--device-budget", "200GiB")
    t = s["tiers"]
    assert (t["shape"]["gpus"], t["shape"]["hbm"], t["shape"]["host_ram"]) == (4, 186 * 10**9, 30 * GIB)
    assert not t["fits"] and len(t["problems"]) == 2
    assert "the two host generations need 40.02 GiB but the node has 30.00 GiB" in t["problems"][1]
    assert "lower --device-budget" in t["problems"][0]
    assert run_plan(*argv, "--device-budget", "64MiB", "--residency", "device") == 0
    out = capsys.readouterr().out
    assert "does not fit: generation_residency = 'device' puts 2 generations of 20.01 GiB" in out


def test_layout_errors_are_usage_failures(capsys):
    assert (
        run_plan(QWEN3, "--format", "block_fp8", "--engine-ep", "16", "--engine-tp", "16", "--nodes", "2")
        == 1
    )
    assert "spans" in capsys.readouterr().err
