"""The TensorRT-LLM adapter in NVFP4, without TensorRT-LLM: against transcriptions of its source.

``import tensorrt_llm`` needs CUDA, so what TRT-LLM does with refitd's NVFP4 tensors is transcribed
here from NVIDIA/TensorRT-LLM, each piece naming its file and commit:

* ``_torch/modules/fused_moe/quantization.py``@a98a9061: ``NVFP4FusedMoEMethod.create_weights``
  (parameter names, dtypes, shapes), ``FusedMoEMethodBase.load_expert_w3_w1_weight`` /
  ``load_expert_w2_weight`` (``cat([w3, w1])`` viewed as the destination dtype),
  ``NVFP4CutlassFusedMoEMethod.load_expert_w3_w1_weight_scale_nvfp4`` / ``..._w2_...`` up to (not
  including) ``torch.ops.trtllm.block_scale_interleave``, a CUDA op), ``NVFP4FusedMoEMethod.
  load_quant_scales`` (``{e}.w1/w3/w2.input_scale`` of *every* expert, ``fc31_input_scale =
  max(...).reciprocal()``, the alphas ``1 / (input_scale * (1 / weight_scale_2))``). The newest stored
  copy defers the same arithmetic to ``process_weights_after_loading``
  (``torch.stack(values).max().reciprocal()``).
* ``_torch/models/checkpoints/hf/qwen2_moe_weight_mapper.py``: ``gate_proj -> w1``, ``up_proj -> w3``,
  ``down_proj -> w2``, suffixes riding along.

The quantized bytes are refitd's own (``sidecar.plan.run.convert``, the real quantizer).
"""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch

from adapters.scales import exact_reciprocal_preimage
from adapters.trtllm import (
    MoeBackend,
    RefitWorkerExtension,
    backend_refusal,
    build_manifest,
    check_trtllm_constraints,
    resolve_moe_backend,
    trtllm_llm_args,
)
from adapters.trtllm.carry import nvfp4_input_scales
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.numerics.formats import Format
from sidecar.plan.build import RefitSpec, plan_from_hf_config
from sidecar.plan.run import convert

MODEL = "qwen3_moe"
SIZES = {"num_layers": 2, "num_experts": 4, "hidden": 128, "intermediate": 64}
CONFIG = make_hf_config(MODEL, **SIZES)
HID, INTER, E = 128, 64, 4
#: checkpoint name -> the MoE module's weights dict key (qwen2_moe_weight_mapper.py)
_EXPERT = re.compile(
    r"^(?P<moe>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<leaf>\w+)$"
)
_RENAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


# --------------------------------------------------------------------------------------------------
# the transcription: an NVFP4 CUTLASS MoE module and its loader


def nvfp4_cutlass_params(e: int, h: int, i: int) -> dict[str, torch.Tensor]:
    """``NVFP4CutlassFusedMoEMethod.create_weights`` (@a98a9061): 16 E2M1 values per int64
    (``weight_vec_size = 64 // 4``), 4 float8 scales per int32; input scales 0-d, alphas [E]."""
    return {
        "w3_w1_weight": torch.zeros(e, 2 * i, h // 16, dtype=torch.int64),
        "w2_weight": torch.zeros(e, h, i // 16, dtype=torch.int64),
        "w3_w1_weight_scale": torch.ones(e, 2 * i, h // 16 // 4, dtype=torch.int32),
        "w2_weight_scale": torch.ones(e, h, i // 16 // 4, dtype=torch.int32),
        "fc31_input_scale": torch.tensor(1.0),
        "fc2_input_scale": torch.tensor(1.0),
        "fc31_alpha": torch.ones(e),
        "fc2_alpha": torch.ones(e),
    }


class CutlassFusedMoE(torch.nn.Module):
    """A module shaped like TRT-LLM's ``CutlassFusedMoE`` holding NVFP4 experts (its class name is
    what the worker reports as the resolved backend)."""

    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size_per_partition = e, i
        self.initial_local_expert_ids = list(range(e))
        for name, t in nvfp4_cutlass_params(e, h, i).items():
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))


def load_weights(module: CutlassFusedMoE, weights: dict[str, torch.Tensor]) -> set[str]:
    """``NVFP4FusedMoEMethod.load_weights`` for tp = ep = 1 (@a98a9061), minus the CUDA scale
    interleave; returns the keys it read (every one it reads must be there: TRT-LLM indexes, KeyError)."""
    read: set[str] = set()

    def get(key: str) -> torch.Tensor:
        read.add(key)
        return weights[key]

    i = module.intermediate_size_per_partition
    for slot, e in enumerate(module.initial_local_expert_ids):
        w1, w3, w2 = (get(f"{e}.{w}.weight") for w in ("w1", "w3", "w2"))
        dst = module.w3_w1_weight.data[slot]
        dst.copy_(torch.cat([w3, w1], dim=0).view(dst.dtype))  # load_expert_w3_w1_weight
        module.w2_weight.data[slot].copy_(w2.view(module.w2_weight.dtype))
    # load_quant_scales, step 1: input scales of every expert (range(module.num_experts))
    fc31 = torch.empty(module.num_experts, dtype=torch.float32)
    fc2 = torch.empty(module.num_experts, dtype=torch.float32)
    for e in range(module.num_experts):
        a1, a3 = get(f"{e}.w1.input_scale").reshape([]), get(f"{e}.w3.input_scale").reshape([])
        if not torch.allclose(a1, a3):
            raise AssertionError("w1_input_scale != w3_input_scale")
        fc31[e] = a1
        fc2[e] = get(f"{e}.w2.input_scale").reshape([])
    module.fc31_input_scale.data.copy_(fc31.max().reciprocal())
    module.fc2_input_scale.data.copy_(fc2.max().reciprocal())
    # step 2: block scales (w3 rows first) and alphas
    for slot, e in enumerate(module.initial_local_expert_ids):
        s1, s3, s2 = (get(f"{e}.{w}.weight_scale") for w in ("w1", "w3", "w2"))
        g1, g3, g2 = (get(f"{e}.{w}.weight_scale_2") for w in ("w1", "w3", "w2"))
        if not torch.allclose(g1, g3):
            g1 = g3 = torch.max(g1, g3)  # TRT-LLM warns and takes the larger
        dst = module.w3_w1_weight_scale.data[slot]
        dst.narrow(0, 0, i).copy_(s3.view(dst.dtype))
        dst.narrow(0, i, i).copy_(s1.view(dst.dtype))
        module.w2_weight_scale.data[slot].copy_(s2.view(module.w2_weight_scale.dtype))
        module.fc31_alpha.data[slot].copy_(1.0 / (module.fc31_input_scale.data * (1.0 / g1.reshape([]))))
        module.fc2_alpha.data[slot].copy_(1.0 / (module.fc2_input_scale.data * (1.0 / g2.reshape([]))))
    return read


def engine_weights(published: dict[str, torch.Tensor], moe: str) -> dict[str, torch.Tensor]:
    """What TRT-LLM's Qwen3-MoE mapper hands the MoE module ``moe`` of a reload (its own prefix
    stripped, projections renamed)."""
    out = {}
    for name, t in published.items():
        m = _EXPERT.match(name)
        if m and m["moe"] == moe:
            out[f"{m['e']}.{_RENAME[m['proj']]}.{m['leaf']}"] = t
    return out


def _engine(input_scale: float = 0.0123) -> torch.nn.Module:
    """Two MoE layers as TRT-LLM holds them after loading a calibrated NVFP4 checkpoint whose largest
    ``input_scale`` is ``input_scale`` (down_proj's: 3x): ``fc31_input_scale = max(...).reciprocal()``."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    for _ in range(SIZES["num_layers"]):
        block, mlp = torch.nn.Module(), torch.nn.Module()
        mlp.experts = CutlassFusedMoE(E, HID, INTER)
        mlp.experts.fc31_input_scale.data.copy_(torch.tensor(input_scale).reciprocal())
        mlp.experts.fc2_input_scale.data.copy_(torch.tensor(input_scale * 3).reciprocal())
        block.mlp = mlp
        root.model.layers.append(block)
    return root


@pytest.fixture(scope="module")
def published() -> dict[str, torch.Tensor]:
    state = make_state_dict(MODEL, seed=0, **SIZES)
    return convert(state, RefitSpec(model_type=MODEL, fmt="nvfp4"))


def _manifest(model: torch.nn.Module, **kw):
    kw.setdefault("moe_backend", MoeBackend.CUTLASS)
    kw.setdefault("sm", 100)
    kw.setdefault("input_scales", True)
    return build_manifest([(n, p) for n, p in model.named_parameters()], CONFIG, **kw)


# --------------------------------------------------------------------------------------------------
# attach: the manifest maps TRT-LLM's parameters to refitd's names, and back


def test_manifest_is_the_plan_and_attach_passes(published):
    model = _engine()
    manifest = _manifest(model)
    assert manifest.expert_format is Format.NVFP4
    want = {
        o.name: (o.dtype, tuple(o.shape))
        for o in plan_from_hf_config(CONFIG, RefitSpec(model_type=MODEL, fmt="nvfp4")).outputs
    }
    assert {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors} == want
    assert {n: (t.dtype, tuple(t.shape)) for n, t in published.items()} == want
    assert check_trtllm_constraints(manifest, CONFIG) == []
    attach = pytest.importorskip("sidecar.plan.attach")
    from sidecar.plan.models import get_model

    check = attach.check_manifest(
        get_model(MODEL).parameters(CONFIG), RefitSpec(model_type=MODEL, fmt="nvfp4"), manifest
    )
    assert check.errors == []
    names = manifest.by_name()
    assert names["model.layers.1.mlp.experts.3.up_proj.weight_scale_2"].dtype == torch.float32
    assert not any(t.name.endswith("input_scale") for t in manifest.tensors)  # carried, not published


def test_published_names_are_exactly_what_the_loader_reads(published):
    """checkpoint -> engine: every published expert tensor of a layer, plus the carried input scales,
    is read by the transcribed loader, and nothing it reads is missing (TRT-LLM indexes; KeyError)."""
    model = _engine()
    ext = RefitWorkerExtension()
    ext._refit_fp8_input = ext._refit_capture_input_scales(model, None)
    carried = ext._refit_input_scale_tensors()
    for layer in range(SIZES["num_layers"]):
        moe = f"model.layers.{layer}.mlp.experts"
        weights = engine_weights({**published, **carried}, moe)
        read = load_weights(model.model.layers[layer].mlp.experts, weights)
        assert read == set(weights)
        assert len(weights) == E * 3 * 4  # weight, weight_scale, weight_scale_2, input_scale


def test_load_is_byte_equal_and_input_scales_carry_bit_for_bit(published):
    model = _engine(input_scale=0.0371)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("input_scale")}
    ext = RefitWorkerExtension()
    ext._refit_fp8_input = ext._refit_capture_input_scales(model, None)
    carried = ext._refit_input_scale_tensors()
    moe = "model.layers.1.mlp.experts"
    experts = model.model.layers[1].mlp.experts
    load_weights(experts, engine_weights({**published, **carried}, moe))
    for n, p in model.named_parameters():
        if n.endswith("input_scale"):
            assert torch.equal(_bits(p), _bits(before[n])), n  # the engine's activation scale, unchanged
    for e in range(E):
        gate, up, down = (f"{moe}.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        w31 = _bits(experts.w3_w1_weight[e])
        assert torch.equal(
            w31, torch.cat([_bits(published[f"{up}.weight"]), _bits(published[f"{gate}.weight"])])
        )
        assert torch.equal(_bits(experts.w2_weight[e]), _bits(published[f"{down}.weight"]))
        s31 = _bits(experts.w3_w1_weight_scale[e])
        assert torch.equal(
            s31, torch.cat([_bits(published[f"{up}.weight_scale"]), _bits(published[f"{gate}.weight_scale"])])
        )
        assert torch.equal(_bits(experts.w2_weight_scale[e]), _bits(published[f"{down}.weight_scale"]))
        # SPEC §2.3: gate and up share the global scale, so TRT-LLM takes it without a warning
        assert torch.equal(
            _bits(published[f"{gate}.weight_scale_2"]), _bits(published[f"{up}.weight_scale_2"])
        )
        gs = published[f"{gate}.weight_scale_2"]
        want = 1.0 / (experts.fc31_input_scale.data * (1.0 / gs))
        assert torch.equal(_bits(experts.fc31_alpha[e]), _bits(want))


@pytest.mark.parametrize("seed", range(4))
def test_reciprocal_preimage_is_exact(seed):
    """Every scale TRT-LLM can hold is ``x.reciprocal()`` of a float32 checkpoint input scale ``x``;
    for 2000 such ``x`` over 60 binades (and edge values) the carried value maps back to the held
    one bit for bit through ``max(...).reciprocal()``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(2000, generator=g) * 60 - 40).to(torch.float32)
    edges = torch.tensor(
        [1.0, 1 / 2688.0, 448.0, 1e-3 * 1.0001, 2.0**-126, 1.5, 0.1, 3.0e38], dtype=torch.float32
    )
    for h in torch.cat([x, edges]).reciprocal():
        v = exact_reciprocal_preimage(h)
        assert v.dtype == torch.float32 and v.shape == ()
        assert torch.equal(torch.stack([v, v, v]).max().reciprocal().view(torch.int32), h.view(torch.int32))


def test_a_held_scale_no_reciprocal_reaches_is_refused_clearly():
    """The float32 reciprocal is not onto: about one float32 value in seven is no ``fl(1/x)`` (0.0123 is
    one). TRT-LLM never holds such a value after a real load; if it does, nothing is carried silently."""
    module = SimpleNamespace(fc31_input_scale=torch.tensor(0.0123), fc2_input_scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="cannot be carried over exactly: pass input_scale= to refit_attach"):
        nvfp4_input_scales(module)


def test_reload_hands_each_layer_its_carried_input_scales(monkeypatch):
    """The worker's reload: one ``reload`` per layer, that layer's published tensors plus its carried
    ``{e}.{gate|up|down}_proj.input_scale`` for every expert (TRT-LLM reads all of them)."""
    from adapters.trtllm import worker as trtllm_worker

    calls: list[dict] = []

    class Loader:
        def reload(self, model, weights, allow_partial_loading):
            calls.append(dict(weights))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(trtllm_worker, "_sync_copies", lambda device: None)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # no CUDA here: stay on the CPU
    model = _engine()
    ext = RefitWorkerExtension()
    ext._refit_format = Format.NVFP4
    ext._refit_fp8_input = ext._refit_capture_input_scales(model, None)
    ext.engine = SimpleNamespace(model_engine=SimpleNamespace(model=model, model_loader=Loader()))
    names = ["model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight"]
    ext._refit_reload(SimpleNamespace(tensors={n: torch.zeros(1) for n in names}))
    assert len(calls) == 2
    for layer, weights in enumerate(calls):
        scales = sorted(n for n in weights if n.endswith("input_scale"))
        assert len(scales) == 3 * E and all(n.startswith(f"model.layers.{layer}.") for n in scales)
        want = exact_reciprocal_preimage(model.model.layers[layer].mlp.experts.fc2_input_scale)
        assert torch.equal(
            _bits(weights[f"model.layers.{layer}.mlp.experts.3.down_proj.input_scale"]), _bits(want)
        )


def test_override_and_dummy_input_scales():
    dummy = SimpleNamespace(fc31_input_scale=torch.tensor(5e-4), fc2_input_scale=torch.tensor(7e-4))
    assert nvfp4_input_scales(dummy) is None  # what load_format="dummy" leaves: not a calibrated scale
    negative = SimpleNamespace(fc31_input_scale=torch.tensor(-2.0), fc2_input_scale=torch.tensor(3.0))
    assert nvfp4_input_scales(negative) is None
    a, b = nvfp4_input_scales(dummy, override=0.25)
    assert float(a) == float(b) == 0.25
    with pytest.raises(ValueError, match="positive and finite"):
        nvfp4_input_scales(dummy, override=float("nan"))


# --------------------------------------------------------------------------------------------------
# attach refusals, each naming the engine's reason


def _fake_trtllm(monkeypatch, sm: int) -> None:
    root = SimpleNamespace(__version__="fake", _utils=SimpleNamespace(get_sm_version=lambda: sm))
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm._utils", root._utils)


def _worker(model: torch.nn.Module, backend: str = "CUTLASS") -> RefitWorkerExtension:
    ext = RefitWorkerExtension()
    mapping = SimpleNamespace(tp_size=1, moe_tp_size=1, moe_ep_size=1)
    model.model_config = SimpleNamespace(mapping=mapping, moe_backend=backend, pretrained_config=None)
    ext.engine = SimpleNamespace(model_engine=SimpleNamespace(model=model, global_rank=0))
    ext.device_id = 0
    return ext


def test_attach_refuses_a_dummy_loaded_engine_unless_given_a_scale(monkeypatch):
    errors = pytest.importorskip("sidecar.errors")
    _fake_trtllm(monkeypatch, sm=100)
    ext = _worker(_engine(input_scale=1 / 4e-4))  # holds 4e-4: what load_format="dummy" leaves
    with pytest.raises(errors.RefitError, match=r"NVFP4 \(W4A4\) MoE needs a static input_scale"):
        ext.refit_attach("ipc:///nonexistent", hf_config=CONFIG)
    ext._refit_fp8_input = ext._refit_capture_input_scales(ext.engine.model_engine.model, 0.5)
    manifest = ext._refit_manifest(ext.engine.model_engine.model, "fake", CONFIG)
    assert manifest.info["input_scales"] is True and check_trtllm_constraints(manifest, CONFIG) == []


@pytest.mark.parametrize(
    ("requested", "sm", "why"),
    [
        ("CUTLASS", 90, "not sm=90 (on SM89-SM99 TRT-LLM runs NVFP4 MoE only as MarlinFusedMoE"),
        ("TRTLLM", 90, "not sm=90"),
        ("TRTLLM", 120, "TRTLLMGenFusedMoE NVFP4 kernels exist only for SM100/SM103, not sm=120"),
        ("DEEPGEMM", 100, "DeepGemmFusedMoE has no NVFP4 kernel"),
        ("CUTEDSL", 100, "refitd has not verified the NVFP4 reload of CuteDslFusedMoE"),
        ("CUTLASS", 107, "not sm=107 (TRT-LLM has no NVFP4 MoE kernel for it"),
    ],
)
def test_backend_and_sm_refusals(requested, sm, why):
    resolved = resolve_moe_backend(requested, "nvfp4", sm)
    manifest = _manifest(_engine(), moe_backend=resolved, sm=sm)
    problems = check_trtllm_constraints(manifest, CONFIG)
    assert len(problems) == 1 and why in problems[0], problems
    with pytest.raises(ValueError, match=re.escape(why[:30])):
        trtllm_llm_args(
            RefitSpec(model_type=MODEL, fmt="nvfp4"), CONFIG, sm=sm, moe_backend=requested, load_format="auto"
        )


@pytest.mark.parametrize(
    ("requested", "sm"), [("CUTLASS", 100), ("CUTLASS", 120), ("TRTLLM", 103), ("AUTO", 121)]
)
def test_backends_that_take_nvfp4(requested, sm):
    resolved = resolve_moe_backend(requested, "nvfp4", sm)
    assert resolved in (MoeBackend.CUTLASS, MoeBackend.TRTLLM_GEN)
    assert check_trtllm_constraints(_manifest(_engine(), moe_backend=resolved, sm=sm), CONFIG) == []


@pytest.mark.parametrize(
    ("hidden", "inter", "tp", "why"),
    [
        (128, 72, 1, "moe_intermediate_size / tp = 72/1 to be a multiple of 64"),
        (128, 64, 8, "moe_intermediate_size / tp = 64/8 to be a multiple of 64"),
        (136, 64, 1, "hidden_size = 136 to be a multiple of 64"),
    ],
)
def test_k_not_a_multiple_of_64_after_tp_is_refused_on_cutlass(hidden, inter, tp, why):
    """K multiples after TP slicing: HID for gate/up, each rank's INTER for down_proj (EP keeps INTER
    whole); 64 on CUTLASS (4 float8 scales per int32 word, see the test below)."""
    cfg = make_hf_config(MODEL, **{**SIZES, "hidden": hidden, "intermediate": inter})
    params = [(f"model.layers.0.mlp.experts.{n}", t) for n, t in nvfp4_cutlass_params(E, 128, 64).items()]
    manifest = build_manifest(
        params, cfg, moe_backend=MoeBackend.CUTLASS, sm=100, tp_size=tp, input_scales=True
    )
    (problem,) = check_trtllm_constraints(manifest, cfg)
    assert why in problem and ("moe_tensor_parallel_size" in problem or "block_fp8" in problem)
    ep = build_manifest(
        params,
        cfg,
        moe_backend=MoeBackend.CUTLASS,
        sm=100,
        tp_size=tp,
        moe_tp_size=1,
        moe_ep_size=tp,
        input_scales=True,
    )
    assert (check_trtllm_constraints(ep, cfg) == []) == (inter % 64 == 0 and hidden % 64 == 0)


def test_nvfp4_linear_the_exclusions_missed_is_reported():
    """exclude_modules forgot attention: TRT-LLM holds qkv_proj as NVFP4LinearMethod (linear.py:
    uint8 weight [out, in/2], flat float8 scales, input_scale, alpha); refitd sends BF16 there."""
    model = _engine()
    params = [(n, p) for n, p in model.named_parameters()]
    qkv = "model.layers.0.self_attn.qkv_proj"
    params += [
        (f"{qkv}.weight", torch.uint8, (256, 64)),
        (f"{qkv}.weight_scale", torch.uint8, (256 * 8,)),
        (f"{qkv}.input_scale", torch.float32, (1,)),
        (f"{qkv}.alpha", torch.float32, (1,)),
    ]
    manifest = build_manifest(params, CONFIG, moe_backend=MoeBackend.CUTLASS, sm=100, input_scales=True)
    assert manifest.by_name()["model.layers.0.self_attn.k_proj.weight_scale_2"].shape == ()
    (problem,) = check_trtllm_constraints(manifest, CONFIG)
    assert "3 non-expert modules in NVFP4" in problem and "exclude_modules" in problem


def test_w4a8_nvfp4_layout_is_refused():
    """TRTLLM-Gen's W4A8_NVFP4_FP8 has NVFP4's parameters with one scale per 32: not what refitd sends."""
    p = {
        "w3_w1_weight": (torch.uint8, (E, 2 * INTER, HID // 2)),
        "w2_weight": (torch.uint8, (E, HID, INTER // 2)),
        "w3_w1_weight_scale": (torch.float8_e4m3fn, (E, 2 * INTER, HID // 32)),
        "w2_weight_scale": (torch.float8_e4m3fn, (E, HID, INTER // 32)),
        "fc31_input_scale": (torch.float32, ()),
        "fc31_alpha": (torch.float32, (E,)),
    }
    params = [(f"model.layers.0.mlp.experts.{n}", d, s) for n, (d, s) in p.items()]
    with pytest.raises(ValueError, match="one scale per 32"):
        build_manifest(params, CONFIG, moe_backend=MoeBackend.TRTLLM_GEN, sm=100)
    ok = {**p, "w3_w1_weight_scale": (torch.float8_e4m3fn, (E, 2 * INTER, HID // 16))}
    params = [(f"model.layers.0.mlp.experts.{n}", d, s) for n, (d, s) in ok.items()]
    assert (
        build_manifest(params, CONFIG, moe_backend=MoeBackend.TRTLLM_GEN, sm=100).expert_format
        is Format.NVFP4
    )


# --------------------------------------------------------------------------------------------------
# LLM(...) arguments, and the 4-bit formats TRT-LLM cannot load


#: what read_modelopt_quant_config keeps of a flat ModelOpt config and _build_modelopt_quant_config reads
MODELOPT_NVFP4_KEYS = {"quant_method", "quant_algo", "group_size", "exclude_modules", "kv_cache_quant_algo"}


def test_llm_args_nvfp4():
    spec = RefitSpec(model_type=MODEL, fmt="nvfp4", num_first_layers_in_bf16=1)
    with pytest.raises(ValueError, match="calibrated static input scales"):
        trtllm_llm_args(spec, CONFIG, sm=100)
    args = trtllm_llm_args(spec, CONFIG, sm=100, load_format="auto")
    assert args["moe_config"] == {"backend": "CUTLASS"} and args["load_format"] == "auto"
    quant = args["model_kwargs"]["quantization_config"]
    assert set(quant) == MODELOPT_NVFP4_KEYS
    assert (
        quant["quant_method"] == "modelopt" and quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    )
    assert quant["kv_cache_quant_algo"] is None
    fp8 = trtllm_llm_args(
        RefitSpec(model_type=MODEL, fmt="fp8_per_tensor", num_first_layers_in_bf16=1),
        CONFIG,
        load_format="auto",
    )
    assert quant["exclude_modules"] == fp8["model_kwargs"]["quantization_config"]["ignore"]
    assert quant["exclude_modules"][-1] == "model.layers.0.mlp.experts"


@pytest.mark.parametrize(
    ("fmt", "quoted"),
    [
        ("mxfp4", "'{e}.w1.weight' with '{e}.w1.weight_scale_inv' (WFP4A16FusedMoEMethod.load_quant_scales"),
        ("int4_w4a16", "its only INT4 MoE method is WInt4AFP8FusedMoEMethod (W4A8 AWQ"),
    ],
)
def test_mxfp4_and_int4_are_refused_naming_what_trtllm_reads(fmt, quoted):
    with pytest.raises(ValueError, match=re.escape(quoted)):
        trtllm_llm_args(RefitSpec(model_type=MODEL, fmt=fmt), CONFIG, sm=90)
    why = backend_refusal(fmt, MoeBackend.CUTLASS, 100)
    assert quoted in why and "format to one of them" in why


def test_cutlass_packs_four_scales_per_int32_so_k_must_be_a_multiple_of_64():
    """``NVFP4CutlassFusedMoEMethod.create_weights`` (@a98a9061) allocates ``hidden_size //
    scaling_vector_size // block_scales_vec_size`` int32 words (``block_scales_vec_size = 32 // 8 =
    4``) and its ``load_expert_w3_w1_weight_scale_nvfp4`` does ``w3_weight_scale.view(int32)``: with
    H = 160 (10 float8 scales per row) the view of refitd's ``[I, 10]`` scale raises, so the reload
    would fail inside the engine. The attach refuses it on CUTLASS, naming 64; TRTLLM-Gen (one float8
    per scale, ``block_scales_vec_size = 1``) needs only 16."""
    sizes = {**SIZES, "hidden": 160}
    cfg = make_hf_config(MODEL, **sizes)
    published = convert(make_state_dict(MODEL, seed=0, **sizes), RefitSpec(model_type=MODEL, fmt="nvfp4"))
    moe = "model.layers.0.mlp.experts"
    carried = {
        f"{moe}.{e}.{p}.input_scale": torch.tensor(0.5)
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    experts = CutlassFusedMoE(E, 160, INTER)
    assert experts.w3_w1_weight_scale.shape[-1] == 2  # 160 // 16 // 4: 8 scales' room for 10
    with pytest.raises(RuntimeError):
        load_weights(experts, engine_weights({**published, **carried}, moe))
    params = [(f"{moe}.{n}", t) for n, t in nvfp4_cutlass_params(E, 160, INTER).items()]
    cutlass = build_manifest(params, cfg, moe_backend=MoeBackend.CUTLASS, sm=100, input_scales=True)
    (problem,) = check_trtllm_constraints(cutlass, cfg)
    assert "hidden_size = 160 to be a multiple of 64" in problem and "CutlassFusedMoE" in problem
    gen = build_manifest(params, cfg, moe_backend=MoeBackend.TRTLLM_GEN, sm=100, input_scales=True)
    assert check_trtllm_constraints(gen, cfg) == []
    # down_proj's K after the TP split: 128 / 4 = 32 is a multiple of 16, not of 64
    wide = make_hf_config(MODEL, **{**SIZES, "intermediate": 128})
    params = [(f"{moe}.{n}", t) for n, t in nvfp4_cutlass_params(E, HID, 32).items()]
    tp4 = build_manifest(params, wide, moe_backend=MoeBackend.CUTLASS, sm=100, tp_size=4, input_scales=True)
    (problem,) = check_trtllm_constraints(tp4, wide)
    assert "moe_intermediate_size / tp = 128/4 to be a multiple of 64" in problem
