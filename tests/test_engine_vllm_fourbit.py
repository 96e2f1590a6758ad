"""vLLM 0.33.0's REAL Qwen3-MoE in ModelOpt NVFP4, compressed-tensors INT4 W4A16 and compressed-tensors
MXFP4 loads and reloads refitd's 4-bit generations on CPU (``make test-engines``).

Built as tests/test_engine_vllm_models.py builds its engines (``tests/support/vllm_models.py``: the
real ``Qwen3MoeForCausalLM``, ``ModelOptNvFp4Config`` from ``vllm_engine_args``' quantization config,
``ModelOptNvFp4FusedMoE``, the real weight loaders, ``process_weights_after_loading`` and layerwise
reload; ``CompressedTensorsWNA16MoEMethod`` for INT4, ``CompressedTensorsW4A4Mxfp4MoEMethod`` for MXFP4).
**What is replaced**: NVFP4 / INT4: only the MoE kernel backend choice, as for FP8:
``select_nvfp4_moe_backend`` and ``select_wna16_moe_backend`` answer EMULATION (vLLM's own Triton
experts that dequantize NVFP4 / INT4, its path on GPUs without native kernels; no kernel runs here),
whose weight processing is pure torch. MXFP4 keeps vLLM's own choice for a GPU without native FP4,
Marlin, with two parts of it replaced (``tests/support/vllm_marlin.py``): the compiled
``torch.ops._C.gptq_marlin_repack`` is vLLM's own pure-torch reference of the Marlin layout
(``marlin_utils_test.marlin_weights``), and ``MarlinExperts``' device check answers True.

Checks: attach with the manifest of the real parameters (NVFP4: ``.weight`` uint8 ``[I, H/2]``,
``.weight_scale`` fp8 ``[I, H/16]``, ``.weight_scale_2`` float32 0-d per expert, the static
``input_scale`` not published but carried; INT4: ``.weight_packed`` int32 ``[I, H/8]``,
``.weight_scale`` bf16 ``[I, H/32]``, ``.weight_shape`` int64 ``[2]``; MXFP4: ``.weight_packed`` uint8
``[I, H/2]``, ``.weight_scale`` uint8 ``[I, H/32]``); the real ``load_weights`` takes a refitd generation
byte for byte; two generations reloaded layerwise keep every parameter object and equal vLLM's own
load of the generation (plus, for NVFP4, the engine's calibrated activation scales); K multiples refused.

Backend variants, each with only the named choice or device check replaced: NVFP4 and INT4 through the
Marlin backend GPUs below SM100 choose (``select_*_moe_backend`` answers MARLIN), MXFP4 through SM100's
``CutlassExpertsMxfp4``; the per-GPU refusal with ``current_platform.get_device_capability()`` faked;
DeepSeek-V3's NVFP4 MTP drafter keeping its own activation scales, whole and in streamed refit (the
drafter reloaded from the sealed step: = a whole load, also from the real daemon; a drafter failure
rolled back); a whole load, or a streamed step and its rollback, failing halfway in the target or the
drafter, after which the next load carries the last good activation scales; all three formats at tp 2 in two gloo processes (tests/support/vllm_tp.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.engines import missing

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
        missing(
            "vLLM's model classes do not import",
            "needs vLLM 0.33.0 in .venv-engines: run `make test-engines`",
            exc,
        )
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


FORMATS = ("nvfp4", "int4_w4a16", "mxfp4")
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
    elif engine.fmt is Format.INT4_W4A16:
        assert engine.args["quantization"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        method = "CompressedTensorsWNA16MoEMethod"
    else:
        assert engine.args["quantization"] == "compressed-tensors" and qc["format"] == "mxfp4-pack-quantized"
        method = "CompressedTensorsW4A4Mxfp4MoEMethod"
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
                elif engine.fmt is Format.MXFP4:
                    has(f"{m}.weight_packed", torch.uint8, (out, k // 2))
                    has(f"{m}.weight_scale", torch.uint8, (out, k // 32))
                    assert f"{m}.weight" not in by
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
    wrong, checked = engine.vm.load_mismatches(model, lambda name, p: _expected(name, p, gen))
    assert not wrong, "\n".join(wrong)
    assert checked >= 20
    params = dict(model.named_parameters())
    w13 = params.get("model.layers.0.mlp.experts.routed_experts.w13_weight")
    if w13 is None:
        w13 = params["model.layers.0.mlp.experts.routed_experts.w13_weight_packed"]
    assert w13.dtype in (torch.uint8, torch.int32) and not torch.equal(w13, torch.zeros_like(w13))


def test_two_four_bit_generations_reload_in_place_carrying_the_activation_scales(engine):
    _two_reloads_equal_vllms_own_load(engine)


def _two_reloads_equal_vllms_own_load(engine: FourBitEngine, *, holds_input_scales: bool = True) -> None:
    """Two generations through ``load_generation``: parameters kept, the held activation scales
    kept (``holds_input_scales=False``: the backend's processing drops them, Marlin), everything
    equal to vLLM's own load + processing of the same generation (with the calibrated scales)."""
    model = engine.model
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    held = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("input_scale")}
    carried = carried_input_scales(model.named_modules())
    nvfp4 = engine.fmt is Format.NVFP4
    assert bool(held) == (nvfp4 and holds_input_scales)
    assert len(carried) == (engine.layers * EXPERTS * 3 if nvfp4 else 0)
    w13 = next(
        n for n in before if n.endswith(("routed_experts.w13_weight", "routed_experts.w13_weight_packed"))
    )
    previous = _bytes(before[w13][0]).clone()
    for seed in (2, 3):
        gen = engine.generation(seed)
        av.load_generation(engine.worker, gen, engine.fmt)
        after = dict(model.named_parameters())
        assert after.keys() == before.keys()
        assert not torch.equal(_bytes(after[w13]), previous), "the processed experts did not change"
        previous = _bytes(after[w13]).clone()
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


def test_mxfp4_engine_holds_vllm_marlin_layout_after_processing(vm):
    """The MXFP4 engine above is processed by vLLM's own Marlin preparation (not left as loaded):
    ``w13_weight_packed`` renamed and repacked to int32 Marlin tiles, the E8M0 scales permuted."""
    engine = _ENGINES.get("mxfp4")
    if engine is None:
        pytest.skip("runs after the mxfp4 engine tests")
    params = dict(engine.model.named_parameters())
    moe = "model.layers.0.mlp.experts.routed_experts"
    assert f"{moe}.w13_weight_packed" not in params
    assert (
        type(engine.model.get_submodule(moe).quant_method.moe_kernel.fused_experts).__name__
        == "MarlinExperts"
    )
    h, i = engine.hf["hidden_size"], engine.hf["moe_intermediate_size"]
    # marlin_utils_fp4._repack_marlin_experts: [E, K / 16, N * 16 / 8] int32 per expert
    assert (params[f"{moe}.w13_weight"].dtype, tuple(params[f"{moe}.w13_weight"].shape)) == (
        torch.int32,
        (EXPERTS, h // 16, 2 * i * 16 // 8),
    )
    assert params[f"{moe}.w13_weight_scale"].dtype == torch.float8_e8m0fnu


def test_repack_stub_unpacks_exactly_what_vllm_packs(vm):
    """tests/support/vllm_marlin.py's one transcribed step: the inverse of vLLM's ``quant_utils.pack_rows``
    (the rest of the stub is vLLM's ``marlin_weights``)."""
    from support import vllm_marlin
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_rows

    g = torch.Generator().manual_seed(0)
    for bits, (k, n) in ((4, (64, 128)), (8, (32, 64))):
        q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
        assert torch.equal(vllm_marlin.unpack_rows(pack_rows(q, bits, k, n), bits, k, n), q)
    with pytest.raises(ValueError, match="size_n"):
        vllm_marlin.gptq_marlin_repack(pack_rows(q, 8, 32, 64)[:, :48].contiguous(), 32, 48, 8)


@pytest.mark.parametrize(("capability", "refused"), [((7, 0), True), ((9, 0), False), ((10, 0), False)])
def test_worker_records_the_gpu_and_attach_refuses_what_vllm_cannot_run_there(
    vm, tmp_path_factory, monkeypatch, capability, refused
):
    """The real worker's manifest records ``current_platform.get_device_capability()`` (faked: this is a
    CPU) and ``check_vllm_constraints`` applies adapters/vllm/backends.py's per-GPU MXFP4 rule to it."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    if "mxfp4" not in _ENGINES:
        _ENGINES["mxfp4"] = FourBitEngine(vm, tmp_path_factory.mktemp("vllm-4bit"), "mxfp4")
    engine = _ENGINES["mxfp4"]
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(*capability)
    )
    manifest = engine.manifest()
    assert manifest.info["device_capability"] == capability[0] * 10 + capability[1]
    assert manifest.moe_backend.endswith("/MarlinExperts"), manifest.moe_backend  # the experts class built
    problems = av.check_vllm_constraints(manifest, engine.hf)
    assert bool(problems) == refused, problems
    if refused:
        assert "no MXFP4 MoE backend on SM70" in problems[0] and "int4_w4a16" in problems[0]


class DeepSeekMtp:
    """DeepSeek-V3 in NVFP4 with its MTP drafter (``DeepSeekMTP``, its own ``ModelOptNvFp4FusedMoE`` at
    ``model.layers.2.mtp_block.mlp.experts``), each first loaded as a calibrated checkpoint leaves
    it: W4A4 input scales for the target's MoE layer (``model.layers.1``) and, distinct, the
    drafter's (checkpoint layer 2)."""

    def __init__(self, vm, root: Path):
        self.vm = vm
        folder = vm.write_config(root, "deepseek_v3")
        self.hf = vm.config_dict(folder)
        registry = get_model(model_type_of(self.hf))
        self.layers = layers = registry.num_hidden_layers(self.hf)
        self.spec = RefitSpec(model_type="deepseek_v3", fmt="nvfp4", num_hidden_layers=layers)
        args = av.vllm_engine_args(self.spec, self.hf, include_vision=False)
        self.config = vm.vllm_config(folder, args, mtp=True)
        vm.init_distributed(self.config)
        self.params = registry.parameters(
            normalize_hf_config(self.hf), include_mtp=True, include_vision=False
        )
        self.calibrated = {}
        for layer, base in ((1, 0.02), (layers, 0.07)):
            for e in range(EXPERTS):
                for proj, v in (("gate_proj", base), ("up_proj", base), ("down_proj", base + 0.01)):
                    self.calibrated[f"model.layers.{layer}.mlp.experts.{e}.{proj}.input_scale"] = (
                        torch.tensor(v + 0.001 * e)
                    )

    def state(self, seed: int) -> dict[str, torch.Tensor]:
        """A trainer's BF16 state dict (the FP32 router bias)."""
        g = torch.Generator().manual_seed(seed)
        state = {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in self.params}
        for n in state:  # DeepSeek's MTP layer holds a copy of the embedding
            if n.endswith(".embed_tokens.weight") and n.startswith("model.layers."):
                state[n] = state["model.embed_tokens.weight"]
        return state

    def generation(self, seed: int) -> dict[str, torch.Tensor]:
        """What the daemon publishes for :meth:`state` (SPEC: byte for byte ``convert``)."""
        return convert(self.state(seed), self.spec)

    def built(self, gen: dict[str, torch.Tensor], *, draft: bool) -> torch.nn.Module:
        """vLLM's own load + processing of ``gen`` with the calibrated activation scales."""
        m = self.vm.build_model(self.config, draft=draft)
        m.load_weights(av.ordered_weights({**gen, **self.calibrated}))
        self.vm.process(self.config, m, draft=draft)
        return m

    def worker(self, gen: dict[str, torch.Tensor]):
        """A worker whose model and drafter were first loaded (calibrated) with ``gen``."""
        return self.vm.worker(self.config, self.built(gen, draft=False), self.built(gen, draft=True))


@pytest.fixture(scope="module")
def deepseek_mtp(vm, tmp_path_factory) -> DeepSeekMtp:
    return DeepSeekMtp(vm, tmp_path_factory.mktemp("vllm-mtp"))


def test_nvfp4_mtp_drafter_reloads_keeping_its_own_activation_scales(deepseek_mtp):
    """``load_generation`` carries the drafter's calibrated W4A4 input scales (distinct from the target
    model's) into its reload under the names its ``load_weights`` reads
    (``model.layers.2.mlp.experts.{e}.*.input_scale``), bit for bit, and the reloaded drafter equals
    vLLM's own load + processing of the generation with those scales."""
    ds = deepseek_mtp
    worker = ds.worker(ds.generation(0))
    model, draft = worker.model_runner.get_model(), worker.model_runner.get_draft_model()
    moe = f"model.layers.{ds.layers}.mtp_block.mlp.experts.routed_experts"
    held = {n: p.detach().clone() for n, p in draft.named_parameters() if n.endswith("input_scale")}
    assert held and all(n.startswith(moe) for n in held), sorted(held)
    carried = carried_input_scales(model.named_modules())
    assert all(n.startswith("model.layers.1.") for n in carried)  # the target's only
    manifest = av.RefitWorkerExtension.refit_manifest(worker)
    assert manifest.info["carried_input_scales"] == 2 * EXPERTS * 3  # target and drafter
    check = check_manifest(ds.params, ds.spec, manifest)
    assert check.ok, check.message("vllm")
    before = dict(draft.named_parameters())
    for seed in (2, 3):
        gen = ds.generation(seed)
        av.load_generation(worker, gen, Format.NVFP4)
        after = dict(draft.named_parameters())
        assert all(after[n] is p for n, p in before.items())
        assert all(_same(after[n], t) for n, t in held.items()), {n: (after[n], t) for n, t in held.items()}
        ref = dict(ds.built(gen, draft=True).named_parameters())
        differ = [n for n, p in after.items() if n.rpartition(".")[2] not in _KV and not _same(p, ref[n])]
        assert not differ, f"the drafter's reload differs from vLLM's own load: {differ[:5]}"


def _differ(vm, worker, whole) -> list[str]:
    """The target's and the drafter's parameters of ``worker`` whose bytes differ from ``whole``'s
    (KV-cache scales, engine state no refit carries, left out); [] when both hold the same."""
    out = []
    for get in ("get_model", "get_draft_model"):
        want = dict(getattr(whole.model_runner, get)().named_parameters())
        model = getattr(worker.model_runner, get)()
        wrong, checked = vm.load_mismatches(
            model, lambda n, p, want=want: None if n.rpartition(".")[2] in _KV else want[n]
        )
        assert checked > 0
        out += [f"{get}: {w}" for w in wrong]
    return out


def test_nvfp4_mtp_worker_streams_and_its_drafter_ends_each_step_as_a_whole_load(deepseek_mtp):
    """A worker with an MTP drafter streams (``streamed_group_loader``): the target takes the daemon's
    layer groups in one layerwise session, and when the step is published the drafter is reloaded
    from the whole generation (its own activation scales carried, its lm_head through the target's)
    before the step is acknowledged. After each step the target AND the drafter hold byte for byte
    what a worker loading whole generations (``load_generation``) holds. A drafter whose reload
    fails halfway fails the step (acknowledged ``ok=False`` with its error), and the worker returns
    to the live step, drafter included; the next step streams again."""
    from support.vllm_models import StreamedSteps, stream_groups

    ds = deepseek_mtp
    first = ds.generation(0)
    whole, streamed = ds.worker(first), ds.worker(first)
    groups = stream_groups(ds.params, ds.spec)
    assert any(all(n.startswith(f"model.layers.{ds.layers}.") for n in g) for g in groups)  # the MTP layer's
    steps = StreamedSteps(streamed, groups)
    draft = streamed.model_runner.get_draft_model()
    live = (0, first)
    for step in (1, 2):
        gen = ds.generation(10 + step)
        av.load_generation(whole, gen, Format.NVFP4)
        result = steps.step(live, step, gen)
        assert result.ok and result.step == step and not result.rolled_back, result
        assert steps.acks[-1] == (step, True, None)
        assert _differ(ds.vm, streamed, whole) == []
        live = (step, gen)

    def fails_halfway(weights):  # once: the drafter takes part of its layer, then the device fails
        del draft.load_weights  # the rollback's reload is vLLM's own again
        mine = [(n, t) for n, t in weights if n.startswith(f"model.layers.{ds.layers}.")]
        draft.load_weights(mine[: len(mine) // 2])
        raise RuntimeError("CUDA error: out of memory (injected)")

    draft.load_weights = fails_halfway
    result = steps.step(live, 3, ds.generation(13))
    assert "load_weights" not in vars(draft)  # the drafter's reload was reached, and failed
    assert not result.ok and result.rolled_back and result.step == 2, result
    assert "out of memory (injected)" in result.error
    assert steps.acks[-1][:2] == (3, False) and "out of memory (injected)" in steps.acks[-1][2]
    assert _differ(ds.vm, streamed, whole) == []  # the whole worker still holds step 2
    gen = ds.generation(14)
    av.load_generation(whole, gen, Format.NVFP4)
    result = steps.step(live, 4, gen)
    assert result.ok and result.step == 4 and steps.acks[-1] == (4, True, None)
    assert _differ(ds.vm, streamed, whole) == []


def _input_scales(worker) -> dict[str, torch.Tensor]:
    """Copies of the NVFP4 activation scales the worker's target and drafter hold."""
    runner = worker.model_runner
    return {
        f"{get}:{n}": p.detach().clone()
        for get in ("get_model", "get_draft_model")
        for n, p in getattr(runner, get)().named_parameters()
        if n.endswith("input_scale")
    }


def _fails_halfway(module: torch.nn.Module, moe: str, times: int = 1) -> None:
    """``module.load_weights`` fails ``times`` times: the MoE layer ``moe`` (checkpoint name) takes
    half of its weights (none of its activation scales, carried after them), then the device fails;
    vLLM's layerwise reload then processes that layer with the rest uninitialised."""

    def fails(weights):
        del module.load_weights  # the next load is vLLM's own again
        mine = [(n, t) for n, t in weights if n.startswith(f"{moe}.")]
        module.load_weights(mine[: len(mine) // 2])
        if times > 1:
            _fails_halfway(module, moe, times - 1)
        raise RuntimeError("CUDA error: out of memory (injected)")

    module.load_weights = fails


def test_nvfp4_mtp_whole_load_failing_halfway_carries_the_last_good_activation_scales(deepseek_mtp):
    """A whole ``load_generation`` that fails halfway leaves the layer it reached processed half
    loaded, its activation scales garbage. The next load (back to the last good step, or the next
    step) carries the scales the worker read for its last good load instead of reading them back
    (adapters.vllm.last_good): the engine holds again exactly the scales it held before, bit for
    bit, and all of its parameters equal a worker that never failed; target (its MoE layer fails)
    and MTP drafter (its own MoE layer fails, after the target's reload)."""
    ds = deepseek_mtp
    first = ds.generation(0)
    worker, whole = ds.worker(first), ds.worker(first)
    held = _input_scales(worker)
    assert len(held) == 4, sorted(held)  # w13 and w2 of the target's and the drafter's MoE layer
    runner = worker.model_runner
    cases = ((runner.get_model(), 1, (0, first)), (runner.get_draft_model(), ds.layers, None))
    for seed, (victim, layer, then) in enumerate(cases, start=30):
        _fails_halfway(victim, f"model.layers.{layer}.mlp.experts")
        with pytest.raises(RuntimeError, match="injected"):
            av.load_generation(worker, ds.generation(seed), Format.NVFP4)
        assert "load_weights" not in vars(victim)  # reached, and failed halfway
        assert _differ(ds.vm, worker, whole) != []  # (the failed load changed the engine)
        step, gen = then or (seed + 10, ds.generation(seed + 10))
        if then is None:  # the next step
            av.load_generation(whole, gen, Format.NVFP4)
        av.load_generation(worker, gen, Format.NVFP4)  # the last good step again / the next step
        now = _input_scales(worker)
        assert all(_same(now[n], t) for n, t in held.items()), {n: (now[n], t) for n, t in held.items()}
        assert _differ(ds.vm, worker, whole) == [], step


def test_nvfp4_mtp_streamed_step_whose_rollback_fails_leaves_the_next_whole_load_the_good_scales(
    deepseek_mtp,
):
    """The streamed path and the whole one share the record (adapters.vllm.last_good): a streamed step
    that fails halfway, and whose rollback to the live step fails the same way, ends in an error (the
    engine holds a mix); the next load is whole, and it carries the scales read when that step
    began, not what the engine holds then: the target's MoE layer failing (its layerwise session
    left open by the failed rollback: the layers on the meta device, nothing to read), then the
    MTP drafter's (when the step is sealed, and in the rollback: garbage scales). Each time target
    and drafter then hold their scales bit for bit and equal a worker that never failed. The failed
    rollback's session is closed (adapters.stream), so the step streamed after the whole load opens
    its own (the drafter's case streams the target's groups before failing)."""
    from support.vllm_models import StreamedSteps, stream_groups

    from sidecar.errors import RefitError

    ds = deepseek_mtp
    live = (0, ds.generation(0))
    worker, whole = ds.worker(live[1]), ds.worker(live[1])
    held = _input_scales(worker)
    steps = StreamedSteps(worker, stream_groups(ds.params, ds.spec))
    runner = worker.model_runner
    for step, (victim, layer) in enumerate(((runner.get_model(), 1), (runner.get_draft_model(), ds.layers))):
        _fails_halfway(victim, f"model.layers.{layer}.mlp.experts", times=2)
        with pytest.raises(
            RefitError, match=r"injected\), and reloading step \d+ failed \(RuntimeError: CUDA"
        ):
            steps.step(live, 2 * step + 1, ds.generation(41 + step))
        assert "load_weights" not in vars(victim)  # reached twice, and failed twice
        live = (2 * step + 2, ds.generation(51 + step))
        for w in (worker, whole):
            av.load_generation(w, live[1], Format.NVFP4)
        now = _input_scales(worker)
        assert all(_same(now[n], t) for n, t in held.items()), {n: (now[n], t) for n, t in held.items()}
        assert _differ(ds.vm, worker, whole) == [], step


def test_tp2_four_bit_loads_each_ranks_slice_and_reloads_in_two_gloo_ranks(vm, tmp_path):
    """tensor_parallel_size 2 (I = 128: I/tp = 64, whole NVFP4 / INT4 / MXFP4 groups per rank): two gloo
    processes (tests/support/vllm_tp.py, the block-FP8 tp-2 harness) build the real Qwen3-MoE in each
    4-bit format in turn, attach (no refusal), load refitd's generation with every rank's slice of every
    expert's 4-bit codes and group scales where vLLM's sharding puts them, and reload two generations
    in place, each byte-equal to vLLM's own load + processing on that rank (NVFP4: with the engine's
    calibrated activation scales carried over)."""
    from support.vllm_tp import run_ranks

    folder = vm.write_config(tmp_path, "qwen3_moe", moe_intermediate_size=128)
    for result in run_ranks(folder, ",".join(FORMATS), tmp_path):
        assert "error" not in result, result.get("trace")
        assert sorted(result["by_format"]) == sorted(FORMATS)
        for fmt, r in result["by_format"].items():
            assert r["moe_tp_size"] == 2 and r["constraints"] == [], (fmt, r)
            assert r["expert_slices_wrong"] == [], (fmt, r["expert_slices_wrong"][:5])
            # codes and group scales of w13 and w2, every expert of both MoE layers
            assert r["expert_slices_checked"] == 2 * 2 * EXPERTS * 2, (fmt, r)
            for reload in r["reloads"]:
                assert reload["moved"] == [] and reload["differ"] == [] and reload["compared"] > 0, (
                    fmt,
                    reload,
                )


def test_mxfp4_sm100_cutlass_w4a4_path_reloads_in_place(vm, tmp_path, monkeypatch):
    """compressed-tensors MXFP4 as vLLM builds it on SM100-SM119 (``mxfp4_experts_quant_supported``):
    ``CutlassExpertsMxfp4`` (W4A4), whose processing swizzles the E8M0 scales into CUTLASS tiles
    (``swizzle_mxfp4_scales``, pure torch). Replaced: only its device check (True on this CPU).
    Two in-place reloads equal vLLM's own load + processing of the same generation."""
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsMxfp4

    monkeypatch.setattr(CutlassExpertsMxfp4, "_supports_current_device", staticmethod(lambda: True))
    engine = FourBitEngine(vm, tmp_path, "mxfp4")
    moe = "model.layers.0.mlp.experts.routed_experts"
    method = engine.model.get_submodule(moe).quant_method
    assert method.use_cutlass_mxfp4 and type(method.moe_kernel.fused_experts) is CutlassExpertsMxfp4
    assert engine.manifest().moe_backend.endswith("/CutlassExpertsMxfp4"), engine.manifest().moe_backend
    # processed: the scales are in CUTLASS's tiled order, not the checkpoint's (same shape)
    gen = engine.generation(1)
    loaded = torch.stack(
        [
            torch.cat(
                [gen[f"model.layers.0.mlp.experts.{e}.{p}.weight_scale"] for p in ("gate_proj", "up_proj")]
            )
            for e in range(EXPERTS)
        ]
    )
    av.load_generation(engine.worker, gen, engine.fmt)
    held = dict(engine.model.named_parameters())[f"{moe}.w13_weight_scale"]
    assert held.shape == loaded.shape and not torch.equal(held, loaded)
    _two_reloads_equal_vllms_own_load(engine)


def test_int4_w4a16_marlin_path_reloads_in_place(vm, tmp_path, monkeypatch):
    """INT4 W4A16 as vLLM builds it on SM75+ GPUs at Marlin-aligned shapes (``oracle/int_wna16.py``:
    MARLIN ahead of Triton; the fixture's EMULATION answer replaced by MARLIN here): the int4 codes
    repacked into Marlin tiles (``gptq_marlin_repack`` = vLLM's reference layout, tests/support/vllm_marlin.py)
    and the BF16 group scales permuted. Two in-place reloads equal vLLM's own load + processing."""
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_wna16,
    )

    def marlin(config, weight_key, quant_config, may_have_zp, may_have_bias, allow_tile_padding=False):
        backend = int_wna16.WNA16MoEBackend.MARLIN
        return backend, int_wna16.backend_to_kernel_cls(backend)[0]

    monkeypatch.setattr(ct_wna16, "select_wna16_moe_backend", marlin)
    engine = FourBitEngine(vm, tmp_path, "int4_w4a16")
    moe = "model.layers.0.mlp.experts.routed_experts"
    assert engine.manifest().moe_backend.endswith("/MARLIN/MarlinExperts"), engine.manifest().moe_backend
    h, i = engine.hf["hidden_size"], engine.hf["moe_intermediate_size"]
    w13 = dict(engine.model.named_parameters())[f"{moe}.w13_weight_packed"]
    assert (w13.dtype, tuple(w13.shape)) == (torch.int32, (EXPERTS, h // 16, 2 * i * 16 // 8))  # Marlin tiles
    _two_reloads_equal_vllms_own_load(engine)


def test_nvfp4_marlin_path_reloads_in_place(vm, tmp_path, monkeypatch):
    """NVFP4 as vLLM builds it on Hopper (``oracle/nvfp4.py``: no W4A4 kernel below SM100, Marlin W4A16;
    the fixture's EMULATION answer replaced by MARLIN here): codes repacked into Marlin tiles, the FP8
    group scales and global scales reprocessed (``prepare_nvfp4_moe_layer_for_marlin``), the
    activation scales dropped (carry.py gives 1.0 for them, unused). Two in-place reloads equal vLLM's
    own load + processing of the same generation and calibrated scales."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_oracle
    from vllm.model_executor.layers.quantization import modelopt

    def marlin(config, weight_key=None, activation_key=None):
        backend = nvfp4_oracle.NvFp4MoeBackend.MARLIN
        return backend, nvfp4_oracle.backend_to_kernel_cls(backend)[0]

    monkeypatch.setattr(modelopt, "select_nvfp4_moe_backend", marlin)
    engine = FourBitEngine(vm, tmp_path, "nvfp4")
    assert engine.manifest().moe_backend.endswith("/MARLIN/MarlinExperts"), engine.manifest().moe_backend
    w13 = dict(engine.model.named_parameters())["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w13.dtype == torch.int32  # Marlin tiles (the checkpoint's codes are uint8)
    _two_reloads_equal_vllms_own_load(engine, holds_input_scales=False)


def test_nvfp4_mtp_worker_streams_the_daemons_steps_through_refit_load(deepseek_mtp, tmp_path, monkeypatch):
    """The same through refitd's real daemon (its serve loop in a thread) and the worker extension's
    ``refit_attach`` / ``refit_load``: the daemon agrees to stream to the worker with a drafter, each
    step arrives as GROUP messages into the target's session (counted), the drafter is reloaded when
    it is published, and the trainer's ``push_step(wait="loaded")`` returns only after that; target
    and drafter then equal a worker loading the same steps whole. A drafter failing halfway fails the
    trainer's step (ENGINE, naming the worker and the error); the worker returns to the last good
    step, drafter included."""
    from concurrent.futures import ThreadPoolExecutor

    from support.daemons import RunningDaemon
    from support.waiting import wait_until

    from adapters.vllm.stream import LayerwiseGroups
    from sidecar.client.client import RefitClient
    from sidecar.errors import ErrorKind, RefitError

    class Worker(av.RefitWorkerExtension):  # as vLLM mixes worker_extension_cls into its Worker
        def __init__(self, parts):
            self.__dict__.update(vars(parts))

    ds, ext = deepseek_mtp, av.RefitWorkerExtension
    whole, streamed = ds.worker(ds.generation(0)), Worker(ds.worker(ds.generation(0)))
    draft = streamed.model_runner.get_draft_model()
    groups: list[int] = []
    real_call = LayerwiseGroups.__call__

    def counted(self, gen, names):
        groups.append(gen.step)
        return real_call(self, gen, names)

    monkeypatch.setattr(LayerwiseGroups, "__call__", counted)
    settings = dict(
        format="nvfp4", world_size=1, staging_regions=2, reader_timeout_s=60.0, step_timeout_s=60.0
    )
    with RunningDaemon(tmp_path, hf_config=ds.hf, **settings) as d, ThreadPoolExecutor(1) as pool:
        assert ext.refit_attach(streamed, d.endpoint, timeout=60.0).get("stream") == 1
        with RefitClient(d.endpoint, 0, 1, timeout=60.0) as client:

            def push(step: int) -> tuple[dict, RefitError | None]:
                """The trainer pushes ``step`` and waits until it is loaded; the worker's result and
                the trainer's error. The whole-loading worker then loads the step if it succeeded."""
                load = pool.submit(ext.refit_load, streamed, step, 60.0)
                if step > 0:  # streamed only to a reader already waiting (on top of the step it holds)
                    waiting = lambda: any(p.waiting for p in list(d.daemon.peers.values()))  # noqa: E731
                    wait_until("the worker's WAIT", waiting)
                error = None
                try:
                    client.push_step(step, ds.state(step), wait="loaded", timeout=60.0)
                except RefitError as exc:
                    error = exc
                result = load.result()
                if result["ok"]:
                    av.load_generation(whole, ds.generation(step), Format.NVFP4)
                return result, error

            for step in (0, 1, 2):
                result, error = push(step)
                assert error is None and result["ok"] and result["step"] == step, (result, error)
                assert _differ(ds.vm, streamed, whole) == []
            # step 0 was loaded whole (nothing to return to yet), then each step streamed group by group
            assert groups.count(0) == 0 and groups.count(1) > 1 and groups.count(2) > 1, groups

            def fails_halfway(weights):  # once: the drafter takes part of its layer, then the device fails
                del draft.load_weights
                mine = [(n, t) for n, t in weights if n.startswith(f"model.layers.{ds.layers}.")]
                draft.load_weights(mine[: len(mine) // 2])
                raise RuntimeError("CUDA error: out of memory (injected)")

            draft.load_weights = fails_halfway
            result, error = push(3)
            assert "load_weights" not in vars(draft)  # the drafter's reload was reached, and failed
            assert not result["ok"] and result["rolled_back"] and result["step"] == 2, result
            assert error is not None and error.kind is ErrorKind.ENGINE, error
            assert "vllm-rank0" in str(error) and "out of memory (injected)" in str(error), error
            assert _differ(ds.vm, streamed, whole) == []  # both on step 2
            # step 3 was published (it failed in this engine after the seal, as a failed whole load
            # does): step 4 is loaded whole (a step streams only on top of the live one), 5 streams
            for step in (4, 5):
                result, error = push(step)
                assert error is None and result["ok"] and result["step"] == step, (result, error)
                assert _differ(ds.vm, streamed, whole) == []
            assert groups.count(4) == 0 and groups.count(5) > 1, groups
        ext.refit_detach(streamed)
