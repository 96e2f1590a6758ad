"""vLLM 0.33.0's REAL model classes load refitd's generations on CPU (``make test-engines``).

Each engine is built as vLLM builds it (``tests/support/vllm_models.py``): a tiny ``config.json`` written
by transformers' own config class (``Qwen3MoeConfig``, ``Qwen3_5MoeConfig``, ``DeepseekV3Config``),
``ModelConfig(hf_overrides=<vllm_engine_args' quantization_config>, skip_tokenizer_init=True,
enforce_eager=True)`` -> ``VllmConfig(device_config=DeviceConfig("cpu"), load_config=LoadConfig("dummy"))``
-> gloo world and ``initialize_model_parallel`` -> ``model_loader.utils.initialize_model`` under the
loader's default dtype, then vLLM's own ``process_weights_after_loading``. The generations are made by
refitd itself (``sidecar.plan.run.convert`` of a synthetic BF16 state dict with the checkpoint's
names, planned against the engine's manifest as the daemon plans), in block-FP8, MXFP8, per-tensor
FP8 and BF16.

**What is faked**: only what vLLM cannot choose without a GPU, and no kernel ever runs: the MoE kernel
backend choice (``quantization/fp8.py select_fp8_moe_backend`` and
``unquantized_fused_moe_method.select_unquantized_moe_backend`` answer TRITON, the layout Hopper
uses), Qwen3.5's CPU-only ``causal_conv1d_weight_pack`` (a no-op), and the ``torchvision::nms``
schema defined before torchvision imports (its CUDA ops cannot load against the CPU torch). The
worker object is a namespace holding the real model, drafter and configs (vLLM's ``Worker`` needs a
GPU to construct); its cache resets count calls.

Checks, per model and format: attach with the manifest built from the real parameters
(``RefitWorkerExtension.refit_manifest`` and the daemon's ``check_manifest``); byte equality of every
engine parameter after the real ``load_weights`` (against the generation, packed as vLLM packs);
two generations through ``adapters.vllm.load_generation`` (layerwise reload and the real
``process_weights_after_loading``) leave every parameter object in place and byte-equal to what
vLLM's own first load + processing makes of the same generation; the MTP drafter reloads too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.engines import missing

import adapters.vllm as av
from sidecar.numerics.formats import FP8_DTYPE, Format
from sidecar.plan.attach import check_manifest
from sidecar.plan.build import RefitSpec
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.plan.run import convert

pytestmark = pytest.mark.engine

MODELS = ("qwen3_moe", "qwen3_5_moe", "deepseek_v3")
FORMATS = ("block_fp8", "mxfp8", "fp8_per_tensor", "bf16")
HAS_MTP = {"qwen3_5_moe", "deepseek_v3"}
#: formats the engines are built with their MTP drafter in
MTP_FORMATS = FORMATS


@pytest.fixture(scope="module")
def vm():
    """tests/support/vllm_models with vLLM imported (a skip naming ``make test-engines`` without it;
    a failure under REFITD_REQUIRE_ENGINES=1)."""
    try:
        from support import vllm_models

        vllm_models.import_vllm()
        from vllm.model_executor.model_loader.utils import initialize_model  # noqa: F401
    except ImportError as exc:
        missing(
            "vLLM's model classes do not import",
            "needs vLLM 0.33.0 in .venv-engines: run `make test-engines`",
            exc,
        )
    return vllm_models


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-models")


class Engine:
    """One built engine: its config, the processed model (and drafter), the worker namespace."""

    def __init__(self, vm, root: Path, model_type: str, fmt: str):
        self.vm, self.model_type, self.fmt = vm, model_type, Format.parse(fmt)
        self.folder = vm.write_config(root, model_type)
        self.hf = vm.config_dict(self.folder)
        #: the daemon's view of config.json (field names as refitd's registry reads them)
        self.plan_hf = normalize_hf_config(self.hf)
        self.layers = get_model(model_type_of(self.hf)).num_hidden_layers(self.hf)
        self.spec = RefitSpec(model_type=model_type, fmt=fmt, num_hidden_layers=self.layers)
        self.args = av.vllm_engine_args(self.spec, self.hf, include_vision=False)
        self.mtp = model_type in HAS_MTP and fmt in MTP_FORMATS
        self.config = vm.vllm_config(self.folder, self.args, mtp=self.mtp)
        vm.init_distributed(self.config)
        self.model = self.fresh(processed=True)
        self.draft = self.fresh(processed=True, draft=True) if self.mtp else None
        self.worker = vm.worker(self.config, self.model, self.draft)

    def fresh(self, *, processed: bool, draft: bool = False) -> torch.nn.Module:
        model = self.vm.build_model(self.config, draft=draft)
        if processed:
            with torch.no_grad():
                for p in model.parameters():  # what load_format="dummy" does: any values
                    p.data.copy_(torch.zeros_like(p.data))
            self.vm.process(self.config, model, draft=draft)
        return model

    def manifest(self):
        return av.RefitWorkerExtension.refit_manifest(self.worker)

    def generation(self, seed: int) -> dict[str, torch.Tensor]:
        """What the daemon publishes for a synthetic trainer state dict (checkpoint names, BF16;
        the router bias FP32), planned against this engine's manifest."""
        model = get_model(model_type_of(self.hf))
        params = model.parameters(self.plan_hf, include_mtp=True, include_vision=False)
        g = torch.Generator().manual_seed(seed)
        state = {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in params}
        for n in state:  # DeepSeek's MTP layer holds a copy of the embedding (vLLM loads both into one)
            if n.endswith(".embed_tokens.weight") and n.startswith("model.layers."):
                state[n] = state["model.embed_tokens.weight"]
        check = check_manifest([(n, s, d) for n, s, d in params], self.spec, self.manifest())
        assert check.ok, check.message("test")
        return convert(state, self.spec, keep_bf16=check.keep_bf16)


_ENGINES: dict[tuple[str, str], Engine] = {}


@pytest.fixture
def engine(vm, root, request) -> Engine:
    key = request.param
    if key not in _ENGINES:
        _ENGINES[key] = Engine(vm, root, *key)
    return _ENGINES[key]


CASES = [(m, f) for m in MODELS for f in FORMATS]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _kv_scale(name: str) -> bool:
    """Attention KV-cache scales: engine state no checkpoint (and no refit) carries."""
    return name.rpartition(".")[2] in ("q_scale", "k_scale", "v_scale", "prob_scale")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


# --------------------------------------------------------------------------------------------------
# what each engine parameter must hold after load_weights: the generation packed as vLLM packs


PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}


def _ckpt(name: str) -> str:
    for eng, ck in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(eng):
            return ck + name[len(eng) :]
    return name


def expected(name: str, param: torch.Tensor, gen: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The load-time value of engine parameter ``name`` at tp 1 (None: not loaded from a checkpoint)."""
    name = _ckpt(name.replace(".routed_experts.", "."))
    module, _, leaf = name.rpartition(".")
    if _kv_scale(name):
        return None
    head, sep, tail = name.rpartition(".mlp.experts.")
    if sep and tail.startswith(("w13_", "w2_")):
        moe = head + ".mlp.experts"
        w, _, leaf = tail.partition("_")
        e = param.shape[0]
        if f"{moe}.gate_up_proj" in gen:  # BF16 slabs (Qwen3.5)
            return gen[f"{moe}.gate_up_proj" if w == "w13" else f"{moe}.down_proj"]
        projs = ("gate_proj", "up_proj") if w == "w13" else ("down_proj",)
        per = [[gen[f"{moe}.{x}.{p}.{leaf}"] for p in projs] for x in range(e)]
        if leaf == "weight_scale" and param.dtype == torch.float32:  # per-tensor: [E, 2] / [E]
            return torch.stack([torch.stack([s.reshape(()) for s in row]) for row in per]).reshape(
                param.shape
            )
        return torch.stack([torch.cat(row) for row in per])
    parent, _, proj = module.rpartition(".")
    if proj in PACKED:
        return torch.cat([gen[f"{parent}.{s}.{leaf}"] for s in PACKED[proj]])
    return gen[name]


def _check_load_time(model: torch.nn.Module, gen: dict[str, torch.Tensor]) -> int:
    checked, wrong = 0, []
    for name, p in model.named_parameters():
        want = expected(name, p, gen)
        if want is None:
            continue
        if p.dtype != want.dtype and p.dtype == torch.float32:  # vLLM upcasts on copy (A_log)
            want = want.to(torch.float32)
        if not _same(p, want):
            wrong.append(
                f"{name}: engine {p.dtype} {tuple(p.shape)}, generation {want.dtype} {tuple(want.shape)}"
            )
        checked += 1
    assert not wrong, "\n".join(wrong)
    return checked


# --------------------------------------------------------------------------------------------------
# the checks


@pytest.mark.parametrize("engine", CASES, indirect=True, ids=[f"{m}-{f}" for m, f in CASES])
def test_attach_with_the_manifest_of_the_real_parameters(engine):
    manifest = engine.manifest()
    assert manifest.expert_format is engine.fmt
    assert manifest.info["param_source"] == av.PARAM_SOURCE_LAYERWISE
    assert av.check_vllm_constraints(manifest, engine.hf) == []
    model = get_model(model_type_of(engine.hf))
    params = model.parameters(engine.plan_hf, include_mtp=True, include_vision=False)
    check = check_manifest(params, engine.spec, manifest)
    assert check.ok, check.message("vllm")
    names = {t.name for t in manifest.tensors}
    if engine.mtp:  # finding 7: the drafter's tensors are checked at attach too
        mtp = "mtp." if engine.model_type == "qwen3_5_moe" else f"model.layers.{engine.layers}."
        assert any(n.startswith(mtp) and ".mlp.experts." in n for n in names), sorted(names)[-5:]
    if engine.model_type == "deepseek_v3":  # finding 3: the FP32 router bias is checked
        bias = [t for t in manifest.tensors if t.name.endswith("e_score_correction_bias")]
        assert bias and all(t.dtype == torch.float32 for t in bias)
    if engine.model_type == "qwen3_5_moe":  # finding 4: A_log as the checkpoint sends it
        a_log = [t for t in manifest.tensors if t.name.endswith("A_log")]
        assert a_log and all(t.dtype == torch.bfloat16 for t in a_log)
        assert not any(n.startswith("model.visual.") for n in names)  # finding 5


@pytest.mark.parametrize("engine", CASES, indirect=True, ids=[f"{m}-{f}" for m, f in CASES])
def test_real_load_weights_takes_the_generation_byte_for_byte(engine):
    gen = engine.generation(seed=1)
    model = engine.fresh(processed=False)
    model.load_weights(av.ordered_weights(gen))
    checked = _check_load_time(model, gen)
    assert checked >= len(list(model.parameters())) // 2
    if engine.fmt.quantized:
        assert any(p.dtype == FP8_DTYPE for p in model.parameters())


@pytest.mark.parametrize("engine", CASES, indirect=True, ids=[f"{m}-{f}" for m, f in CASES])
def test_two_generations_reload_in_place_as_vllms_own_first_load(engine):
    model = engine.model
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    for seed in (2, 3):
        gen = engine.generation(seed)
        av.load_generation(engine.worker, gen, engine.fmt)
        after = dict(model.named_parameters())
        assert after.keys() == before.keys()
        moved = [n for n, (p, ptr) in before.items() if after[n] is not p or after[n].data_ptr() != ptr]
        assert not moved, f"parameters replaced by the reload: {moved[:5]}"
        reference = engine.fresh(processed=False)
        reference.load_weights(av.ordered_weights(gen))
        engine.vm.process(engine.config, reference)
        ref = dict(reference.named_parameters())
        differ = [n for n, p in after.items() if not _kv_scale(n) and not _same(p, ref[n])]
        assert not differ, f"the reload differs from vLLM's own load of the same generation: {differ[:5]}"
    resets = engine.worker.model_runner.resets
    assert resets["encoder"] >= 2 and resets["mm"] >= 2  # finding 5: as vLLM's reload_weights


@pytest.mark.parametrize(
    "engine",
    [(m, f) for m in sorted(HAS_MTP) for f in MTP_FORMATS],
    indirect=True,
    ids=[f"{m}-{f}" for m in sorted(HAS_MTP) for f in MTP_FORMATS],
)
def test_the_mtp_drafter_is_refitted(engine):
    """Finding 7: load_generation reloads get_draft_model() too (vLLM's start_draft_weight_update
    path: layerwise reload of the drafter with the draft model config)."""
    draft = engine.draft
    before = {n: p for n, p in draft.named_parameters()}
    gen = engine.generation(seed=4)
    av.load_generation(engine.worker, gen, engine.fmt)
    reference = engine.fresh(processed=False, draft=True)
    reference.load_weights(av.ordered_weights(gen))
    engine.vm.process(engine.config, reference, draft=True)
    ref = dict(reference.named_parameters())
    after = dict(draft.named_parameters())
    assert all(after[n] is p for n, p in before.items())
    differ = [n for n, p in after.items() if not _kv_scale(n) and not _same(p, ref[n])]
    assert not differ, differ[:5]
    assert any(not torch.equal(_bytes(p), torch.zeros_like(_bytes(p))) for p in after.values())


STREAMED_MTP = [("qwen3_5_moe", "block_fp8"), ("deepseek_v3", "bf16")]


@pytest.mark.parametrize("engine", STREAMED_MTP, indirect=True, ids=[f"{m}-{f}" for m, f in STREAMED_MTP])
def test_a_worker_with_an_mtp_drafter_streams_and_ends_each_step_as_vllms_own_load(engine):
    """Streamed refit of a worker with its MTP drafter (Qwen3.5's ``mtp.*``, DeepSeek's
    ``model.layers.{N}.*``): the daemon's layer groups go through adapters.stream into the target's
    layerwise session, and when the step is published the drafter is reloaded from the whole
    generation before it is acknowledged; the target and the drafter then equal vLLM's own load +
    processing of that generation, every parameter in place, and the runner's caches were reset."""
    from support.vllm_models import StreamedSteps, stream_groups

    model = get_model(model_type_of(engine.hf))
    params = list(model.parameters(engine.plan_hf, include_mtp=True, include_vision=False))
    check = check_manifest(params, engine.spec, engine.manifest())
    groups = stream_groups(params, engine.spec, keep_bf16=check.keep_bf16)
    steps = StreamedSteps(engine.worker, groups)
    before = {n: p for n, p in engine.draft.named_parameters()}
    resets = dict(engine.worker.model_runner.resets)
    live = (5, engine.generation(5))
    for step in (6, 7):
        gen = engine.generation(step)
        result = steps.step(live, step, gen)
        assert result.ok and not result.rolled_back and steps.acks[-1] == (step, True, None), result
        for draft in (False, True):
            reference = engine.fresh(processed=False, draft=draft)
            reference.load_weights(av.ordered_weights(gen))
            engine.vm.process(engine.config, reference, draft=draft)
            ref = dict(reference.named_parameters())
            after = dict((engine.draft if draft else engine.model).named_parameters())
            differ = [n for n, p in after.items() if not _kv_scale(n) and not _same(p, ref[n])]
            assert not differ, (
                f"{'drafter' if draft else 'target'} differs from vLLM's own load: {differ[:5]}"
            )
        assert all(engine.draft.get_parameter(n) is p for n, p in before.items())
        live = (step, gen)
    # and as vLLM's reload_weights (and load_generation), each step reset the runner's caches
    assert engine.worker.model_runner.resets == {k: n + 2 for k, n in resets.items()}


TP2_MODELS = ("qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("model_type", TP2_MODELS)
def test_tp2_block_fp8_with_i_128_loads_refined_in_two_gloo_ranks(vm, root, model_type):
    """Finding 6 for real: I = 128 at tensor_parallel_size 2 (I/tp = 64, not a multiple of 128), on
    Qwen3-MoE and DeepSeek-V3 (MLA heads split too). vLLM 0.33.0 refines the 128-block to 64 and upsamples the scales at load; two gloo
    processes build the real model, attach (no refusal), load refitd's generation with every rank's
    slice of every expert weight and scale where vLLM's sharding puts it, and reload two generations
    in place, each byte-equal to vLLM's own first load + processing on that rank."""
    from support.vllm_tp import run_ranks

    folder = vm.write_config(root, model_type, moe_intermediate_size=128)
    for result in run_ranks(folder, "block_fp8", root):
        assert "error" not in result, result.get("trace")
        assert result["moe_tp_size"] == 2 and result["constraints"] == []
        w13 = {tuple(v) for n, v in result["scale_shapes"].items() if "experts.routed_experts.w13" in n}
        assert w13 == {(4, 2, 4)}  # the 128-block refined to 64: [E, 2 * 64/64, 256/64]
        assert result["expert_slices_wrong"] == []
        for reload in result["reloads"]:
            assert reload["moved"] == [] and reload["differ"] == [] and reload["compared"] > 0
