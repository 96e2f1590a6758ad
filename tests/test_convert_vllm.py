"""``refitd convert``'s directory loaded by vLLM 0.33.0's real model classes on CPU (make test-engines).

vLLM's real ``Qwen3MoeForCausalLM`` is built from the converted directory's ``config.json`` (its
``quantization_config`` as ``refitd convert`` writes it) and loaded by vLLM's real
``DefaultModelLoader`` from the safetensors shards, ``process_weights_after_loading`` included. The
oracle is the same model class loaded, through its own ``load_weights``, with the tensors refitd's
in-process conversion (``sidecar.plan.run.convert``: what a daemon publishes) produces from the same
BF16 weights: every parameter must be byte-equal, so the directory holds exactly the published names
and bytes under a config vLLM reads the same way.

The 4-bit directories (ModelOpt NVFP4, compressed-tensors W4A16 / MXFP4 / NVFP4) the same way, with
tests/support/vllm_models.py's replacements (EMULATION backends, Marlin's pure-torch repack). For
block-FP8, the one thing replaced, as issue 25 describes: vLLM's MoE kernel backend choice
(``select_fp8_moe_backend`` answers NONE on a CPU without AMX, ``select_unquantized_moe_backend``
CPU, whose ops the CUDA wheel lacks) is made to answer TRITON, the layout Hopper uses for block-FP8
at EP 1. No kernel runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support.vllm_models import init_distributed

from sidecar.cli.convert import convert_directory
from sidecar.numerics.formats import Format
from sidecar.plan.models import get_model
from sidecar.plan.run import convert
from sidecar.plan.spec import RefitSpec
from tests.support.engines import missing
from tests.test_convert import CONFIG, _bf16_dir

SKIP = "vLLM is not installed here: run make test-engines"


@pytest.fixture(scope="module")
def vllm_cpu():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from tests.support.sglang_cpu import cuda_free_torchvision

        cuda_free_torchvision()
        import vllm  # noqa: F401
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend  # noqa: F401
    except ImportError as exc:
        missing("vLLM does not import", SKIP, exc)


def _triton_backends(monkeypatch) -> None:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as unq
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.quantization import fp8

    monkeypatch.setattr(fp8, "select_fp8_moe_backend", lambda *a, **k: (Fp8MoeBackend.TRITON, TritonExperts))
    monkeypatch.setattr(
        unq, "select_unquantized_moe_backend", lambda *a, **k: (UnquantizedMoeBackend.TRITON, TritonExperts)
    )


def _load(model_dir: Path, load_format: str):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16"
    )
    config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format=load_format),
    )
    init_distributed(config)  # once per process: the vLLM model tests may have made the world already
    with set_current_vllm_config(config):
        # BaseModelLoader.load_model's steps, less its torch.accelerator.empty_cache() (no accelerator)
        loader = get_model_loader(config.load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=config, model_config=model_config)
        with set_default_torch_dtype(model_config.dtype):
            loader.load_weights(model, model_config)
            process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model, config


@pytest.mark.engine
def test_vllm_real_classes_load_the_converted_block_fp8_directory(vllm_cpu, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    _triton_backends(monkeypatch)
    g = torch.Generator().manual_seed(7)
    weights = {
        n: (torch.randn(shape, generator=g) * 0.05).to(dtype)
        for n, shape, dtype in get_model("qwen3_moe").parameters(CONFIG)
    }
    out = tmp_path / "fp8"
    written = convert_directory(
        _bf16_dir(tmp_path, weights), out, Format.BLOCK_FP8, engine="vllm", max_shard_bytes=1 << 20
    )
    # the oracle: the published tensors, in one file, under the same config.json
    published = convert(weights, RefitSpec(model_type="qwen3_moe", fmt=Format.BLOCK_FP8, num_hidden_layers=2))
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    save_file({n: t.contiguous() for n, t in published.items()}, str(oracle_dir / "model.safetensors"))
    (oracle_dir / "config.json").write_text(json.dumps(written))

    from_disk, _ = _load(out, "auto")
    oracle, _ = _load(oracle_dir, "auto")
    got, want = dict(from_disk.named_parameters()), dict(oracle.named_parameters())
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert (got[name].dtype, got[name].shape) == (w.dtype, w.shape), name
        a, b = got[name].detach().reshape(-1).view(torch.uint8), w.detach().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{name}: vLLM's load of the converted directory differs"
    router = next(p for n, p in got.items() if n.endswith("layers.0.mlp.gate.weight"))
    assert router.dtype == torch.bfloat16  # modules_to_not_convert keeps vLLM's router as published
    experts = [p for n, p in got.items() if "experts" in n and n.endswith("w13_weight")]
    assert experts and all(p.dtype == torch.float8_e4m3fn for p in experts)


#: (format, format parameters, vLLM 0.33.0's MoE method for the config convert writes)
FOUR_BIT = {
    "nvfp4-modelopt": ("nvfp4", {}, "ModelOptNvFp4FusedMoE"),
    "int4-g64": ("int4_w4a16", {"int4_group": 64}, "CompressedTensorsWNA16MoEMethod"),
    "mxfp4": ("mxfp4", {}, "CompressedTensorsW4A4Mxfp4MoEMethod"),
    "nvfp4-ct": ("nvfp4", {"nvfp4_names": "compressed_tensors"}, "CompressedTensorsW4A4Nvfp4MoEMethod"),
}


@pytest.mark.engine
@pytest.mark.parametrize("variant", list(FOUR_BIT))
def test_vllm_real_classes_boot_from_a_converted_4bit_directory(vllm_cpu, tmp_path, variant):
    """vLLM's real ``Qwen3MoeForCausalLM`` boots from ``refitd convert --engine vllm``'s 4-bit directory:
    its ``config.json`` alone selects the MoE method (ModelOpt NVFP4; compressed-tensors W4A16 in group
    64, MXFP4, NVFP4 under its names), and the real loader with ``process_weights_after_loading`` leaves
    every published parameter byte-equal to the same model class loaded with the published tensors
    (``sidecar.plan.run.convert``). What is replaced is tests/support/vllm_models.py's: the NVFP4 / WNA16
    MoE backend choice answers EMULATION (vLLM's own pure-torch weight processing); MXFP4 keeps Marlin
    with vLLM's pure-torch reference of its repack."""
    from safetensors.torch import save_file
    from support import vllm_models

    from sidecar.numerics.formats import FormatParams

    fmt, flags, method = FOUR_BIT[variant]
    vllm_models.import_vllm()  # NVFP4 / WNA16 MoE backend choice: EMULATION (no kernel runs)
    g = torch.Generator().manual_seed(8)
    weights = {
        n: (torch.randn(shape, generator=g) * 0.05).to(dtype)
        for n, shape, dtype in get_model("qwen3_moe").parameters(CONFIG)
    }
    params = FormatParams(**flags)
    out = tmp_path / fmt
    written = convert_directory(
        _bf16_dir(tmp_path, weights), out, Format(fmt), engine="vllm", params=params, max_shard_bytes=1 << 20
    )
    spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=2, params=params)
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    save_file(
        {n: t.contiguous() for n, t in convert(weights, spec).items()}, str(oracle_dir / "model.safetensors")
    )
    (oracle_dir / "config.json").write_text(json.dumps(written))

    from_disk, _ = _load(out, "auto")
    oracle, _ = _load(oracle_dir, "auto")
    methods = {type(m.quant_method).__name__ for m in from_disk.modules() if hasattr(m, "quant_method")}
    assert method in methods
    got, want = dict(from_disk.named_parameters()), dict(oracle.named_parameters())
    assert sorted(got) == sorted(want)
    # W4A4's static activation scales are engine state, not published (a reload carries the engine's
    # over: adapters/vllm/carry.py), so a converted directory has none and they stay uninitialised
    unpublished = [n for n in want if n.endswith(("_input_scale", "_input_global_scale"))]
    assert bool(unpublished) == (fmt == "nvfp4")
    for name, w in want.items():
        assert (got[name].dtype, got[name].shape) == (w.dtype, w.shape), name
        if name in unpublished:
            continue
        a, b = got[name].detach().reshape(-1).view(torch.uint8), w.detach().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{name}: vLLM's load of the converted directory differs"
    router = next(p for n, p in got.items() if n.endswith("layers.0.mlp.gate.weight"))
    assert router.dtype == torch.bfloat16  # the config's exclusions keep vLLM's router as published
