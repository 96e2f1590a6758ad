"""``refitd convert --format nvfp4 --nvfp4-names compressed_tensors --engine sglang`` (red-team check).

refitd's SGLang quantization_config for NVFP4 is ModelOpt's (``ModelOptFp4Config``), which loads
ModelOpt's names (``.weight``, ``.weight_scale_2 = gs``). Written over compressed-tensors' names
(``.weight_packed``, ``.weight_global_scale = 1 / gs``) it described tensors the directory does not
hold, and the conversion succeeded. It is refused, naming the way out, before anything is written;
ModelOpt's names under ``--engine sglang`` and compressed-tensors' under ``--engine vllm`` still convert."""

from __future__ import annotations

import json

import pytest

from adapters.sglang import sglang_quantization_config
from sidecar.cli.main import main
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan.spec import RefitSpec
from tests.test_convert import CONFIG, _bf16_dir, _read_dir, _weights


def test_sglang_config_refuses_compressed_tensors_nvfp4_names():
    spec = RefitSpec(
        model_type="qwen3_moe", fmt=Format.NVFP4, params=FormatParams(nvfp4_names="compressed_tensors")
    )
    with pytest.raises(ValueError, match="ModelOpt's names"):
        sglang_quantization_config(spec, CONFIG)
    modelopt = RefitSpec(model_type="qwen3_moe", fmt=Format.NVFP4)
    assert sglang_quantization_config(modelopt, CONFIG)["quant_method"] == "modelopt"


def test_convert_refuses_a_modelopt_config_over_compressed_tensors_names(tmp_path, capsys):
    src = _bf16_dir(tmp_path, _weights(31))
    out = tmp_path / "ct-sglang"
    argv = ["convert", str(src), str(out), "--format", "nvfp4", "--nvfp4-names", "compressed_tensors"]
    assert main([*argv, "--engine", "sglang"]) == 1
    err = capsys.readouterr().err
    assert "--engine vllm" in err and "--nvfp4-names modelopt" in err
    assert not out.exists() or not any(out.iterdir())
    # the same names for vLLM, and ModelOpt's for SGLang, convert
    assert main([*argv, "--engine", "vllm"]) == 0
    assert any(n.endswith(".weight_global_scale") for n in _read_dir(out))
    out2 = tmp_path / "modelopt-sglang"
    assert main(["convert", str(src), str(out2), "--format", "nvfp4", "--engine", "sglang"]) == 0
    qc = json.loads((out2 / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and any(n.endswith(".weight_scale_2") for n in _read_dir(out2))
