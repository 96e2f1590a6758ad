"""vLLM 0.33.0's REAL Qwen3-MoE holding the format variants its manifest decides (``make test-engines``):
INT4 W4A16 with group 128 (``CompressedTensorsWNA16MoEMethod``) and NVFP4 under compressed-tensors' names
(``CompressedTensorsW4A4Nvfp4MoEMethod``, ``nvfp4-pack-quantized``).

Built as tests/test_engine_vllm_fourbit.py builds its engines (tests/support/vllm_models.py: the real model
class, quantization configs from ``vllm_engine_args``, quant methods, weight loaders and
``process_weights_after_loading``); replaced, as there, only the MoE backend choice (EMULATION: vLLM's own
experts that dequantize on the fly; no kernel runs here), here also for the compressed-tensors NVFP4 method.

Checks: the manifest of the real parameters says the variant (group 128 with the engine's bf16 scales;
compressed-tensors names), a daemon spec with the defaults is re-planned to it by the attach check, and the
real ``load_weights`` takes the generation planned that way byte for byte (``weight_global_scale`` into
``w13/w2_weight_global_scale``, the reciprocal vLLM inverts in processing), which then processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import adapters.vllm as av
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan.attach import check_manifest
from sidecar.plan.build import RefitSpec
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.plan.run import convert

pytestmark = pytest.mark.engine

EXPERTS = 4
_KV = ("q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point")
VARIANTS = {
    "int4-g128": ("int4_w4a16", FormatParams(int4_group=128), "CompressedTensorsWNA16MoEMethod"),
    "nvfp4-ct": (
        "nvfp4",
        FormatParams(nvfp4_names="compressed_tensors"),
        "CompressedTensorsW4A4Nvfp4MoEMethod",
    ),
}


@pytest.fixture(scope="module")
def vm():
    try:
        from support import vllm_models

        vllm_models.import_vllm()
        from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_oracle
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4,
        )
    except ImportError as exc:
        if os.environ.get("REFITD_REQUIRE_ENGINES") == "1":
            pytest.fail(f"REFITD_REQUIRE_ENGINES=1 but vLLM's model classes do not import: {exc}")
        pytest.skip(f"needs vLLM 0.33.0 in .venv-engines: run `make test-engines` ({exc})")

    def nvfp4_emulation(config, weight_key=None, activation_key=None):  # as support.vllm_models for ModelOpt
        backend = nvfp4_oracle.NvFp4MoeBackend.EMULATION
        return backend, nvfp4_oracle.backend_to_kernel_cls(backend)[0]

    ct_nvfp4.select_nvfp4_moe_backend = nvfp4_emulation
    return vllm_models


class Engine:
    def __init__(self, vm, root: Path, variant: str):
        fmt, self.params, self.method = VARIANTS[variant]
        self.vm, self.fmt = vm, Format.parse(fmt)
        self.folder = vm.write_config(root / variant, "qwen3_moe")  # H = 256, I = 128
        self.hf = vm.config_dict(self.folder)
        self.plan_hf = normalize_hf_config(self.hf)
        layers = get_model(model_type_of(self.hf)).num_hidden_layers(self.hf)
        self.spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=layers, params=self.params)
        self.daemon_spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=layers)  # defaults
        self.args = av.vllm_engine_args(self.spec, self.hf)
        self.config = vm.vllm_config(self.folder, self.args)
        vm.init_distributed(self.config)
        self.model = vm.build_model(self.config)
        self.model.load_weights(av.ordered_weights(self.generation(0)))
        vm.process(self.config, self.model)
        self.worker = vm.worker(self.config, self.model)

    def inputs(self) -> list:
        return list(get_model("qwen3_moe").parameters(self.plan_hf, include_mtp=True, include_vision=False))

    def state(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in self.inputs()}

    def generation(self, seed: int) -> dict[str, torch.Tensor]:
        return convert(self.state(seed), self.spec)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def engine(vm, tmp_path_factory, request) -> Engine:
    return Engine(vm, tmp_path_factory.mktemp("vllm-variants"), request.param)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _expected(name: str, param: torch.Tensor, gen: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """What vLLM's loader makes of the generation in ``name`` (tp 1); None for engine-only state."""
    name = name.replace(".routed_experts.", ".")
    head, sep, tail = name.rpartition(".mlp.experts.")
    if not sep:
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if leaf in _KV:
            return None
        if proj == "qkv_proj":
            return torch.cat([gen[f"{parent}.{s}.{leaf}"] for s in ("q_proj", "k_proj", "v_proj")])
        return gen[name]
    w, _, leaf = tail.partition("_")
    if leaf == "input_global_scale":  # the activations' scale: engine state, not published
        return None
    projs = ("gate_proj", "up_proj") if w == "w13" else ("down_proj",)
    rows = [[gen[f"{head}.mlp.experts.{x}.{p}.{leaf}"] for p in projs] for x in range(param.shape[0])]
    if leaf == "weight_global_scale":  # one-element per projection: [E, 2] / [E]
        return torch.stack([torch.stack([t.reshape(()) for t in row]) for row in rows]).reshape(param.shape)
    if leaf == "weight_shape":
        return torch.stack([row[0] for row in rows]).to(param.dtype)
    return torch.stack([torch.cat(row) for row in rows])


def test_the_real_engines_manifest_decides_the_variant(engine):
    manifest = av.RefitWorkerExtension.refit_manifest(engine.worker)
    assert manifest.expert_format is engine.fmt and engine.method in manifest.moe_backend, (
        manifest.moe_backend
    )
    assert manifest.format_params == engine.params  # INT4: group 128, the engine's bfloat16 scales
    assert av.check_vllm_constraints(manifest, engine.hf) == []
    check = check_manifest(engine.inputs(), engine.daemon_spec, manifest)
    assert check.ok, check.message("vllm")
    assert check.plan.spec.params == engine.params
    by = manifest.by_name()
    m = "model.layers.1.mlp.experts.3.down_proj"
    if engine.fmt is Format.INT4_W4A16:
        assert (by[f"{m}.weight_scale"].dtype, by[f"{m}.weight_scale"].shape) == (torch.bfloat16, (256, 1))
    else:
        assert (by[f"{m}.weight_packed"].dtype, by[f"{m}.weight_packed"].shape) == (torch.uint8, (256, 64))
        assert (by[f"{m}.weight_global_scale"].dtype, by[f"{m}.weight_global_scale"].shape) == (
            torch.float32,
            (1,),
        )
        assert f"{m}.weight" not in by and f"{m}.input_global_scale" not in by
        assert manifest.info["carried_input_scales"] == 0  # NVFP4A16: no activation scale to carry


def test_the_real_load_weights_takes_the_variant_byte_for_byte(engine):
    gen = engine.generation(1)
    model = engine.vm.build_model(engine.config)
    model.load_weights(av.ordered_weights(gen))
    wrong, checked = [], 0
    for name, p in model.named_parameters():
        want = _expected(name, p, gen)
        if want is None:
            continue
        checked += 1
        if not _same(p, want):
            wrong.append(
                f"{name}: engine {p.dtype} {tuple(p.shape)}, generation {want.dtype} {tuple(want.shape)}"
            )
    assert not wrong, "\n".join(wrong)
    assert checked >= 20
    engine.vm.process(engine.config, model)  # vLLM's own processing takes it (EMULATION experts)
    if engine.fmt is Format.NVFP4:
        # processing inverts weight_global_scale (1.0 / w13_weight_global_scale): SPEC's gs comes back, the
        # double rounding of 1 / (1 / gs) at most one float32 ulp from it
        modelopt = convert(engine.state(1), engine.daemon_spec)  # ModelOpt's names: weight_scale_2 = gs
        processed = dict(model.named_parameters())
        for layer in range(2):
            moe = f"model.layers.{layer}.mlp.experts"
            held = processed[f"{moe}.routed_experts.w2_weight_scale_2"].detach().reshape(-1)
            gs = torch.stack([modelopt[f"{moe}.{e}.down_proj.weight_scale_2"] for e in range(EXPERTS)])
            ulps = (held.view(torch.int32) - gs.view(torch.int32)).abs()
            assert held.dtype == torch.float32 and int(ulps.max()) <= 1, (held, gs)


def test_two_generations_reload_in_place(engine):
    """vLLM's layerwise reload (``load_generation``) of two generations keeps every parameter object and
    equals vLLM's own load and processing of the same generation."""
    model = engine.model
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    for seed in (2, 3):
        gen = engine.generation(seed)
        av.load_generation(engine.worker, gen, engine.fmt)
        after = dict(model.named_parameters())
        assert after.keys() == before.keys()
        moved = [n for n, (p, ptr) in before.items() if after[n] is not p or after[n].data_ptr() != ptr]
        assert not moved, f"parameters replaced by the reload: {moved[:5]}"
        reference = engine.vm.build_model(engine.config)
        reference.load_weights(av.ordered_weights(gen))
        engine.vm.process(engine.config, reference)
        ref = dict(reference.named_parameters())
        differ = [n for n, p in after.items() if n.rpartition(".")[2] not in _KV and not _same(p, ref[n])]
        if engine.fmt is Format.NVFP4:
            # NVFP4A16 (input_activations None): vLLM creates w13/w2_input_global_scale but no checkpoint
            # fills them and its kernels never read them (use_a16); both loads leave them uninitialised
            methods = [m.quant_method for m in model.modules() if hasattr(m, "w13_input_global_scale")]
            assert methods and all(m.use_a16 for m in methods)
            differ = [n for n in differ if not n.endswith("_input_global_scale")]
        assert not differ, f"the reload differs from vLLM's own load of the same generation: {differ[:5]}"
