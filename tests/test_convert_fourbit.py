"""``refitd convert`` in the 4-bit formats (NVFP4, MXFP4, INT4 W4A16) and their parameters (INT4 group
and scale dtype, NVFP4 names): the directory holds the daemon's names and bytes (every quantized
weight re-derived with the torch reference, sidecar.numerics.fourbit), under the ``quantization_config``
the vLLM adapter starts a refit engine with; compressed-tensors' own model-free dequantizer
(``CompressedTensorsDequantizer``, and ``ModelOptNvfp4Converter`` for ModelOpt's names: the ``test``
extra) reads the directory and its config.json and decodes every expert to SPEC's values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sidecar.cli.convert import convert_generation
from sidecar.cli.main import main
from sidecar.cli.serve import render_status
from sidecar.numerics import fourbit
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan.build import RefitPlan, Role
from sidecar.plan.run import convert
from sidecar.plan.spec import RefitSpec
from tests.test_convert import CONFIG, _bf16_dir, _read_dir, _same, _weights

#: (format, flags, the FormatParams they give)
VARIANTS = {
    "nvfp4": ("nvfp4", [], FormatParams()),
    "nvfp4-ct": (
        "nvfp4",
        ["--nvfp4-names", "compressed_tensors"],
        FormatParams(nvfp4_names="compressed_tensors"),
    ),
    "mxfp4": ("mxfp4", [], FormatParams()),
    "int4": ("int4_w4a16", [], FormatParams()),
    "int4-g128": ("int4_w4a16", ["--int4-group", "128"], FormatParams(int4_group=128)),
}


def reference_outputs(weights: dict[str, torch.Tensor], spec: RefitSpec) -> dict[str, torch.Tensor]:
    """Every quantized output of the plan, computed with the torch reference (SPEC §1.5-1.7) in the
    spec's parameters: one NVFP4 global scale per scale group (an expert's gate and up), its
    reciprocal under compressed-tensors' names."""
    plan = RefitPlan.build(list(weights.items()), spec)
    fmt, params, want = spec.format, spec.params, {}
    for unit in plan.units:
        by_name = {o.name: o for o in unit.outputs if o.role is Role.WEIGHT}
        for group in unit.scale_groups if unit.fmt is not None else ():
            members = [by_name[n] for n in group]
            views = [w.source_view(weights[w.source]) for w in members]
            gs = fourbit.nvfp4_global_scale(*views) if fmt is Format.NVFP4 else None
            for w, v in zip(members, views, strict=True):
                if fmt is Format.NVFP4:
                    q, s, g = fourbit.quantize_nvfp4(v, global_scale=gs)
                    if params.nvfp4_names.value == "compressed_tensors":
                        g = (1.0 / g).reshape(1)
                    outs = (q, s, g)
                elif fmt is Format.MXFP4:
                    outs = fourbit.quantize_mxfp4(v)
                else:
                    outs = fourbit.quantize_int4(
                        v, group=params.int4_group, scale_dtype=params.int4_scale_torch_dtype
                    )
                want.update(zip(w.quantized_outputs, outs, strict=True))
    return want


def _convert(tmp_path: Path, variant: str, seed: int) -> tuple[dict[str, torch.Tensor], RefitSpec, Path]:
    fmt, flags, params = VARIANTS[variant]
    weights = _weights(seed)
    src, out = _bf16_dir(tmp_path, weights), tmp_path / "out"
    argv = ["convert", str(src), str(out), "--format", fmt, "--engine", "vllm", *flags]
    assert main([*argv, "--max-shard-size", str(1 << 20)]) == 0
    return weights, RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=2, params=params), out


def _spec_values(tensors: dict[str, torch.Tensor], module: str, spec: RefitSpec) -> torch.Tensor:
    """SPEC's dequantized values of ``module``'s published tensors."""
    t = {leaf: tensors.get(f"{module}.{leaf}") for leaf in ("weight", "weight_packed", "weight_scale")}
    if spec.format is Format.INT4_W4A16:
        return fourbit.dequantize_int4(t["weight_packed"], t["weight_scale"])
    if spec.format is Format.MXFP4:
        return fourbit.dequantize_mxfp4(t["weight_packed"], t["weight_scale"])
    if f"{module}.weight_global_scale" in tensors:
        gs = 1.0 / tensors[f"{module}.weight_global_scale"].reshape(())
        return fourbit.dequantize_nvfp4(t["weight_packed"], t["weight_scale"], gs)
    return fourbit.dequantize_nvfp4(t["weight"], t["weight_scale"], tensors[f"{module}.weight_scale_2"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_convert_writes_the_daemons_4bit_names_and_bytes(tmp_path, variant, capsys):
    """The directory is what the daemon publishes (sidecar.plan.run.convert), shard by shard; every
    quantized tensor is the torch reference's in the format's parameters; the config is the one the
    vLLM adapter starts a refit engine with, the routed experts quantized and the rest kept BF16. A
    ModelOpt NVFP4 checkpoint says it holds no calibrated activation scales (W4A4's ``input_scale``)."""
    weights, spec, out = _convert(tmp_path, variant, seed=11)
    assert ("holds no input_scale" in capsys.readouterr().err) == (variant == "nvfp4")
    got = _read_dir(out)
    _same(got, convert(weights, spec))
    reference = reference_outputs(weights, spec)
    assert len(reference) == 3 * 2 * 4 * (3 if spec.format is not Format.MXFP4 else 2)
    _same({n: got[n] for n in reference}, reference)
    assert len(list(out.glob("*.safetensors"))) > 1  # sharded at --max-shard-size
    written = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "quantization_config"} == CONFIG
    qc = written["quantization_config"]
    skip = qc.get("exclude_modules", qc.get("ignore"))
    assert (
        "lm_head" in skip and "model.layers.0.self_attn.q_proj" in skip and "model.layers.1.mlp.gate" in skip
    )
    assert not any("experts" in m for m in skip)
    if variant == "nvfp4":
        assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    else:
        want = {"nvfp4-ct": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}.get(
            variant, "pack-quantized"
        )
        assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", want)
        group = qc["config_groups"]["group_0"]["weights"]["group_size"]
        assert group == {"nvfp4-ct": 16, "mxfp4": 32}.get(variant, spec.params.int4_group)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compressed_tensors_reads_the_converted_directory(tmp_path, variant):
    """compressed-tensors' model-free dequantizer, given only the directory (its config.json and
    shards), decodes every routed expert, leaves no quantization parameter behind, and keeps the BF16
    modules as written. Its values are SPEC's: exactly for INT4 and MXFP4 (decoded in bfloat16 scales:
    ``q * s`` and ``e2m1 * 2^k`` are exact there); for NVFP4 within one bfloat16 rounding (it divides the
    block scale by the global scale in bfloat16: test_format_params). ModelOpt's names go through its
    ``ModelOptNvfp4Converter`` (renames, ``1 / weight_scale_2``) first."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    _, spec, out = _convert(tmp_path, variant, seed=12)
    tensors = _read_dir(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if variant == "nvfp4":
        from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

        converter = ModelOptNvfp4Converter(ignore=qc["ignore"], targets=["Linear"])
        ct_tensors = converter.validate(dict(tensors))
        qc = {"quant_method": "compressed-tensors", **converter.update_config(None).model_dump()}
        (out / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": qc}))
    else:
        ct_tensors = dict(tensors)
    decoded = CompressedTensorsDequantizer(out, dtype=torch.float32).validate(ct_tensors)
    modules = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith("weight_scale")})
    assert len(modules) == 2 * 4 * 3
    for m in modules:
        values = _spec_values(tensors, m, spec)
        got = decoded[f"{m}.weight"]
        assert got.shape == values.shape
        if spec.format is Format.NVFP4:
            assert bool((got == 0).eq(values == 0).all()), m
            assert bool(((got - values).abs() <= values.abs() * 2.0**-7).all()), m
        else:
            assert torch.equal(got, values.to(spec.params.int4_scale_torch_dtype).float()), m
    kept = [n for n in tensors if not any(n.startswith(f"{m}.") for m in modules)]
    assert kept and all(torch.equal(decoded[n], tensors[n]) for n in kept)


def test_4bit_parameters_are_checked_before_anything_is_written(tmp_path, capsys):
    """A parameter of another format, or INT4 scales vLLM cannot hold, is refused naming the fix,
    and the output directory gets no checkpoint."""
    src = _bf16_dir(tmp_path, _weights(13))
    cases = [
        (["--format", "nvfp4", "--int4-group", "128"], "int4_group = 128 applies to another format"),
        (
            ["--format", "mxfp4", "--nvfp4-names", "compressed_tensors"],
            "applies to another format than mxfp4",
        ),
        (["--format", "int4_w4a16", "--int4-group", "12"], "positive multiple of 8"),
        (
            ["--format", "int4_w4a16", "--int4-scale-dtype", "float32", "--engine", "vllm"],
            "cannot hold them; plan with int4_scale_dtype='bfloat16'",
        ),
        (
            ["--format", "int4_w4a16", "--int4-scale-dtype", "float32", "--engine", "sglang"],
            "would round them to it; plan with int4_scale_dtype='bfloat16'",
        ),
    ]
    for i, (flags, needle) in enumerate(cases):
        out = tmp_path / f"o{i}"
        assert main(["convert", str(src), str(out), *flags]) == 1, flags
        assert needle in capsys.readouterr().err
        assert not out.exists() or not any(out.iterdir())
    assert (
        main(["convert", "--from-daemon", "ipc:///nowhere", str(tmp_path / "o"), "--int4-group", "64"]) == 2
    )
    assert "the format and its parameters are the daemon's" in capsys.readouterr().err


def test_sglang_4bit_config_is_sglangs_or_refused(tmp_path, capsys):
    """``--engine sglang`` writes what refitd's SGLang adapter says for the format, never an FP8 config
    over 4-bit tensors: where the adapter has none, the conversion is refused naming the way out."""
    src = _bf16_dir(tmp_path, _weights(14))
    for fmt in ("nvfp4", "mxfp4", "int4_w4a16"):
        out = tmp_path / fmt
        rc = main(["convert", str(src), str(out), "--format", fmt, "--engine", "sglang"])
        if rc == 0:
            qc = json.loads((out / "config.json").read_text())["quantization_config"]
            assert qc["quant_method"] not in ("fp8", "mxfp8"), qc
        else:
            assert rc == 1
            err = capsys.readouterr().err
            assert err.startswith("refitd convert: ") and len(err) > 40, err  # the adapter's reason
            assert not any(out.glob("*.safetensors"))


def test_convert_from_a_daemon_in_int4_group_128(tmp_path, daemons):
    """``--from-daemon``: the live generation in the parameters the daemon publishes (its status's
    ``format_params``), under the matching config (vLLM's W4A16 with group 128)."""
    from sidecar.client.client import RefitClient

    params = FormatParams(int4_group=128)
    d = daemons(hf_config=CONFIG, format="int4_w4a16", int4_group=128)
    status = d.status()
    assert status["format_params"]["int4_group"] == 128
    assert "format int4_w4a16 (group 128, bfloat16 scales)" in render_status(status)
    weights = _weights(15)
    client = RefitClient(d.endpoint, 0, 1, timeout=60)
    try:
        client.push_step(2, weights)
    finally:
        client.close()
    out = tmp_path / "live"
    config = convert_generation(d.endpoint, out, CONFIG, min_step=2, timeout=60, engine="vllm")
    spec = RefitSpec(model_type="qwen3_moe", fmt=Format.INT4_W4A16, num_hidden_layers=2, params=params)
    _same(_read_dir(out), convert(weights, spec))
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 128
