"""The vLLM adapter: a manifest from vLLM's parameters, the ``LLM(...)`` arguments, and a worker extension.

Three parts, and only the last one imports vLLM (inside its functions, so ``import adapters.vllm``
works on a machine without vLLM):

1. :func:`build_manifest` (pure): vLLM's load-time parameters ``(name, dtype, shape)``, the model's
   Hugging Face config and the quantization config in force -> the :class:`Manifest` of checkpoint
   tensors the engine's loader expects. It inverts what vLLM's loader does with checkpoint names:
   ``experts.w13_* <- experts.{e}.gate_proj (shard w1) + experts.{e}.up_proj (shard w3)``,
   ``experts.w2_* <- experts.{e}.down_proj``, packed linears (``qkv_proj <- q/k/v_proj``,
   ``gate_up_proj <- gate/up_proj``, Qwen3.5's ``in_proj_qkvz <- in_proj_qkv/z`` and
   ``in_proj_ba <- in_proj_b/a``), and the Qwen3.5 ``hf_to_vllm_mapper`` prefixes. Shapes are the
   GLOBAL checkpoint shapes whatever the tensor/expert parallelism (vLLM's loader slices), so every
   worker of one engine sends the same tensor list. :func:`check_vllm_constraints` lists what vLLM's
   MoE kernels cannot take.
2. :func:`vllm_engine_args` (pure): the one place the engine's quantization is decided. It returns
   the ``LLM(...)`` keyword arguments whose quantization config keeps in BF16 exactly what the refit
   plan keeps in BF16, and :data:`VLLM_ENV` holds the environment that keeps FP32 block scales.
3. :class:`RefitWorkerExtension` and :func:`refit_engine`: the engine-touching surface, driven by
   ``llm.collective_rpc``. Loading goes through vLLM's own loader (layerwise reload), never by
   writing kernel layouts.

Facts taken from vLLM's source (stored copies of vllm-project/vllm; commit of the copy read):

* ``models/qwen3_moe.py`` @2e0831b: packed ``qkv_proj <- q/k/v_proj``; router ``mlp.gate`` is a
  ``ReplicatedLinear`` built WITH the quant config (so Fp8Config quantizes it unless ignored);
  experts through ``make_expert_params_mapping(gate_proj, down_proj, up_proj)``.
* ``models/qwen3_5.py`` @00def4f and ``models/qwen3_next.py`` @6365b38: Qwen3.5 MoE packs
  ``in_proj_qkvz <- in_proj_qkv, in_proj_z`` and ``in_proj_ba <- in_proj_b, in_proj_a``; full
  attention ``qkv_proj`` carries the output gate; ``mlp.gate`` (quantized unless ignored),
  ``mlp.shared_expert_gate`` (never quantized), ``mlp.shared_expert.gate_up_proj/down_proj``; MTP
  names (``mtp.``) are skipped by the main model's loader; grouped slabs ``experts.gate_up_proj`` /
  ``experts.down_proj`` load through a fused mapping that, once one slab was seen in a
  ``load_weights`` call, stays in force for the rest of the call (per-expert names after it are
  skipped with a warning): :func:`ordered_weights` sends slabs last.
* ``models/qwen3_vl.py`` (``Qwen3VLForConditionalGeneration.hf_to_vllm_mapper``):
  ``model.language_model. -> language_model.model.``, ``model.visual. -> visual.``,
  ``lm_head. -> language_model.lm_head.``.
* ``layers/fused_moe`` ``make_expert_params_mapping``: params ``experts.[routed_experts.][base_layer.]
  w13_`` / ``w2_``, weight names ``experts.{e}.{gate|up|down}_proj.``, shards w1/w3/w2 (the
  ``routed_experts`` infix is in the newer ``RoutedExperts`` copy; older copies have none).
* ``layers/quantization/fp8.py`` @1436674: ``Fp8Config.from_config`` reads ``quant_method``,
  ``activation_scheme``, ``ignored_layers`` (else ``modules_to_not_convert``), ``weight_block_size``;
  block quantization needs ``activation_scheme == "dynamic"``; ``apply_vllm_mapper`` maps
  ``ignored_layers`` through the model's ``hf_to_vllm_mapper``. ``Fp8MoEMethod.create_weights``:
  ``w13_weight [E, 2I/tp, H]``, ``w2_weight [E, H, I/tp]``, block scales
  ``w13_weight_scale_inv [E, 2*ceil(I/tp/128), ceil(H/128)]``, ``w2_weight_scale_inv
  [E, ceil(H/128), ceil(I/tp/128)]``; per-tensor ``w13_weight_scale [E, 2]``, ``w2_weight_scale
  [E]``; static activations add ``w13_input_scale`` / ``w2_input_scale``; block quantization raises
  unless ``(I/tp) % 128 == 0``.
* ``layers/quantization/utils/quant_utils.py`` @4de0dd6 ``is_layer_skipped``: exact membership of
  the module name (no wildcards); a packed module is skipped when all its shards are listed (some but
  not all is an error); an experts module is skipped when an ignored name containing ``experts``
  contains its name.
* ``layers/quantization/modelopt.py`` (@c9a5990 and a newer stored copy): ModelOpt configs read
  ``quant_algo`` and ``ignore`` (``quantization.exclude_modules`` in the legacy file), matched exactly,
  by substring and by ``fnmatch``; ``ModelOptMxFp8Config.get_name() == "modelopt_mxfp8"``; the MXFP8
  MoE holds ``w13_weight_scale`` uint8 ``[E, 2I, H/32]`` and ``w2_weight_scale [E, H, I/32]``.
* ``model_executor/model_loader/reload/layerwise.py`` @fc26ee2 and ``reload/__init__.py`` @ceb32e7:
  ``record_metadata_for_reloading(model)``, ``initialize_layerwise_reload(model)``,
  ``finalize_layerwise_reload(model, model_config)``; per-module ``restore_metadata`` keeps the
  load-time parameters as meta tensors. vLLM's own worker runs ``initialize_layerwise_reload`` ->
  ``model.load_weights`` -> ``finalize_layerwise_reload`` under ``torch.device(self.device)``;
  ``GPUModelRunner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` wraps it.
* vLLM 0.33.0 (the wheel; ``make test-engines`` runs this module against it): ``reload/layerwise.py``
  exports ``get_layerwise_info(module)`` (its ``restore_metadata`` are the load-time parameters);
  ``v1/worker/gpu_worker.py`` ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
  and ``reload_weights`` run under ``with set_current_vllm_config(self.vllm_config)``, and
  ``config/vllm.py`` ``get_current_vllm_config()`` raises outside it (PR #31747); workers reach the
  model through ``model_runner.get_model()``; MoE parameters live on ``mlp.experts.routed_experts``
  (``MoERunner.routed_experts``); ``utils/deep_gemm.py`` ``is_deep_gemm_e8m0_used()`` is True on any
  DeepGEMM-capable GPU (Hopper or Blackwell) unless ``VLLM_USE_DEEP_GEMM_E8M0=0``.
* ``vllm/envs.py``: ``VLLM_USE_DEEP_GEMM_E8M0`` (default 1: "use E8M0 scaling when DeepGEMM is used
  on Blackwell GPUs"), ``VLLM_USE_DEEP_GEMM``, ``VLLM_MOE_USE_DEEP_GEMM``.
* ``vllm/config/parallel.py``: ``worker_extension_cls`` is "dynamically inherited by the worker
  class ... for use in collective_rpc calls"; ``vllm/engine/arg_utils.py``: ``quantization``,
  ``hf_overrides``, ``load_format``, ``dtype``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from adapters.manifest import EngineConstraints, EngineKind, Manifest, ManifestTensor
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.formats import BLOCK, FP8_DTYPE, Format
from sidecar.plan.build import RefitPlan, RefitSpec
from sidecar.plan.models import get_model, model_type_of
from transport.wire import dtype_from_name

__all__ = [
    "VLLM_ENV",
    "WORKER_EXTENSION",
    "RefitWorkerExtension",
    "VllmQuant",
    "bf16_modules",
    "build_manifest",
    "check_vllm_constraints",
    "engine_parameters",
    "engine_parameters_and_source",
    "fallback_note",
    "load_generation",
    "ordered_weights",
    "refit_engine",
    "resolve_quant",
    "routed_bf16_modules",
    "vllm_engine_args",
]

log = logging.getLogger(__name__)

WORKER_EXTENSION = "adapters.vllm.RefitWorkerExtension"
#: environment for every vLLM process (set before the engine starts): DeepGEMM on Blackwell would
#: otherwise requantize block scales to UE8M0 powers of two, losing the FP32 scales refitd publishes
VLLM_ENV: Mapping[str, str] = {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
#: vLLM's packed modules -> their checkpoint shards (models' ``packed_modules_mapping``)
PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
#: Qwen3.5's ``hf_to_vllm_mapper`` inverted: engine prefix -> checkpoint prefix (first match wins)
ENGINE_TO_CHECKPOINT = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("visual.", "model.visual."),
)
#: attention KV-cache scales: engine parameters no refit publishes
KV_SCALE_LEAVES = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale"})
EXPERT_PROJS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
SCALE_LEAVES = ("weight_scale_inv", "weight_scale", "input_scale")
MXFP8_ALIGN = 32  # vLLM ModelOpt MXFP8 MoE: H and I/tp multiples of 32
BLOCK_FP8_ALIGN = BLOCK  # vLLM Fp8MoEMethod: I/tp a multiple of block_n = 128


# --------------------------------------------------------------------------------------------------
# the quantization config in force


@dataclass(frozen=True, slots=True)
class VllmQuant:
    """The quantization vLLM applies: the routed experts' format and the modules it leaves alone."""

    fmt: Format
    method: str | None  # "fp8", "modelopt" or None (unquantized)
    ignored: tuple[str, ...] = ()
    static_activations: bool = False


def resolve_quant(quant_config: Any) -> VllmQuant:
    """The expert format of a quantization config: a ``quantization_config`` dict, a vLLM
    ``QuantizationConfig`` object (dispatched on its resolved class) or None (BF16)."""
    if quant_config is None or (isinstance(quant_config, Mapping) and not quant_config):
        return VllmQuant(Format.BF16, None)
    if isinstance(quant_config, Mapping):
        return _quant_from_dict(quant_config)
    kind = type(quant_config).__name__
    if kind == "Fp8Config":
        return _fp8(
            getattr(quant_config, "weight_block_size", None),
            getattr(quant_config, "ignored_layers", None) or (),
            getattr(quant_config, "activation_scheme", "dynamic"),
        )
    if kind == "ModelOptMxFp8Config":
        return VllmQuant(Format.MXFP8, "modelopt", tuple(getattr(quant_config, "exclude_modules", ()) or ()))
    raise ValueError(
        f"vLLM resolved quantization {kind}; refitd publishes Fp8Config (block-FP8 or per-tensor FP8), "
        "ModelOpt MXFP8 or unquantized experts: start the engine with vllm_engine_args()"
    )


def _quant_from_dict(cfg: Mapping[str, Any]) -> VllmQuant:
    method = str(cfg.get("quant_method", "")).lower()
    if method == "fp8":
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ()
        return _fp8(cfg.get("weight_block_size"), ignored, cfg.get("activation_scheme", "dynamic"))
    if method == "modelopt":
        inner = cfg.get("quantization") if isinstance(cfg.get("quantization"), Mapping) else cfg
        algo = str(inner.get("quant_algo", "")).upper()
        if algo != "MXFP8":
            raise ValueError(f"ModelOpt quant_algo {algo!r}: refitd publishes MXFP8 only for ModelOpt")
        return VllmQuant(
            Format.MXFP8, "modelopt", tuple(inner.get("ignore", inner.get("exclude_modules", ())))
        )
    raise ValueError(
        f"quantization_config quant_method {method!r}: refitd's vLLM adapter knows fp8 and modelopt"
    )


def _fp8(block: Any, ignored: Iterable[str], activation_scheme: str) -> VllmQuant:
    static = str(activation_scheme).lower() == "static"
    if block is None:
        return VllmQuant(Format.FP8_PER_TENSOR, "fp8", tuple(ignored), static)
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"weight_block_size {list(block)}: refitd publishes {BLOCK}x{BLOCK} blocks only")
    return VllmQuant(Format.BLOCK_FP8, "fp8", tuple(ignored), static)


# --------------------------------------------------------------------------------------------------
# engine parameters -> checkpoint tensors


def _checkpoint_name(engine_name: str) -> str:
    name = engine_name.replace(".base_layer.", ".")
    for engine_prefix, ckpt_prefix in ENGINE_TO_CHECKPOINT:
        if name.startswith(engine_prefix):
            return ckpt_prefix + name[len(engine_prefix) :]
    return name


def _dtype(value: torch.dtype | str) -> torch.dtype:
    return value if isinstance(value, torch.dtype) else dtype_from_name(str(value).removeprefix("torch."))


def _scale_shape(leaf: str, dtype: torch.dtype, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    if leaf == "weight_scale_inv":
        return Format.BLOCK_FP8.scale_shape(weight_shape)
    if leaf == "weight_scale" and dtype == torch.uint8:
        return Format.MXFP8.scale_shape(weight_shape)
    return ()  # per-tensor weight_scale, input_scale


class _Builder:
    """Collects manifest tensors, the BF16-held routed experts, and every problem found."""

    def __init__(self, ckpt: Mapping[str, tuple[int, ...]]) -> None:
        self.ckpt = ckpt
        self.tensors: dict[str, ManifestTensor] = {}
        self.keep_bf16: list[str] = []
        self.problems: list[str] = []

    def add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        have = self.tensors.get(name)
        if have is not None and (have.dtype, have.shape) != (dtype, shape):
            self.problems.append(f"{name}: two engine parameters expect it as {have.dtype} and {dtype}")
        self.tensors.setdefault(name, ManifestTensor(name, dtype, shape))

    def dense(self, engine_name: str, dtype: torch.dtype, tied: bool) -> None:
        name = _checkpoint_name(engine_name)
        module, _, leaf = name.rpartition(".")
        if leaf in KV_SCALE_LEAVES:
            return
        if name == "lm_head.weight" and tied:
            return
        parent, _, proj = module.rpartition(".")
        shards = [module]
        if proj in PACKED_MODULES:
            shards = [f"{parent}.{s}" for s in PACKED_MODULES[proj] if f"{parent}.{s}.weight" in self.ckpt]
        for shard in shards:
            target, weight = f"{shard}.{leaf}", self.ckpt.get(f"{shard}.weight")
            if target in self.ckpt:
                self.add(target, dtype, self.ckpt[target])
            elif leaf in SCALE_LEAVES and weight is not None:
                self.add(target, dtype, _scale_shape(leaf, dtype, weight))
            else:
                self.problems.append(f"{engine_name}: no checkpoint tensor {target} maps to it")
        if not shards:
            self.problems.append(f"{engine_name}: none of its packed shards is in the checkpoint")

    def experts(
        self, moe: str, params: Mapping[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]], **dims: Any
    ) -> None:
        """One MoE layer's ``w13_*`` / ``w2_*`` parameters -> per-expert checkpoint tensors."""
        w13, w2 = params.get(("w13", "weight")), params.get(("w2", "weight"))
        if w13 is None or w2 is None or len(w13[1]) != 3 or len(w2[1]) != 3:
            self.problems.append(f"{moe}: expected 3-D w13_weight and w2_weight, got {w13} / {w2}")
            return
        ckpt_moe = _checkpoint_name(moe)
        e, i, h = self._expert_dims(ckpt_moe, w13[1], w2[1], **dims)
        if w13[0] != FP8_DTYPE:  # held unquantized: the checkpoint form the loader takes
            slab = f"{ckpt_moe}.gate_up_proj"
            if slab in self.ckpt:
                self.add(slab, w13[0], (e, 2 * i, h))
                self.add(f"{ckpt_moe}.down_proj", w2[0], (e, h, i))
                self.keep_bf16 += [slab, f"{ckpt_moe}.down_proj"]
                return
        for x in range(e):
            for w, projs in EXPERT_PROJS.items():
                shape = (i, h) if w == "w13" else (h, i)
                dtype = params[(w, "weight")][0]
                for proj in projs:
                    module = f"{ckpt_moe}.{x}.{proj}"
                    self.add(f"{module}.weight", dtype, shape)
                    if dtype != FP8_DTYPE:
                        self.keep_bf16.append(module)
                        continue
                    for leaf in SCALE_LEAVES:
                        if (w, leaf) in params:
                            sdtype = params[(w, leaf)][0]
                            self.add(f"{module}.{leaf}", sdtype, _scale_shape(leaf, sdtype, shape))

    def _expert_dims(
        self,
        ckpt_moe: str,
        w13_shape: tuple[int, ...],
        w2_shape: tuple[int, ...],
        *,
        moe_tp: int,
        ep: int,
        num_experts: int | None,
    ) -> tuple[int, int, int]:
        (e_loc, two_i, h), (e2, h2, i_loc) = w13_shape, w2_shape
        e, i = num_experts or e_loc * ep, i_loc * moe_tp
        if two_i != 2 * i_loc or e2 != e_loc or h2 != h or e_loc * ep < e:
            self.problems.append(f"{ckpt_moe}: w13 {w13_shape} and w2 {w2_shape} disagree (ep={ep})")
        gate = self.ckpt.get(f"{ckpt_moe}.0.gate_proj.weight")
        slab = self.ckpt.get(f"{ckpt_moe}.gate_up_proj")
        want = gate if gate is not None else (slab[1] // 2, slab[2]) if slab is not None else None
        if want is None:
            self.problems.append(f"{ckpt_moe}: the checkpoint has no routed experts here")
        elif (i, h) != tuple(want):
            # a backend may round H or I/tp up; the loader narrows, the checkpoint keeps its own shape
            if i < want[0] or h < want[1]:
                self.problems.append(
                    f"{ckpt_moe}: the engine holds I={i}, H={h}; the checkpoint has {tuple(want)}"
                )
            i, h = want
        return e, i, h


def build_manifest(
    params: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    hf_config: Mapping[str, Any],
    quant_config: Any,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    engine_version: str = "",
    moe_backend: str = "",
    param_source: str = "",
    deep_gemm_e8m0: bool | None = None,
) -> Manifest:
    """The manifest of a vLLM model from its load-time parameters ``(name, dtype, shape)``.

    ``param_source`` says where the parameter list came from (:func:`engine_parameters_and_source`);
    ``deep_gemm_e8m0`` is vLLM's ``is_deep_gemm_e8m0_used()`` in the worker (None: unknown). Both go
    to ``info``, where :func:`check_vllm_constraints` reads them.

    ``ep_size > 1`` means vLLM's expert parallelism (experts split across ranks, I not split);
    otherwise the experts are tensor-parallel (I split ``tp_size`` ways). Raises ValueError listing
    every engine parameter that maps to no checkpoint tensor and every expert shape that disagrees.
    """
    model = get_model(model_type_of(hf_config))
    text = model.text_config(hf_config)
    vision = isinstance(hf_config.get("vision_config"), Mapping)
    ckpt = {n: tuple(s) for n, s, _ in model.parameters(hf_config, include_mtp=True, include_vision=vision)}
    quant = resolve_quant(quant_config)
    tied = bool(hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    moe_tp = 1 if ep_size > 1 else tp_size
    b = _Builder(ckpt)
    experts: dict[str, dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]]] = defaultdict(dict)
    for engine_name, dtype, shape in params:
        m = _experts_match(engine_name)
        if m is not None:
            experts.setdefault(m[0], {})[(m[1], m[2])] = (_dtype(dtype), tuple(int(d) for d in shape))
        else:
            b.dense(engine_name, _dtype(dtype), tied)
    for moe, group in experts.items():
        b.experts(moe, group, moe_tp=moe_tp, ep=ep_size, num_experts=text.get("num_experts"))
    if b.problems:
        raise ValueError("cannot map vLLM's parameters to checkpoint tensors:\n  " + "\n  ".join(b.problems))
    return Manifest(
        engine=EngineKind.VLLM,
        engine_version=engine_version,
        moe_backend=moe_backend or _default_backend(quant),
        expert_format=quant.fmt,
        tensors=tuple(b.tensors.values()),
        constraints=EngineConstraints(
            engine=EngineKind.VLLM,
            expert_format=quant.fmt,
            hidden_size=_size(text.get("hidden_size")),
            intermediate_size=_size(text.get("moe_intermediate_size")),
            moe_tp_size=moe_tp,
            moe_ep_size=ep_size,
            block_fp8_align=BLOCK_FP8_ALIGN,
            mxfp8_align=MXFP8_ALIGN,
        ),
        info={
            "model_type": model.model_type,
            "tp_size": tp_size,
            "ep_size": ep_size,
            "moe_tp_size": moe_tp,
            "quant_method": quant.method,
            "keep_bf16": sorted(b.keep_bf16),
            "param_source": param_source,
            "deep_gemm_e8m0": deep_gemm_e8m0,
        },
    )


def _size(value: Any) -> int | None:
    return int(value) if value else None


def _experts_match(engine_name: str) -> tuple[str, str, str] | None:
    """``<moe>.[routed_experts.][base_layer.]w13_weight_scale_inv`` -> (moe, "w13", "weight_scale_inv")."""
    head, sep, tail = engine_name.rpartition(".mlp.experts.")
    if not sep:
        return None
    parts = [p for p in tail.split(".") if p not in ("routed_experts", "base_layer")]
    if len(parts) != 1 or "_" not in parts[0]:
        return None
    w, _, leaf = parts[0].partition("_")
    if w not in EXPERT_PROJS or leaf not in ("weight", *SCALE_LEAVES):
        return None
    return f"{head}.mlp.experts", w, leaf


def _default_backend(quant: VllmQuant) -> str:
    return {
        Format.BLOCK_FP8: "Fp8MoEMethod",
        Format.FP8_PER_TENSOR: "Fp8MoEMethod",
        Format.MXFP8: "ModelOptMxFp8FusedMoE",
        Format.BF16: "UnquantizedFusedMoEMethod",
    }[quant.fmt]


def routed_bf16_modules(manifest: Manifest) -> list[str]:
    """The routed-expert modules the engine holds in BF16: the plan's ``keep_bf16``."""
    return list(manifest.info.get("keep_bf16", ()))


# --------------------------------------------------------------------------------------------------
# constraints


def _moe_dims(plan_or_config: RefitPlan | Mapping[str, Any]) -> tuple[int, int]:
    """(H, I) of the routed experts, from a plan's inputs or a config.json dict."""
    if isinstance(plan_or_config, RefitPlan):
        model = plan_or_config.spec.model
        for i in plan_or_config.inputs:
            if (
                model.slab_re is not None
                and (m := model.slab_re.match(i.name))
                and m["proj"] == "gate_up_proj"
            ):
                return i.shape[2], i.shape[1] // 2
            if (m := model.per_expert_re.match(i.name)) and m["proj"] == "gate_proj":
                return i.shape[1], i.shape[0]
        raise ValueError("the plan has no routed experts")
    text = get_model(model_type_of(plan_or_config)).text_config(plan_or_config)
    return int(text["hidden_size"]), int(text["moe_intermediate_size"])


def check_vllm_constraints(
    manifest: Manifest, plan_or_config: RefitPlan | Mapping[str, Any] | None = None
) -> list[str]:
    """What vLLM's MoE kernels cannot take (SPEC §2.4), one line each naming the engine setting that
    would work; empty when all is well. ``EngineWorker.attach`` runs it before contacting the daemon.

    The alignment rules are the manifest's :class:`EngineConstraints` (the daemon runs the same
    ones); H and I come from ``plan_or_config`` when given, else from what the manifest recorded.
    """
    h, i = _moe_dims(plan_or_config) if plan_or_config is not None else (None, None)
    fmt = manifest.expert_format
    problems = manifest.constraints.problems(hidden=h, intermediate=i)
    if fmt is Format.BLOCK_FP8 and manifest.info.get("deep_gemm_e8m0") is True:
        problems.append(
            "vLLM reports is_deep_gemm_e8m0_used() = True: DeepGEMM would round the FP32 block scales refitd "
            "publishes to UE8M0 powers of two (Hopper too: the flag alone decides); start every vLLM process "
            "with VLLM_USE_DEEP_GEMM_E8M0=0 (adapters.vllm.VLLM_ENV)"
        )
    static = sorted(t.name for t in manifest.tensors if t.name.endswith(".input_scale"))
    if static:
        problems.append(
            f"the engine expects static activation scales ({len(static)} tensors, e.g. {static[0]}); "
            "refitd publishes none: set activation_scheme 'dynamic' in the quantization config "
            "(vllm_engine_args does)"
        )
    return problems


def fallback_note(manifest: Manifest) -> str:
    """What an attach refusal must add when the manifest was read from live parameters: shapes after
    ``process_weights_after_loading``, which may differ from what the loader takes."""
    if manifest.info.get("param_source") != PARAM_SOURCE_LIVE:
        return ""
    return (
        " (note: this vLLM exposes no layerwise-reload metadata (reload.layerwise.get_layerwise_info), so "
        "the manifest was read from the live, post-processing parameters and a shape mismatch may be "
        "spurious; use a vLLM with model_loader/reload, e.g. 0.33.0)"
    )


# --------------------------------------------------------------------------------------------------
# one source of truth: the engine's arguments


def bf16_modules(spec: RefitSpec, hf_config: Mapping[str, Any], *, include_vision: bool = True) -> list[str]:
    """Checkpoint module names the engine must leave unquantized so that it holds in BF16 exactly
    what the refit plan publishes in BF16: every module that is not a routed expert (attention,
    linear attention, router, shared expert and its gate, embeddings, lm_head, vision tower), plus
    the routed experts of the first/last BF16 layers and of ``ignore_patterns``, as whole
    ``…mlp.experts`` modules (vLLM keeps experts BF16 per layer, not per expert)."""
    model = get_model(model_type_of(hf_config))
    if model.model_type != spec.model.model_type:
        raise ValueError(f"the config describes {model.model_type} but the spec says {spec.model_type}")
    layers = model.num_hidden_layers(hf_config)
    spec.check_layer_counts(layers)
    out: dict[str, None] = {}
    routed: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
    vision = include_vision and isinstance(hf_config.get("vision_config"), Mapping)
    for name, _, _ in model.parameters(hf_config, include_mtp=True, include_vision=vision):
        r = model.slab_re.match(name) if model.slab_re is not None else None
        r = r or model.per_expert_re.match(name)
        if r is not None:  # EXPERT_PREFIX's group 2: a decoder layer (None for an MTP layer)
            routed[r["prefix"]].append((name.removesuffix(".weight"), int(r[2]) if r[2] else None))
        elif name.endswith(".weight") and "norm" not in name.rsplit(".", 2)[-2]:
            out.setdefault(name.removesuffix(".weight"))
    for prefix, members in routed.items():
        kept = [_kept(spec, layer, layers, module) for module, layer in members]
        if all(kept):
            out.setdefault(prefix)
        elif any(kept):
            raise ValueError(
                f"ignore_patterns {list(spec.ignore_patterns)} keep only some experts of {prefix}; vLLM "
                "holds a layer's experts all in BF16 or all quantized: widen the pattern to the layer"
            )
    return list(out)


def _kept(spec: RefitSpec, layer: int | None, layers: int, module: str) -> bool:
    if spec.format is Format.BF16:
        return True
    if layer is not None and (
        layer < spec.num_first_layers_in_bf16 or layer >= layers - spec.num_last_layers_in_bf16
    ):
        return True
    return any(fnmatch.fnmatchcase(module, p) for p in spec.ignore_patterns)


def vllm_engine_args(
    spec: RefitSpec, hf_config: Mapping[str, Any], *, include_vision: bool = True
) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments for an engine that refitd refits with ``spec``.

    Start every engine process with :data:`VLLM_ENV` in its environment too. ``load_format="dummy"``:
    the first refit fills the engine, so wait for it before serving.
    """
    ignored = bf16_modules(spec, hf_config, include_vision=include_vision)
    args: dict[str, Any] = {
        "load_format": "dummy",
        "dtype": "bfloat16",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    fmt = spec.format
    if fmt is Format.BF16:
        return {**args, "quantization": None}
    if fmt is Format.MXFP8:
        qc: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ignored}
        return {**args, "quantization": "modelopt_mxfp8", "hf_overrides": {"quantization_config": qc}}
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "ignored_layers": ignored}
    if fmt is Format.BLOCK_FP8:
        qc["weight_block_size"] = [BLOCK, BLOCK]
    return {**args, "quantization": "fp8", "hf_overrides": {"quantization_config": qc}}


# --------------------------------------------------------------------------------------------------
# the engine-touching surface (vLLM imported lazily)


def _require_vllm(what: str) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{what} runs inside vLLM's workers and needs vLLM installed (pip install vllm); the "
            "manifest and engine-argument helpers of adapters.vllm work without it"
        ) from None


#: where a manifest's parameter list came from
PARAM_SOURCE_LAYERWISE = "layerwise_metadata"
PARAM_SOURCE_LIVE = "live_parameters"


def _layerwise_metadata() -> Callable[[torch.nn.Module], Any] | None:
    """vLLM's per-module reload info getter: ``reload.layerwise.get_layerwise_info`` (public in
    layerwise's ``__all__`` since it exists), else the older module-level ``LAYERWISE_INFO`` dict."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return None
    getter = getattr(layerwise, "get_layerwise_info", None)
    if callable(getter):
        return getter
    info = getattr(layerwise, "LAYERWISE_INFO", None)
    return info.get if info is not None else None


def engine_parameters_and_source(
    model: torch.nn.Module,
) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], str]:
    """Every parameter as the loader sees it, and where that came from: the load-time metadata vLLM
    records for layerwise reload (``restore_metadata``: scales reshaped by
    ``process_weights_after_loading`` read as they load) when any module has it, else the live
    parameters (:data:`PARAM_SOURCE_LIVE`; the attach error then says so)."""
    getter = _layerwise_metadata()
    out, recorded = [], False
    for module_name, module in model.named_modules():
        meta = getattr(getter(module), "restore_metadata", None) if getter is not None else None
        if meta and meta[0]:
            own, recorded = meta[0], True
        else:
            own = dict(module.named_parameters(recurse=False))
        prefix = f"{module_name}." if module_name else ""
        out += [(prefix + n, p.dtype, tuple(p.shape)) for n, p in own.items()]
    return out, PARAM_SOURCE_LAYERWISE if recorded else PARAM_SOURCE_LIVE


def engine_parameters(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """:func:`engine_parameters_and_source` without the source."""
    return engine_parameters_and_source(model)[0]


def _config_context(worker: Any) -> contextlib.AbstractContextManager:
    """``set_current_vllm_config(worker.vllm_config)``: vLLM's own ``start_weight_update`` /
    ``update_weights`` / ``finish_weight_update`` and ``Worker.reload_weights`` run under it, and
    ``get_current_vllm_config()`` raises outside it (vLLM PR #31747)."""
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(worker.vllm_config)


def _model(worker: Any) -> torch.nn.Module:
    """The worker's model through ``model_runner.get_model()`` (what vLLM's worker uses)."""
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def _deep_gemm_e8m0() -> bool | None:
    """vLLM's ``is_deep_gemm_e8m0_used()`` (None when this vLLM has no such function)."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except ImportError:
        return None
    return bool(is_deep_gemm_e8m0_used())


def ordered_weights(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A generation in the order vLLM's loaders need: grouped slabs last (Qwen3.5's loader switches
    to its fused-expert mapping for the rest of a call once it has seen a slab)."""
    slab = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    return sorted(tensors.items(), key=lambda kv: kv[0].endswith(slab))


def load_generation(worker: Any, tensors: Mapping[str, torch.Tensor], expert_format: Format) -> None:
    """Hand a generation to vLLM's own loader; copies go host -> device from the shared views.

    Under ``set_current_vllm_config(worker.vllm_config)``, as vLLM's worker does: vLLM's layerwise
    reload (what its weight-transfer engines and ``reload_weights(is_checkpoint_format=True)`` run)
    where present, else ``model_runner.reload_weights``; a vLLM with neither can only take BF16
    (loading FP8 into already-processed kernel parameters would corrupt them).
    """
    runner, weights = worker.model_runner, ordered_weights(tensors)
    model = _model(worker)
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        pass
    else:
        with _config_context(worker), torch.device(worker.device):
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, worker.model_config)
        return
    if hasattr(runner, "reload_weights"):
        with _config_context(worker):
            runner.reload_weights(weights_iterator=iter(weights))
        return
    if expert_format.quantized:
        raise RefitError(
            "this vLLM has no layerwise reload (vllm.model_executor.model_loader.reload); reloading FP8 "
            "weights into processed kernel parameters would corrupt them: upgrade vLLM",
            kind=ErrorKind.ENGINE,
        )
    with _config_context(worker):
        model.load_weights(weights)


def _resolved_backend(model: torch.nn.Module) -> str:
    """The first MoE layer's resolved quant method class (and its kernel backend, if it says)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(module, "w13_weight"):
            backend = next(
                (
                    getattr(method, a)
                    for a in ("fp8_backend", "mxfp8_backend", "backend")
                    if getattr(method, a, None)
                ),
                None,
            )
            kind = type(method).__name__
            return f"{kind}/{getattr(backend, 'name', backend)}" if backend is not None else kind
    return ""


class RefitWorkerExtension:
    """Mixed into every vLLM worker by ``LLM(worker_extension_cls="adapters.vllm.RefitWorkerExtension")``.

    ``self`` is vLLM's worker (``model_runner``, ``device``, ``model_config``, ``vllm_config``, ``rank``).
    Drive it from the driver with ``llm.collective_rpc``::

        llm.collective_rpc("refit_attach", args=("ipc:///run/refitd/control.sock",))
        results = refit_engine(llm, min_step=0)     # every worker loads; raises naming any that failed
        llm.collective_rpc("refit_detach")
    """

    def refit_manifest(self) -> Manifest:
        _require_vllm("RefitWorkerExtension.refit_manifest")
        import vllm

        parallel = self.vllm_config.parallel_config
        ep = (
            parallel.tensor_parallel_size * parallel.data_parallel_size
            if parallel.enable_expert_parallel
            else 1
        )
        with _config_context(self):
            model = _model(self)
            params, source = engine_parameters_and_source(model)
            return build_manifest(
                params,
                self.model_config.hf_config.to_dict(),
                self.vllm_config.quant_config,
                tp_size=parallel.tensor_parallel_size,
                ep_size=ep,
                engine_version=vllm.__version__,
                moe_backend=_resolved_backend(model),
                param_source=source,
                deep_gemm_e8m0=_deep_gemm_e8m0(),
            )

    def refit_attach(self, endpoint: str, name: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
        """Attach with this worker's manifest: refused locally (:func:`check_vllm_constraints`, naming
        the engine setting that works) or by the daemon (listing every mismatch)."""
        _require_vllm("RefitWorkerExtension.refit_attach")
        from adapters.engine import EngineWorker

        manifest = self.refit_manifest()
        hf_config = self.model_config.hf_config.to_dict()
        fmt = manifest.expert_format
        self._refit = EngineWorker(
            endpoint,
            name=name or f"vllm-rank{self.rank}",
            manifest=manifest,
            load=lambda gen: load_generation(self, gen.tensors, fmt),
            timeout=timeout,
            check=lambda m: check_vllm_constraints(m, hf_config),
        )
        try:
            return self._refit.attach()
        except RefitError as exc:
            note = fallback_note(manifest)
            if not note:
                raise
            raise RefitError(exc.message + note, kind=exc.kind, rank=exc.rank, step=exc.step) from exc

    def refit_load(self, min_step: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Load the next generation >= ``min_step``; a result dict even on failure, so the driver
        names every failed worker."""
        _require_vllm("RefitWorkerExtension.refit_load")
        worker = getattr(self, "_refit", None)
        name = getattr(worker, "name", f"vllm-rank{getattr(self, 'rank', '?')}")
        t0 = time.perf_counter()
        try:
            if worker is None:
                raise RefitError("refit_load before refit_attach", kind=ErrorKind.ENGINE)
            return worker.load_next(min_step=min_step, timeout=timeout).to_dict()
        except Exception as exc:
            log.exception("refit load failed on %s", name)
            error = f"{type(exc).__name__}: {exc}"
            return {
                "worker": name,
                "step": None,
                "ok": False,
                "seconds": time.perf_counter() - t0,
                "error": error,
            }

    def refit_detach(self) -> None:
        worker = getattr(self, "_refit", None)
        if worker is not None:
            worker.detach()
            self._refit = None


def refit_engine(llm: Any, min_step: int | None = None, timeout: float | None = None) -> list:
    """Driver side: every worker loads the next generation >= ``min_step``; RefitError naming every
    failed worker (an empty result list is a failure). Resets the prefix cache after a success."""
    from adapters.engine import check_results

    results = check_results(llm.collective_rpc("refit_load", args=(min_step, timeout)), step=min_step)
    reset: Callable[[], Any] | None = getattr(llm, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    return results
