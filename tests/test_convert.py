"""``refitd convert``: a BF16 checkpoint directory or a running daemon's live generation -> a Hugging
Face checkpoint directory holding exactly what the daemon publishes (names and bytes), with the
matching ``quantization_config``. SGLang's and transformers' loaders reading such a directory run in
``tests/test_adapter_sglang.py`` (make test-sglang)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapters.sglang import sglang_quantization_config
from sidecar.cli.convert import convert_generation
from sidecar.cli.main import main
from sidecar.numerics.formats import Format
from sidecar.plan.models import get_model
from sidecar.plan.run import convert
from sidecar.plan.spec import RefitSpec

CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(shape, generator=g) * 0.05).to(dtype)
        for n, shape, dtype in get_model("qwen3_moe").parameters(CONFIG)
    }


def _bf16_dir(tmp_path: Path, weights: dict[str, torch.Tensor], config: dict = CONFIG) -> Path:
    """A BF16 checkpoint in two files with an index, as trainers save them."""
    src = tmp_path / "bf16"
    src.mkdir()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: weights[n] for n in part}, str(src / file))
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(config))
    return src


def _read_dir(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(set(index.values())) == files
    tensors = {}
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                assert index[name] == file
                tensors[name] = f.get_tensor(name)
    return tensors


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)), (
            name
        )


@pytest.mark.parametrize("fmt", [Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR, Format.BF16])
def test_convert_writes_the_daemons_names_and_bytes(tmp_path, fmt):
    weights = _weights(1)
    src, out = _bf16_dir(tmp_path, weights), tmp_path / "out"
    argv = ["convert", str(src), str(out), "--format", fmt.value, "--max-shard-size", str(1 << 20)]
    assert main(argv) == 0
    spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=2)
    _same(_read_dir(out), convert(weights, spec))
    assert len(list(out.glob("*.safetensors"))) > 1  # sharded at --max-shard-size
    written = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "quantization_config"} == CONFIG
    assert written.get("quantization_config") == sglang_quantization_config(spec, CONFIG)


def test_convert_keeps_the_bf16_layers_asked_for_and_says_so_in_the_config(tmp_path):
    weights = _weights(2)
    src, out = _bf16_dir(tmp_path, weights), tmp_path / "out"
    assert (
        main(["convert", str(src), str(out), "--format", "block_fp8", "--num-last-layers-in-bf16", "1"]) == 0
    )
    got = _read_dir(out)
    assert got["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert got["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.mlp.experts" in skip and "model.layers.0.mlp.experts" not in skip


def test_vllm_mxfp8_config(tmp_path):
    src, out = _bf16_dir(tmp_path, _weights(3)), tmp_path / "out"
    assert main(["convert", str(src), str(out), "--format", "mxfp8", "--engine", "vllm"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MXFP8" and "lm_head" in qc["ignore"]


def test_bad_inputs_are_refused_with_the_reason(tmp_path, capsys):
    src, out = _bf16_dir(tmp_path, _weights(4)), tmp_path / "out"
    assert main(["convert", str(src), str(out), "--format", "block_fp8"]) == 0
    assert main(["convert", str(src), str(out), "--format", "block_fp8"]) == 1
    assert "already holds a checkpoint" in capsys.readouterr().err
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    (quantized / "config.json").write_text(
        json.dumps({**CONFIG, "quantization_config": {"quant_method": "fp8"}})
    )
    assert main(["convert", str(quantized), str(tmp_path / "o2"), "--format", "block_fp8"]) == 1
    assert "convert takes a BF16 checkpoint" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CONFIG))
    assert main(["convert", str(empty), str(tmp_path / "o3"), "--format", "block_fp8"]) == 1
    assert "no *.safetensors" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "o4")]) == 2  # no --format


def test_convert_from_a_running_daemon_writes_its_live_generation(tmp_path, daemons):
    from sidecar.client.client import RefitClient

    d = daemons(hf_config=CONFIG, format="block_fp8")
    weights = _weights(5)
    client = RefitClient(d.endpoint, 0, 1, timeout=60)
    try:
        client.push_step(3, weights)
    finally:
        client.close()
    out = tmp_path / "live"
    config = convert_generation(d.endpoint, out, CONFIG, min_step=3, timeout=60)
    spec = RefitSpec(model_type="qwen3_moe", fmt=Format.BLOCK_FP8, num_hidden_layers=2)
    _same(_read_dir(out), convert(weights, spec))
    assert config["quantization_config"] == sglang_quantization_config(spec, CONFIG)
