"""vLLM 0.33.0's REAL Qwen3-MoE holding the format variants its manifest decides (``make test-engines``):
INT4 W4A16 with group 128 (``CompressedTensorsWNA16MoEMethod``) and NVFP4 under compressed-tensors' names
(``CompressedTensorsW4A4Nvfp4MoEMethod``, ``nvfp4-pack-quantized``), NVFP4A16 and W4A4 (NVFP4 activations
with static global scales, which the engine holds from a calibrated first load and refitd carries over).

Built as tests/test_engine_vllm_fourbit.py builds its engines (tests/support/vllm_models.py: the real model
class, quantization configs from ``vllm_engine_args``, quant methods, weight loaders and
``process_weights_after_loading``); replaced, as there, only the MoE backend choice (EMULATION: vLLM's own
experts that dequantize on the fly; no kernel runs here), here also for the compressed-tensors NVFP4 method.

Checks: the manifest of the real parameters says the variant (group 128 with the engine's bf16 scales;
compressed-tensors names), a daemon spec with the defaults is re-planned to it by the attach check, and the
real ``load_weights`` takes the generation planned that way byte for byte (``weight_global_scale`` into
``w13/w2_weight_global_scale``, the reciprocal vLLM inverts in processing), which then processes; two
reloads in place equal vLLM's own load + processing of the same generation (W4A4: with the same
activation global scales, the held activation scales bit for bit, also when they must be computed back
from the held scale through EMULATION's ``1 / (1 / g)``, in streamed groups, and for DeepSeek-V3's MTP
drafter; a held scale with no float32 preimage refused; each backend's scale processing mirrored as
vLLM's real ``convert_to_nvfp4_moe_kernel_format`` does it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.engines import missing

import adapters.vllm as av
from adapters.vllm.carry import carried_input_scales
from adapters.vllm.ct_carry import reciprocal_preimage
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan.attach import check_manifest
from sidecar.plan.build import RefitSpec
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.plan.run import convert

pytestmark = pytest.mark.engine

EXPERTS = 4
_KV = ("q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point")
CT_NVFP4 = FormatParams(nvfp4_names="compressed_tensors")
#: variant -> (format, format parameters, vLLM's MoE method, W4A4)
VARIANTS = {
    "int4-g128": ("int4_w4a16", FormatParams(int4_group=128), "CompressedTensorsWNA16MoEMethod", False),
    "nvfp4-ct": ("nvfp4", CT_NVFP4, "CompressedTensorsW4A4Nvfp4MoEMethod", False),
    "nvfp4-ct-w4a4": ("nvfp4", CT_NVFP4, "CompressedTensorsW4A4Nvfp4MoEMethod", True),
}
_HELD = ("w13_input_scale", "w2_input_scale")


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
        missing(
            "vLLM's model classes do not import",
            "needs vLLM 0.33.0 in .venv-engines: run `make test-engines`",
            exc,
        )

    def nvfp4_emulation(config, weight_key=None, activation_key=None):  # as support.vllm_models for ModelOpt
        backend = nvfp4_oracle.NvFp4MoeBackend.EMULATION
        return backend, nvfp4_oracle.backend_to_kernel_cls(backend)[0]

    ct_nvfp4.select_nvfp4_moe_backend = nvfp4_emulation
    return vllm_models


def _calibrated(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Static activation global scales as a calibrated compressed-tensors NVFP4 checkpoint holds them:
    ``[1]`` float32 per projection, different per expert (gate and up share one)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "w13_input_global_scale"):
            moe = name.replace(".routed_experts", "")
            for e in range(EXPERTS):
                gate_up, down = torch.tensor([2231.7 + 37.3 * e]), torch.tensor([911.3 - 11.9 * e])
                out.update({f"{moe}.{e}.{p}.input_global_scale": gate_up for p in ("gate_proj", "up_proj")})
                out[f"{moe}.{e}.down_proj.input_global_scale"] = down
    assert out
    return out


def _held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The activation scales processing left on each MoE layer (plain attributes the kernel reads)."""
    return {
        f"{n}.{a}": getattr(m, a).detach().clone()
        for n, m in model.named_modules()
        for a in _HELD
        if getattr(m, a, None) is not None
    }


class Engine:
    def __init__(self, vm, root: Path, variant: str):
        fmt, self.params, self.method, self.w4a4 = VARIANTS[variant]
        self.vm, self.fmt = vm, Format.parse(fmt)
        self.folder = vm.write_config(root / variant, "qwen3_moe")  # H = 256, I = 128
        self.hf = vm.config_dict(self.folder)
        self.plan_hf = normalize_hf_config(self.hf)
        layers = get_model(model_type_of(self.hf)).num_hidden_layers(self.hf)
        self.spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=layers, params=self.params)
        self.daemon_spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=layers)  # defaults
        self.args = av.vllm_engine_args(self.spec, self.hf, nvfp4_w4a4=self.w4a4)
        self.config = vm.vllm_config(self.folder, self.args)
        vm.init_distributed(self.config)
        self.model = vm.build_model(self.config)
        # W4A4: the engine as a calibrated checkpoint leaves it (its first load is vLLM's own)
        self.calibrated = _calibrated(self.model) if self.w4a4 else {}
        self.model.load_weights(av.ordered_weights({**self.generation(0), **self.calibrated}))
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
    if leaf == "input_global_scale" and f"{head}.mlp.experts.0.down_proj.{leaf}" not in gen:
        return None  # the activations' scale: engine state, not published (NVFP4A16: never loaded)
    projs = ("gate_proj", "up_proj") if w == "w13" else ("down_proj",)
    rows = [[gen[f"{head}.mlp.experts.{x}.{p}.{leaf}"] for p in projs] for x in range(param.shape[0])]
    if leaf in ("weight_global_scale", "input_global_scale"):  # one-element per projection: [E, 2] / [E]
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
        # NVFP4A16: no activation scale to carry; W4A4: one per projection of each expert, carried
        carried = 2 * EXPERTS * 3 if engine.w4a4 else 0
        assert manifest.info["carried_input_scales"] == carried
        assert len(carried_input_scales(engine.model.named_modules())) == carried
        methods = [m.quant_method for m in engine.model.modules() if hasattr(m, "w13_input_global_scale")]
        assert methods and all(m.use_a16 is not engine.w4a4 for m in methods)


def test_the_real_load_weights_takes_the_variant_byte_for_byte(engine):
    gen = {**engine.generation(1), **engine.calibrated}
    model = engine.vm.build_model(engine.config)
    model.load_weights(av.ordered_weights(gen))
    wrong, checked = engine.vm.load_mismatches(model, lambda name, p: _expected(name, p, gen))
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
    equals vLLM's own load and processing of the same generation (W4A4: with the calibrated activation
    global scales; the activation scales the engine holds stay bit for bit)."""
    _two_reloads(engine, engine.calibrated)


def _two_reloads(engine: Engine, scales: dict[str, torch.Tensor]) -> None:
    """Two reloads through ``load_generation``, each equal to vLLM's own load of the generation with
    ``scales`` (the activation global scales the reference load is given)."""
    model = engine.model
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    # NVFP4A16 (use_a16): EMULATION derives a scale from uninitialised parameters no kernel reads
    held = _held(model) if engine.w4a4 else {}
    assert bool(held) == engine.w4a4
    for seed in (2, 3):
        gen = engine.generation(seed)
        av.load_generation(engine.worker, gen, engine.fmt)
        after = dict(model.named_parameters())
        assert after.keys() == before.keys()
        moved = [n for n, (p, ptr) in before.items() if after[n] is not p or after[n].data_ptr() != ptr]
        assert not moved, f"parameters replaced by the reload: {moved[:5]}"
        now = _held(model) if engine.w4a4 else {}
        assert now.keys() == held.keys() and all(_same(now[n], t) for n, t in held.items()), (held, now)
        reference = engine.vm.build_model(engine.config)
        reference.load_weights(av.ordered_weights({**gen, **scales}))
        engine.vm.process(engine.config, reference)
        ref = dict(reference.named_parameters())
        ref_held = _held(reference) if engine.w4a4 else {}
        assert ref_held.keys() == held.keys() and all(_same(ref_held[n], t) for n, t in held.items())
        differ = [n for n, p in after.items() if n.rpartition(".")[2] not in _KV and not _same(p, ref[n])]
        if engine.fmt is Format.NVFP4 and not engine.w4a4:
            # NVFP4A16 (input_activations None): vLLM creates w13/w2_input_global_scale but no checkpoint
            # fills them and its kernels never read them (use_a16); both loads leave them uninitialised
            methods = [m.quant_method for m in model.modules() if hasattr(m, "w13_input_global_scale")]
            assert methods and all(m.use_a16 for m in methods)
            differ = [n for n in differ if not n.endswith("_input_global_scale")]
        assert not differ, f"the reload differs from vLLM's own load of the same generation: {differ[:5]}"


def _w4a4(engine: Engine) -> list[torch.nn.Module]:
    if not engine.w4a4:
        pytest.skip("W4A4 only: the engine holds static activation scales")
    return [m for m in engine.model.modules() if getattr(m, "w13_input_scale", None) is not None]


def test_w4a4_carries_the_held_scale_computed_back_when_the_loaded_values_are_gone(engine):
    """The loaded ``input_global_scale`` parameters no longer process into the held activation scale
    (here overwritten): the carried value is computed back from the held scale through EMULATION's
    ``1 / (1 / g)``, and two reloads with it keep the held scale bit for bit and equal vLLM's own load
    of the generation with the carried values."""
    for m in _w4a4(engine):
        m.w13_input_global_scale.data.fill_(3.0)
        m.w2_input_global_scale.data.fill_(5.0)
    carried = carried_input_scales(engine.model.named_modules())
    assert len(carried) == 2 * EXPERTS * 3 and all(t.dtype == torch.float32 for t in carried.values())
    assert not any(torch.equal(t.reshape(()), torch.tensor(3.0)) for t in carried.values())
    _two_reloads(engine, carried)


def test_w4a4_refuses_a_held_scale_with_no_float32_preimage(engine):
    """A held activation scale that no float32 ``input_global_scale`` reaches through vLLM's processing
    is refused, naming why, before anything is loaded: the engine keeps every parameter."""
    module = _w4a4(engine)[0]
    held = module.w13_input_scale
    # every float32 g from the held scale up, through EMULATION's 1 / (1 / g): monotone, so a value
    # between two consecutive images (bits) is reached by no float32 g at all; the first such value
    bits = held.detach().reshape(()).view(torch.int32) + torch.arange(1 << 23, dtype=torch.int32)  # a binade
    image = (1.0 / (1.0 / bits.view(torch.float32))).view(torch.int32)
    gaps = torch.nonzero(image[1:] - image[:-1] > 1)
    assert len(gaps), "no float32 without a preimage above the held scale"
    x = (image[int(gaps[0])] + 1).view(torch.float32)
    assert reciprocal_preimage(x, 2) is None
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    try:
        for bad, why in (
            (x, "no float32 input_global_scale reproduces"),
            (torch.tensor(0.0), "finite positive"),
        ):
            module.w13_input_scale = bad
            with pytest.raises(ValueError, match=why):
                carried_input_scales(engine.model.named_modules())
            with pytest.raises(ValueError, match=why):
                av.load_generation(engine.worker, engine.generation(4), engine.fmt)
            after = dict(engine.model.named_parameters())
            assert all(_same(after[n], t) for n, t in before.items())
    finally:
        module.w13_input_scale = held


#: FLASHINFER_TRTLLM takes FLASHINFER_CUTLASS's scale path but shuffles its weights with FlashInfer (absent)
@pytest.mark.parametrize(
    "backend", ["EMULATION", "VLLM_CUTLASS", "FLASHINFER_CUTLASS", "FLASHINFER_CUTEDSL", "B12X"]
)
def test_w4a4_carry_mirrors_vllms_processing_of_each_backend(vm, backend, monkeypatch):
    """vLLM's real ``convert_to_nvfp4_moe_kernel_format`` (pure torch for these backends) given the
    compressed-tensors method's ``1.0 / input_global_scale``, per-expert calibrated scales: ``processed``
    says the same scales bit for bit, and the values carried back from what it holds (computed back,
    the loaded ones overwritten) make the real conversion hold the same scales again. Replaced: only
    ``swizzle_blockscale``'s ``.cuda()`` of the weight block scales (a no-op here: no GPU)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as oracle

    from adapters.vllm.ct_carry import carried_global_scales, processed

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    e, i, h = EXPERTS, 128, 256
    g = torch.Generator().manual_seed(7)

    def convert_scales(g13: torch.Tensor, g2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = SimpleNamespace(
            moe_parallel_config=SimpleNamespace(enable_eplb=False),
            hidden_dim=h,
            hidden_dim_unpadded=None,
            intermediate_size_per_partition=i,
        )
        layer = SimpleNamespace(activation=SimpleNamespace(is_gated=True), moe_config=moe)
        w13 = torch.randint(0, 255, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
        w2 = torch.randint(0, 255, (e, h, i // 2), dtype=torch.uint8, generator=g)
        s13 = torch.ones(e, 2 * i, h // 16).to(torch.float8_e4m3fn)
        s2 = torch.ones(e, h, i // 16).to(torch.float8_e4m3fn)
        out = oracle.convert_to_nvfp4_moe_kernel_format(
            nvfp4_backend=oracle.NvFp4MoeBackend[backend],
            layer=layer,
            w13=w13,
            w13_scale=s13,
            w13_scale_2=torch.ones(e),
            a13_scale=1.0 / g13,
            w2=w2,
            w2_scale=s2,
            w2_scale_2=torch.ones(e),
            a2_scale=1.0 / g2,
            is_act_and_mul=True,
        )
        return out[3], out[7]

    g13 = (2000 + 300 * torch.rand(e, 1, generator=g)).expand(e, 2).contiguous()
    g2 = 900 + 100 * torch.rand(e, generator=g)
    held13, held2 = convert_scales(g13, g2)
    mine = processed(backend, g13, g2)
    assert _same(mine[0], held13) and _same(mine[1], held2), (backend, mine, held13, held2)
    module = SimpleNamespace(
        w13_input_global_scale=torch.full((e, 2), 3.0),
        w2_input_global_scale=torch.full((e,), 5.0),
        w13_input_scale=held13,
        w2_input_scale=held2,
    )
    c13, c2 = carried_global_scales("layer", module, backend)
    again13, again2 = convert_scales(c13, c2)
    assert _same(again13, held13) and _same(again2, held2), (backend, c13, c2)


def test_w4a4_streamed_groups_carry_the_held_scale(engine):
    """The streamed path (``streamed_group_loader``: layer groups into one layerwise session) carries
    the held activation scales into each MoE layer's group too: after the session the engine holds the
    generation as vLLM's own load with the same global scales does, the held scale bit for bit."""
    from types import SimpleNamespace

    from adapters.vllm.worker import streamed_group_loader

    _w4a4(engine)
    model = engine.model
    held, carried = _held(model), carried_input_scales(model.named_modules())
    loader = streamed_group_loader(engine.worker)
    assert loader is not None
    gen = engine.generation(5)
    by_layer: dict[str, list[str]] = {}
    for name in gen:  # one group per decoder layer, the rest (embedding, norm, head) in one
        parts = name.split(".")
        layer = ".".join(parts[: parts.index("layers") + 2]) if "layers" in parts else "rest"
        by_layer.setdefault(layer, []).append(name)
    assert len(by_layer) == 3
    for names in by_layer.values():
        loader(SimpleNamespace(tensors=gen), names)
    loader.finish()
    now = _held(model)
    assert now.keys() == held.keys() and all(_same(now[n], t) for n, t in held.items()), (held, now)
    reference = engine.vm.build_model(engine.config)
    reference.load_weights(av.ordered_weights({**gen, **carried}))
    engine.vm.process(engine.config, reference)
    ref = dict(reference.named_parameters())
    differ = [
        n for n, p in model.named_parameters() if n.rpartition(".")[2] not in _KV and not _same(p, ref[n])
    ]
    assert not differ, f"the streamed load differs from vLLM's own load of the same generation: {differ[:5]}"


def test_w4a4_mtp_drafter_reloads_keeping_its_own_activation_scales(vm, tmp_path):
    """DeepSeek-V3 in compressed-tensors NVFP4 W4A4 with its MTP drafter (``DeepSeekMTP``, its own
    ``CompressedTensorsW4A4Nvfp4MoEMethod`` at ``model.layers.2.mtp_block.mlp.experts``):
    ``load_generation`` carries the drafter's calibrated activation global scales (distinct from the
    target's) under the names its ``load_weights`` reads (``model.layers.2.mlp.experts.{e}.*.
    input_global_scale``): its held activation scales stay bit for bit and the reloaded drafter equals
    vLLM's own load + processing of the generation with those scales."""
    folder = vm.write_config(tmp_path, "deepseek_v3")
    hf = vm.config_dict(folder)
    registry = get_model(model_type_of(hf))
    layers = registry.num_hidden_layers(hf)
    spec = RefitSpec(model_type="deepseek_v3", fmt="nvfp4", num_hidden_layers=layers, params=CT_NVFP4)
    args = av.vllm_engine_args(spec, hf, include_vision=False, nvfp4_w4a4=True)
    config = vm.vllm_config(folder, args, mtp=True)
    vm.init_distributed(config)
    params = registry.parameters(normalize_hf_config(hf), include_mtp=True, include_vision=False)

    def generation(seed):
        g = torch.Generator().manual_seed(seed)
        state = {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in params}
        for n in state:  # DeepSeek's MTP layer holds a copy of the embedding
            if n.endswith(".embed_tokens.weight") and n.startswith("model.layers."):
                state[n] = state["model.embed_tokens.weight"]
        return convert(state, spec)

    calibrated = {}  # the target's MoE layer (model.layers.1) and the drafter's (checkpoint layer 2)
    for layer, base in ((1, 1500.0), (layers, 4100.0)):
        for e in range(EXPERTS):
            for proj, v in (("gate_proj", base), ("up_proj", base), ("down_proj", base / 3)):
                calibrated[f"model.layers.{layer}.mlp.experts.{e}.{proj}.input_global_scale"] = torch.tensor(
                    [v + 17.0 * e]
                )

    def built(gen, *, draft):
        m = vm.build_model(config, draft=draft)
        m.load_weights(av.ordered_weights({**gen, **calibrated}))
        vm.process(config, m, draft=draft)
        return m

    first = generation(0)
    model, draft = built(first, draft=False), built(first, draft=True)
    worker = vm.worker(config, model, draft)
    held = _held(draft)
    assert held and all(n.startswith(f"model.layers.{layers}.mtp_block.") for n in held), sorted(held)
    assert not any(_same(t, v) for t, v in zip(held.values(), _held(model).values(), strict=False))
    manifest = av.RefitWorkerExtension.refit_manifest(worker)
    assert manifest.info["carried_input_scales"] == 2 * EXPERTS * 3  # target and drafter
    check = check_manifest(params, spec, manifest)
    assert check.ok, check.message("vllm")
    before = dict(draft.named_parameters())
    for seed in (2, 3):
        gen = generation(seed)
        av.load_generation(worker, gen, Format.NVFP4)
        after = dict(draft.named_parameters())
        assert all(after[n] is p for n, p in before.items())
        now = _held(draft)
        assert all(_same(now[n], t) for n, t in held.items()), (held, now)
        ref = dict(built(gen, draft=True).named_parameters())
        differ = [n for n, p in after.items() if n.rpartition(".")[2] not in _KV and not _same(p, ref[n])]
        assert not differ, f"the drafter's reload differs from vLLM's own load: {differ[:5]}"
