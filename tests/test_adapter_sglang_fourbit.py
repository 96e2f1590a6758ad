"""The SGLang adapter in refitd's 4-bit formats against SGLang 0.5.23's real classes on CPU (make test-sglang).

A tiny Qwen3-MoE and DeepSeek-V3 (transformers' own config classes, as for FP8) in NVFP4 (ModelOpt names: SGLang's
``ModelOptFp4Config`` / ``ModelOptNvFp4FusedMoEMethod``) and INT4 W4A16 (compressed-tensors
``pack-quantized``: ``CompressedTensorsConfig`` / ``CompressedTensorsWNA16MoE``): ``refitd convert`` writes
the checkpoint directory, SGLang's real ``DefaultModelLoader`` loads it (``load_format="auto"``, the
oracle); a second SGLang model built with ``load_format="dummy"`` is refitted by a real daemon through
SGLang's real ``WeightUpdater`` and refitd's custom loader (the manifest built from SGLang's own
parameters, the attach rules run), twice, and every parameter a checkpoint fills must equal the
oracle's byte for byte, every parameter object kept.

What is replaced, and why (nothing else is; the import shims of ``tests/support/sglang_cpu.py`` as for
FP8):

* each 4-bit MoE method's ``process_weights_after_loading`` is a no-op, in the oracle and the refitted
  engine alike: it runs CUDA kernels (NVFP4: Marlin's ``gptq_marlin_repack`` / FlashInfer's swizzles;
  INT4: ``gptq_marlin_moe_repack``), so the comparison is of the parameters SGLang's weight loader
  fills, in the checkpoint layout (the scheduler's ``end_weight_update(run_post_load=False)`` as in
  the FP8 tests);
* NVFP4 only: ``--moe-runner-backend marlin``, because ``ModelOptNvFp4FusedMoEMethod.__init__`` refuses
  a non-CUDA, non-Blackwell platform unless the backend is Marlin (modelopt_quant.py:2378-2388); the
  Marlin preparation itself is the no-op above, so no parameter is replaced and the attach passes
  (on a real SM80-SM99 GPU it would be refused: ``test_adapter_sglang_rules``).

NVFP4's activation scales (``w13_input_scale`` / ``w2_input_scale``) are not published: the test checks
that a refit leaves the values the engine held (the dummy loader's) in place, which is how SGLang
carries calibrated activation scales over.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from adapters.sglang import check_sglang_constraints, sglang_quantization_config
from adapters.sglang.fourbit import LOADED_LEAVES
from adapters.sglang.loader import detach_all, sglang_manifest
from sidecar.numerics.formats import Format
from sidecar.plan.spec import RefitSpec
from tests.support.waiting import wait_until
from tests.test_adapter_sglang import (  # noqa: F401 (sgl: the fixture)
    CONFIGS,
    _bytes,
    _checkpoint,
    _qwen3_moe,
    _refit,
    _weights,
    sgl,
)

#: the MoE method each format resolves to, whose CUDA-only processing the test replaces
METHODS = {
    Format.NVFP4: (
        "sglang.srt.layers.quantization.modelopt_quant",
        "ModelOptNvFp4FusedMoEMethod",
        {"moe_runner_backend": "marlin"},
    ),
    Format.INT4_W4A16: (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe",
        "CompressedTensorsWNA16MoE",
        {},
    ),
}


def _loaded(name: str) -> bool:
    """A parameter a checkpoint fills (every non-expert one; an expert's loaded leaves)."""
    _, sep, tail = name.rpartition(".mlp.experts.")
    if not sep:
        return True
    w, _, leaf = tail.partition("_")
    return w in ("w13", "w2") and leaf in LOADED_LEAVES


@pytest.mark.engine
@pytest.mark.parametrize(
    ("model_type", "fmt"),
    [
        ("qwen3_moe", Format.NVFP4),
        ("qwen3_moe", Format.INT4_W4A16),
        ("deepseek_v3", Format.NVFP4),
        ("deepseek_v3", Format.INT4_W4A16),
    ],
)
def test_sglang_loads_two_four_bit_generations_byte_equal_to_its_own_load(
    sgl,  # noqa: F811 (the fixture)
    tmp_path,
    monkeypatch,
    model_type,
    fmt,
):
    import importlib

    from sidecar.client.client import RefitClient
    from tests.support.daemons import RunningDaemon

    module, cls, server_args = METHODS[fmt]
    monkeypatch.setattr(
        getattr(importlib.import_module(module), cls),
        "process_weights_after_loading",
        lambda self, layer: None,
    )

    config = CONFIGS[model_type]()
    steps = {1: _weights(config, 1), 2: _weights(config, 2)}
    dirs = {s: _checkpoint(tmp_path, f"step{s}", config, w, fmt) for s, w in steps.items()}
    written = json.loads((dirs[1] / "config.json").read_text())
    assert written["quantization_config"] == sglang_quantization_config(
        RefitSpec(model_type=model_type, fmt=fmt), config
    )

    engine = sgl.build_model(dirs[1], load_format="dummy", **server_args)
    moe = engine.model.layers[1].mlp.experts
    assert (
        type(moe.quant_method).__name__ == cls
        or type(getattr(moe, "scheme", None)).__name__ == cls  # compressed-tensors: the layer's scheme
    )
    manifest = sglang_manifest(engine)
    assert manifest.expert_format is fmt and not check_sglang_constraints(manifest, config)
    by_name = manifest.by_name()
    if fmt is Format.NVFP4:
        w = by_name["model.layers.1.mlp.experts.3.down_proj.weight"]
        assert (w.dtype, w.shape) == (torch.uint8, (256, 64))
        assert by_name["model.layers.1.mlp.experts.3.down_proj.weight_scale"].shape == (256, 8)
        assert by_name["model.layers.1.mlp.experts.3.up_proj.weight_scale_2"].shape == ()
        assert not any(n.endswith("input_scale") for n in by_name)
        assert manifest.info["held_input_scales"]
    else:
        w = by_name["model.layers.1.mlp.experts.3.down_proj.weight_packed"]
        assert (w.dtype, w.shape) == (torch.int32, (256, 16))
        s = by_name["model.layers.1.mlp.experts.3.down_proj.weight_scale"]
        assert (s.dtype, s.shape) == (torch.bfloat16, (256, 4))
        assert by_name["model.layers.1.mlp.experts.3.down_proj.weight_shape"].dtype == torch.int64
        assert manifest.format_params.int4_group == 32
    # the router, attention and DeepSeek's shared experts stay BF16
    assert by_name["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    if model_type == "qwen3_moe":
        assert by_name["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    else:
        assert by_name["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
        assert by_name["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.bfloat16

    params = {n: id(p) for n, p in engine.named_parameters()}
    held = {n: p.detach().clone() for n, p in engine.named_parameters() if not _loaded(n)}
    updater = sgl.weight_updater(engine)
    reply = f"ipc://{tmp_path}/reply.sock"
    (tmp_path / "daemon").mkdir()
    daemon = RunningDaemon(tmp_path / "daemon", hf_config=written, format=fmt.value)
    client = RefitClient(daemon.endpoint, 0, 1, timeout=120)
    try:
        for step, weights in steps.items():
            box: dict = {}
            refit = threading.Thread(target=_refit, args=(updater, daemon.endpoint, step, reply, box))
            refit.start()
            wait_until(
                "the engine attached",
                lambda t=refit: daemon.status()["engines"] or not t.is_alive(),
                timeout=120,
            )
            assert refit.is_alive(), box
            client.push_step(step, weights)
            refit.join(timeout=180)
            assert box.get("answer") == (True, "Success") and not refit.is_alive()
            assert box["result"].ok and box["result"].step == step, box["result"]
            oracle = dict(sgl.build_model(dirs[step], load_format="auto", **server_args).named_parameters())
            got = dict(engine.named_parameters())
            assert sorted(got) == sorted(oracle)
            for name, p in got.items():
                if _loaded(name):
                    assert (p.dtype, p.shape) == (oracle[name].dtype, oracle[name].shape), name
                    assert torch.equal(_bytes(p), _bytes(oracle[name])), (
                        f"{name} differs from SGLang's own load"
                    )
                else:  # engine state (NVFP4's activation scales, WNA16's g_idx): kept as held
                    assert torch.equal(_bytes(p), _bytes(held[name])), f"{name} changed"
            assert {n: id(p) for n, p in engine.named_parameters()} == params
    finally:
        client.close()
        detach_all()
        daemon.close()


@pytest.mark.engine
def test_sglangs_triton_int4_experts_are_refused_because_sglang_cannot_reload_them(sgl, tmp_path):  # noqa: F811
    """``--moe-runner-backend triton`` (the ``auto`` choice on SM100/SM103): SGLang's real
    ``CompressedTensorsWNA16TritonMoE.process_weights_after_loading`` (pure torch, nothing replaced here)
    turns the packed weights into new uint8 parameters without a ``weight_loader``. The attach check
    refuses it, naming the backend that works, and SGLang's own loader indeed fails on that model."""
    from safetensors.torch import load_file
    from sglang.srt.model_loader.loader import DefaultModelLoader

    config = _qwen3_moe()
    out = _checkpoint(tmp_path, "triton", config, _weights(config, 4), Format.INT4_W4A16)
    engine = sgl.build_model(out, load_format="auto", moe_runner_backend="triton")
    assert type(engine.model.layers[0].mlp.experts.scheme).__name__ == "CompressedTensorsWNA16TritonMoE"
    DefaultModelLoader.restore_weights_before_loading(engine, torch.device("cpu"))  # begin_weight_update
    (problem,) = check_sglang_constraints(sglang_manifest(engine), config)
    assert "CompressedTensorsWNA16TritonMoE" in problem and "--moe-runner-backend marlin" in problem
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    with pytest.raises(AttributeError, match="weight_loader"):
        DefaultModelLoader.load_weights_only(engine, iter(tensors.items()), torch.device("cpu"))


@pytest.mark.engine
def test_sglang_mxfp4_is_refused_because_its_mxfp4_method_reads_other_names(sgl, tmp_path, monkeypatch):  # noqa: F811
    """SGLang's real model from the compressed-tensors MXFP4 config vLLM loads (``mxfp4-pack-quantized``):
    SGLang picks gpt-oss's ``Mxfp4MoEMethod`` (its ``process_weights_after_loading`` a no-op here: it
    imports ``triton_kernels``), holding ``w13_weight`` / ``w13_weight_scale`` / ``w13_weight_bias``. The
    attach refuses with that reason, and SGLang's own loader given refitd's MXFP4 tensors (SPEC §2.3's
    ``.weight_packed``) leaves the experts as they were: the names would be skipped without a word."""
    from safetensors.torch import save_file
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from adapters.sglang.fourbit import MXFP4_REFUSAL, int4_quantization_config
    from adapters.sglang.quant import bf16_modules
    from sidecar.cli.convert import CheckpointDir, convert_outputs

    monkeypatch.setattr(Mxfp4MoEMethod, "process_weights_after_loading", lambda self, layer: None)
    config = _qwen3_moe()
    spec = RefitSpec(model_type="qwen3_moe", fmt=Format.MXFP4)
    qc = int4_quantization_config(bf16_modules(spec, config))  # the MXFP4 weights vLLM's config names:
    qc["format"] = "mxfp4-pack-quantized"
    qc["config_groups"]["group_0"]["weights"] = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    save_file(_weights(config, 5), str(bf16 / "model.safetensors"))
    (bf16 / "config.json").write_text(json.dumps(config))
    published = dict(convert_outputs(CheckpointDir(bf16), spec))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in published
    d = tmp_path / "mx"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    engine = sgl.build_model(d, load_format="dummy")
    moe = engine.model.layers[1].mlp.experts
    assert isinstance(moe.quant_method, Mxfp4MoEMethod)
    assert {"w13_weight", "w13_weight_scale", "w13_weight_bias"} <= {n for n, _ in moe.named_parameters()}
    with pytest.raises(ValueError, match="Mxfp4MoEMethod") as refused:
        sglang_manifest(engine)
    assert str(refused.value) == MXFP4_REFUSAL
    before = moe.w13_weight.detach().clone()
    DefaultModelLoader.load_weights_only(engine, iter(published.items()), torch.device("cpu"))
    assert torch.equal(moe.w13_weight, before)  # refitd's .weight_packed: skipped by SGLang
