"""vLLM 0.33.0's REAL Qwen3-MoE in ModelOpt NVFP4 and compressed-tensors INT4 W4A16 loads refitd's
4-bit generations on CPU (``make test-engines``).

Built as tests/test_engine_vllm_models.py builds its engines (``tests/support/vllm_models.py``: the
real ``Qwen3MoeForCausalLM``, ``ModelOptNvFp4Config`` from ``vllm_engine_args``' quantization config,
``ModelOptNvFp4FusedMoE``, the real weight loaders, ``process_weights_after_loading`` and layerwise
reload; ``CompressedTensorsWNA16MoEMethod`` for INT4). **What is replaced**: only the MoE kernel backend
choice, as for FP8: ``select_nvfp4_moe_backend`` and ``select_wna16_moe_backend`` answer EMULATION
(vLLM's own Triton experts that dequantize NVFP4 / INT4, its path on GPUs without native kernels; no
kernel runs here), whose weight processing is pure torch.

Checks: attach with the manifest of the real parameters (NVFP4: ``.weight`` uint8 ``[I, H/2]``,
``.weight_scale`` fp8 ``[I, H/16]``, ``.weight_scale_2`` float32 0-d per expert, the static
``input_scale`` not published but carried; INT4: ``.weight_packed`` int32 ``[I, H/8]``,
``.weight_scale`` bf16 ``[I, H/32]``, ``.weight_shape`` int64 ``[2]``); the real ``load_weights`` takes a refitd generation
byte for byte; two generations reloaded layerwise keep every parameter object and equal vLLM's own
load of the generation plus the engine's calibrated activation scales; K multiples refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import adapters.vllm as av
from adapters.vllm.carry import carried_input_scales
from sidecar.numerics.formats import FP8_DTYPE, Format
from sidecar.plan.attach import check_manifest
from sidecar.plan.build import RefitSpec
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.plan.run import convert

pytestmark = pytest.mark.engine

EXPERTS = 4
#: attention KV-cache scales (and compressed-tensors' zero points): engine state no checkpoint carries
_KV = ("q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point")


@pytest.fixture(scope="module")
def vm():
    try:
        from support import vllm_models

        vllm_models.import_vllm()
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE  # noqa: F401
    except ImportError as exc:
        if os.environ.get("REFITD_REQUIRE_ENGINES") == "1":
            pytest.fail(f"REFITD_REQUIRE_ENGINES=1 but vLLM's model classes do not import: {exc}")
        pytest.skip(f"needs vLLM 0.33.0 in .venv-engines: run `make test-engines` ({exc})")
    return vllm_models


def _calibrated(model: torch.nn.Module, fmt: Format) -> dict[str, torch.Tensor]:
    """Static activation scales as a calibrated ModelOpt checkpoint holds them (they differ per expert)."""
    out: dict[str, torch.Tensor] = {}
    if fmt is not Format.NVFP4:  # W4A16: no activation scales
        return out
    for name, module in model.named_modules():
        if hasattr(module, "w13_input_scale"):
            moe = name.replace(".routed_experts", "")
            for e in range(EXPERTS):
                out[f"{moe}.{e}.gate_proj.input_scale"] = torch.tensor(0.02 + 0.001 * e)
                out[f"{moe}.{e}.up_proj.input_scale"] = torch.tensor(0.02 + 0.001 * e)
                out[f"{moe}.{e}.down_proj.input_scale"] = torch.tensor(0.05 - 0.003 * e)
    assert out
    return out


class FourBitEngine:
    def __init__(self, vm, root: Path, fmt: str):
        self.vm, self.fmt = vm, Format.parse(fmt)
        self.folder = vm.write_config(root / fmt, "qwen3_moe")
        self.hf = vm.config_dict(self.folder)
        self.plan_hf = normalize_hf_config(self.hf)
        self.layers = get_model(model_type_of(self.hf)).num_hidden_layers(self.hf)
        self.spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=self.layers)
        self.args = av.vllm_engine_args(self.spec, self.hf)
        self.config = vm.vllm_config(self.folder, self.args)
        vm.init_distributed(self.config)
        # the engine as a calibrated NVFP4 checkpoint leaves it: its first load is vLLM's own
        self.model = vm.build_model(self.config)
        self.calibrated = _calibrated(self.model, self.fmt)
        self.model.load_weights(
            av.ordered_weights({**self._generation(0, manifest=False), **self.calibrated})
        )
        vm.process(self.config, self.model)
        self.worker = vm.worker(self.config, self.model)

    def manifest(self):
        return av.RefitWorkerExtension.refit_manifest(self.worker)

    def _generation(self, seed: int, *, manifest: bool = True) -> dict[str, torch.Tensor]:
        model = get_model(model_type_of(self.hf))
        params = model.parameters(self.plan_hf, include_mtp=True, include_vision=False)
        g = torch.Generator().manual_seed(seed)
        state = {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in params}
        if not manifest:
            return convert(state, self.spec)
        check = check_manifest(list(params), self.spec, self.manifest())
        assert check.ok, check.message("test")
        return convert(state, self.spec, keep_bf16=check.keep_bf16)

    generation = _generation


FORMATS = ("nvfp4", "int4_w4a16")
_ENGINES: dict[str, FourBitEngine] = {}


@pytest.fixture(params=FORMATS)
def engine(vm, tmp_path_factory, request) -> FourBitEngine:
    if request.param not in _ENGINES:
        _ENGINES[request.param] = FourBitEngine(vm, tmp_path_factory.mktemp("vllm-4bit"), request.param)
    return _ENGINES[request.param]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def test_four_bit_engine_args_and_manifest_of_the_real_parameters(engine):
    qc = engine.args["hf_overrides"]["quantization_config"]
    if engine.fmt is Format.NVFP4:
        assert engine.args["quantization"] == "modelopt_fp4" and qc["quant_algo"] == "NVFP4"
        method = "ModelOptNvFp4FusedMoE"
    else:
        assert engine.args["quantization"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        method = "CompressedTensorsWNA16MoEMethod"
    manifest = engine.manifest()
    assert manifest.expert_format is engine.fmt
    assert manifest.info["param_source"] == av.PARAM_SOURCE_LAYERWISE
    assert method in manifest.moe_backend, manifest.moe_backend
    assert av.check_vllm_constraints(manifest, engine.hf) == []
    params = get_model("qwen3_moe").parameters(engine.plan_hf, include_mtp=True, include_vision=False)
    check = check_manifest(params, engine.spec, manifest)
    assert check.ok, check.message("vllm")
    by = manifest.by_name()

    def has(name, dtype, shape):
        assert (by[name].dtype, by[name].shape) == (dtype, shape), (name, by[name])

    h, i = engine.hf["hidden_size"], engine.hf["moe_intermediate_size"]
    for layer in range(engine.layers):
        for e in range(EXPERTS):
            for proj, (out, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                m = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                if engine.fmt is Format.NVFP4:
                    has(f"{m}.weight", torch.uint8, (out, k // 2))
                    has(f"{m}.weight_scale", FP8_DTYPE, (out, k // 16))
                    has(f"{m}.weight_scale_2", torch.float32, ())
                    assert f"{m}.input_scale" not in by  # not published: carried over from the engine
                else:
                    has(f"{m}.weight_packed", torch.int32, (out, k // 8))
                    has(f"{m}.weight_scale", torch.bfloat16, (out, k // 32))
                    has(f"{m}.weight_shape", torch.int64, (2,))
                    assert f"{m}.weight" not in by
    carried = engine.layers * EXPERTS * 3 if engine.fmt is Format.NVFP4 else 0
    assert manifest.info["carried_input_scales"] == carried
    # the attention, router and head stay BF16 (excluded exactly as refitd keeps them)
    assert by["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert by["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


def _expected(name: str, param: torch.Tensor, gen: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """What vLLM packs from the generation into ``name`` at load time (tp 1)."""
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
    moe = head + ".mlp.experts"
    w, _, leaf = tail.partition("_")
    projs = ("gate_proj", "up_proj") if w == "w13" else ("down_proj",)
    rows = [[gen[f"{moe}.{x}.{p}.{leaf}"] for p in projs] for x in range(param.shape[0])]
    if leaf in ("weight_scale_2", "input_scale"):  # per expert 0-d: [E, 2] / [E]
        return torch.stack([torch.stack([t.reshape(()) for t in row]) for row in rows]).reshape(param.shape)
    if leaf == "weight_shape":  # per expert int64 [2], copied into the engine's params_dtype [E, 2]
        return torch.stack([row[0] for row in rows]).to(param.dtype)
    return torch.stack([torch.cat(row) for row in rows])


def test_real_load_weights_takes_a_four_bit_generation_byte_for_byte(engine):
    gen = {**engine.generation(1), **engine.calibrated}
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
    params = dict(model.named_parameters())
    w13 = params.get("model.layers.0.mlp.experts.routed_experts.w13_weight")
    if w13 is None:
        w13 = params["model.layers.0.mlp.experts.routed_experts.w13_weight_packed"]
    assert w13.dtype in (torch.uint8, torch.int32) and not torch.equal(w13, torch.zeros_like(w13))


def test_two_four_bit_generations_reload_in_place_carrying_the_activation_scales(engine):
    model = engine.model
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    held = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("input_scale")}
    carried = carried_input_scales(model.named_modules())
    nvfp4 = engine.fmt is Format.NVFP4
    assert bool(held) == nvfp4 and len(carried) == (engine.layers * EXPERTS * 3 if nvfp4 else 0)
    for seed in (2, 3):
        gen = engine.generation(seed)
        av.load_generation(engine.worker, gen, engine.fmt)
        after = dict(model.named_parameters())
        assert after.keys() == before.keys()
        moved = [n for n, (p, ptr) in before.items() if after[n] is not p or after[n].data_ptr() != ptr]
        assert not moved, f"parameters replaced by the reload: {moved[:5]}"
        # the activation scales the engine held stay, bit for bit, through every reload
        assert all(_same(after[n], t) for n, t in held.items()), {n: (after[n], t) for n, t in held.items()}
        # and everything equals vLLM's own load of the generation with the calibrated scales
        reference = engine.vm.build_model(engine.config)
        reference.load_weights(av.ordered_weights({**gen, **engine.calibrated}))
        engine.vm.process(engine.config, reference)
        ref = dict(reference.named_parameters())
        differ = [n for n, p in after.items() if n.rpartition(".")[2] not in _KV and not _same(p, ref[n])]
        assert not differ, f"the reload differs from vLLM's own load of the same generation: {differ[:5]}"


def test_four_bit_k_multiples_are_refused_naming_the_fix(engine):
    manifest = engine.manifest()
    k = 16 if engine.fmt is Format.NVFP4 else 32
    bad_i = {**engine.hf, "moe_intermediate_size": 136}  # 136 % 16 == 136 % 32 == 8
    problems = av.check_vllm_constraints(manifest, bad_i)
    fmt = engine.fmt.value
    assert any(fmt in p and f"multiple of {k}" in p and "tensor_parallel_size" in p for p in problems), (
        problems
    )
    bad_h = {**engine.hf, "hidden_size": 264}
    problems = av.check_vllm_constraints(manifest, bad_h)
    assert any("hidden_size = 264" in p and f"multiple of {k}" in p for p in problems), problems


def test_mxfp4_manifest_and_load_weights_on_the_real_unprocessed_class(vm, tmp_path):
    """compressed-tensors MXFP4: the real ``CompressedTensorsW4A4Mxfp4MoEMethod`` parameters map to
    ``.weight_packed`` uint8 ``[I, H/2]`` + ``.weight_scale`` uint8 ``[I, H/32]``, attach passes the daemon's
    check, and the real ``load_weights`` takes the generation byte for byte. Not run here: its
    ``process_weights_after_loading`` (on a GPU without native FP4 it repacks for Marlin with
    ``gptq_marlin_repack``, a ``vllm._C`` op that does not load against the CPU torch), hence no reload."""
    folder = vm.write_config(tmp_path, "qwen3_moe")
    hf = vm.config_dict(folder)
    layers = get_model("qwen3_moe").num_hidden_layers(hf)
    spec = RefitSpec(model_type="qwen3_moe", fmt="mxfp4", num_hidden_layers=layers)
    args = av.vllm_engine_args(spec, hf)
    config = vm.vllm_config(folder, args)
    vm.init_distributed(config)
    model = vm.build_model(config)
    params = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    manifest = av.build_manifest(params, hf, config.quant_config)
    assert manifest.expert_format is Format.MXFP4
    assert av.check_vllm_constraints(manifest, hf) == []
    plan_hf = normalize_hf_config(hf)
    inputs = get_model("qwen3_moe").parameters(plan_hf, include_mtp=True, include_vision=False)
    check = check_manifest(inputs, spec, manifest)
    assert check.ok, check.message("vllm")
    by = manifest.by_name()
    h, i = hf["hidden_size"], hf["moe_intermediate_size"]
    m = "model.layers.1.mlp.experts.3.down_proj"
    assert (by[f"{m}.weight_packed"].dtype, by[f"{m}.weight_packed"].shape) == (torch.uint8, (h, i // 2))
    assert (by[f"{m}.weight_scale"].dtype, by[f"{m}.weight_scale"].shape) == (torch.uint8, (h, i // 32))
    g = torch.Generator().manual_seed(5)
    state = {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in inputs}
    gen = convert(state, spec, keep_bf16=check.keep_bf16)
    model.load_weights(av.ordered_weights(gen))
    wrong, checked = [], 0
    for name, p in model.named_parameters():
        want = _expected(name, p, gen)
        if want is None:
            continue
        checked += 1
        if not _same(p, want):
            wrong.append(name)
    assert not wrong and checked >= 20, wrong
