"""vLLM's load-time parameters -> the manifest of checkpoint tensors its loader expects (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from adapters.checkpoint import DenseMapper, engine_manifest, split_params
from adapters.vllm.compressed_nvfp4 import CT_NVFP4_MOE_METHOD
from adapters.vllm.quant import (
    BLOCK_FP8_ALIGN,
    BLOCK_FP8_REFINE,
    ENGINE_TO_CHECKPOINT,
    EXPERT_PROJS,
    KV_SCALE_LEAVES,
    MXFP8_ALIGN,
    PACKED_MODULES,
    SCALE_LEAVES,
    VllmQuant,
    resolve_quant,
)
from sidecar.numerics.formats import (
    DEFAULT_FORMAT_PARAMS,
    FP8_DTYPE,
    INT4_PACK,
    Format,
    FormatParams,
    Nvfp4Names,
)
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.protocol.manifest import EngineKind, Manifest


def checkpoint_name(engine_name: str) -> str:
    name = engine_name.replace(".base_layer.", ".")
    for engine_prefix, ckpt_prefix in ENGINE_TO_CHECKPOINT:
        if name.startswith(engine_prefix):
            return ckpt_prefix + name[len(engine_prefix) :]
    return name


def _scale_shape(
    leaf: str,
    dtype: torch.dtype,
    weight_shape: tuple[int, ...],
    fmt: Format | None = None,
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
) -> tuple[int, ...]:
    """A scale's checkpoint shape from the unpacked ``[out, in]`` weight shape it scales; an INT4
    expert's per ``params.int4_group`` (bf16 or float32), compressed-tensors' NVFP4 global scale [1]."""
    if leaf == "weight_scale" and fmt is Format.INT4_W4A16:
        return params.scale_shape(fmt, weight_shape)
    if leaf == "weight_global_scale":  # compressed-tensors' one-element global scale
        return (1,)
    if leaf == "weight_scale_inv":
        return Format.BLOCK_FP8.scale_shape(weight_shape)
    if leaf == "weight_scale" and dtype == torch.uint8:
        return Format.MXFP8.scale_shape(weight_shape)
    if leaf == "weight_scale" and dtype == FP8_DTYPE:  # NVFP4's FP8 block scales, one per 16
        return Format.NVFP4.scale_shape(weight_shape)
    if leaf == "weight_scale" and dtype in (torch.bfloat16, torch.float16):  # INT4's group scales
        return Format.INT4_W4A16.scale_shape(weight_shape)
    if leaf == "weight_shape":  # compressed-tensors' unpacked [out, in], int64
        return (2,)
    return ()  # per-tensor weight_scale, NVFP4's weight_scale_2, input_scale


#: routed-expert parameter dtypes of an expert layer vLLM holds unquantized
_UNQUANTIZED = (torch.bfloat16, torch.float16, torch.float32)
#: NVFP4 W4A4's static activation scales: engine state refitd does not publish; the worker carries
#: the engine's current values over into every reload (``adapters.vllm.worker``)
CARRIED_LEAVES = frozenset({"input_scale"})
#: compressed-tensors NVFP4's activation global scales (``adapters.vllm.compressed_nvfp4``): never
#: published; NVFP4A16 (``use_a16``): vLLM creates them, no checkpoint fills them and its kernels never
#: read them, nothing to carry; W4A4 (``static_activations``): carried over (``adapters.vllm.ct_carry``)
ENGINE_ONLY_LEAVES = frozenset({"input_global_scale"})
#: 4-bit values per stored element along K of an engine's packed expert weight
_PACKED_PER_ELEMENT = {Format.NVFP4: 2, Format.MXFP4: 2, Format.INT4_W4A16: INT4_PACK}


class _Builder(DenseMapper):
    """Collects manifest tensors, the BF16-held routed experts, and every problem found."""

    PACKED_MODULES = PACKED_MODULES
    KV_SCALE_LEAVES = KV_SCALE_LEAVES
    SCALE_LEAVES = SCALE_LEAVES

    def __init__(self, ckpt: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype]) -> None:
        super().__init__(ckpt)
        self.dtypes = dtypes
        #: the routed-expert format (NVFP4: ``.weight`` is packed uint8 ``[out, in/2]``)
        self.fmt = Format.BF16
        #: its parameters: the config's (INT4 group, NVFP4 names), INT4's scale dtype from the engine's
        #: ``weight_scale`` parameter (vLLM holds it in the model dtype)
        self.params = DEFAULT_FORMAT_PARAMS
        self.int4_layers = 0
        self.carried: list[str] = []
        #: the config quantizes activations with static scales (compressed-tensors NVFP4 W4A4)
        self.static_activations = False

    def checkpoint_name(self, engine_name: str) -> str:
        return checkpoint_name(engine_name)

    def dense_scale_shape(
        self, leaf: str, dtype: torch.dtype, weight_shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        return _scale_shape(leaf, dtype, weight_shape)

    def accepted_dtype(self, target: str, engine_dtype: torch.dtype) -> torch.dtype:
        """The dtype the engine takes ``target`` in: its own, except an FP32 parameter whose
        checkpoint tensor is BF16 (Qwen3.5's ``A_log`` in ``QwenGatedDeltaNetAttention``): vLLM's
        default weight loader upcasts on copy, exactly, so the BF16 a trainer sends is what it loads."""
        if engine_dtype == torch.float32 and self.dtypes.get(target) == torch.bfloat16:
            return torch.bfloat16
        return engine_dtype

    def experts(
        self, moe: str, params: Mapping[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]], **dims: Any
    ) -> None:
        """One MoE layer's ``w13_*`` / ``w2_*`` parameters -> per-expert checkpoint tensors."""
        w13 = params.get(("w13", "weight")) or params.get(("w13", "weight_packed"))
        w2 = params.get(("w2", "weight")) or params.get(("w2", "weight_packed"))
        if w13 is None or w2 is None or len(w13[1]) != 3 or len(w2[1]) != 3:
            self.problems.append(f"{moe}: expected 3-D w13_weight and w2_weight, got {w13} / {w2}")
            return
        ckpt_moe = checkpoint_name(moe)
        w13_shape, w2_shape = w13[1], w2[1]
        per = _PACKED_PER_ELEMENT.get(self.fmt, 1) if w13[0] not in _UNQUANTIZED else 1
        if per > 1:  # two E2M1 codes a byte (NVFP4), eight INT4 nibbles an int32 (pack-quantized) along K
            w13_shape, w2_shape = (*w13_shape[:2], per * w13_shape[2]), (*w2_shape[:2], per * w2_shape[2])
        e, i, h = self._expert_dims(ckpt_moe, w13_shape, w2_shape, **dims)
        if self.fmt is Format.INT4_W4A16 and w13[0] not in _UNQUANTIZED:
            self._int4_params(ckpt_moe, params.get(("w13", "weight_scale")), h)
        if w13[0] in _UNQUANTIZED:  # held unquantized: the checkpoint form the loader takes
            slab = f"{ckpt_moe}.gate_up_proj"
            if slab in self.ckpt:
                self.add(slab, w13[0], (e, 2 * i, h))
                self.add(f"{ckpt_moe}.down_proj", w2[0], (e, h, i))
                self.keep_bf16 += [slab, f"{ckpt_moe}.down_proj"]
                return
        for x in range(e):
            for w, projs in EXPERT_PROJS.items():
                shape = (i, h) if w == "w13" else (h, i)
                dtype = (params.get((w, "weight")) or params[(w, "weight_packed")])[0]
                four_bit = self.fmt.four_bit and dtype not in _UNQUANTIZED
                packed = self.fmt.weight_shape(shape) if four_bit else shape
                suffix = self.params.weight_suffix(self.fmt) if four_bit else "weight"
                for proj in projs:
                    module = f"{ckpt_moe}.{x}.{proj}"
                    self.add(f"{module}.{suffix}", dtype, packed)
                    if dtype in _UNQUANTIZED:
                        self.keep_bf16.append(module)
                        continue
                    for leaf in SCALE_LEAVES:
                        if (w, leaf) not in params:
                            continue
                        if self.fmt is Format.NVFP4 and leaf in ENGINE_ONLY_LEAVES:
                            if self.static_activations:
                                self.carried.append(f"{module}.{leaf}")
                            continue
                        if self.fmt is Format.NVFP4 and leaf in CARRIED_LEAVES:
                            self.carried.append(f"{module}.{leaf}")
                            continue
                        sdtype = params[(w, leaf)][0]
                        if leaf == "weight_shape":  # held as params_dtype; the loader copies int64 in
                            sdtype = torch.int64
                        self.add(
                            f"{module}.{leaf}",
                            sdtype,
                            _scale_shape(leaf, sdtype, shape, self.fmt, self.params),
                        )

    def _int4_params(
        self, ckpt_moe: str, scale: tuple[torch.dtype, tuple[int, ...]] | None, hidden: int
    ) -> None:
        """INT4's format parameters as the engine holds them: the group the config says, checked
        against the scale columns of ``w13_weight_scale [E, 2I, H / group]``, and that parameter's
        dtype (vLLM 0.33.0 ``CompressedTensorsWNA16MoEMethod.create_weights``: ``params_dtype``)."""
        if scale is None or len(scale[1]) != 3:
            self.problems.append(f"{ckpt_moe}: an INT4 MoE layer without a 3-D w13_weight_scale: {scale}")
            return
        dtype, cols = scale[0], scale[1][2]
        group = self.params.int4_group
        if cols * group != hidden:
            self.problems.append(
                f"{ckpt_moe}: w13_weight_scale has {cols} groups along H = {hidden}, not one per {group} "
                "(the config's group_size)"
            )
        name = str(dtype).removeprefix("torch.")
        try:
            params = FormatParams(int4_group=group, int4_scale_dtype=name)
        except ValueError:
            self.problems.append(
                f"{ckpt_moe}: vLLM holds the INT4 group scales in {name} (the model dtype); refitd publishes "
                "bfloat16 or float32 scales: start the engine with dtype='bfloat16'"
            )
            return
        if self.int4_layers and self.params != params:
            self.problems.append(f"{ckpt_moe}: INT4 scales in {name}, other MoE layers' in another dtype")
        self.int4_layers += 1
        self.params = params

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


def _draft_checkpoint_name(engine_name: str, ckpt: Mapping[str, tuple[int, ...]], mtp_in_layers: bool) -> str:
    """A drafter's parameter name -> the checkpoint name its ``load_weights`` takes it from:
    DeepSeek's ``DeepSeekMTP`` (MTP layers appended to ``model.layers``:
    ``model.layers.N.mtp_block.X <- model.layers.N.X``, ``_rewrite_spec_layer_name``), Qwen3.5's
    ``Qwen3_5MoeMTP`` (``model.X <- mtp.X``); the embedding and head are the target model's."""
    if engine_name.startswith("lm_head."):
        return engine_name
    if engine_name.startswith("model.embed_tokens."):
        for root in ("model.language_model.", "model."):
            if root + engine_name.removeprefix("model.") in ckpt:
                return root + engine_name.removeprefix("model.")
        return engine_name
    if mtp_in_layers:
        return engine_name.replace(".mtp_block.", ".")
    return "mtp." + engine_name.removeprefix("model.")


def build_manifest(
    params: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    hf_config: Mapping[str, Any],
    quant_config: Any,
    *,
    draft_params: Iterable[tuple[str, torch.dtype | str, Sequence[int]]] = (),
    tp_size: int = 1,
    ep_size: int = 1,
    engine_version: str = "",
    moe_backend: str = "",
    param_source: str = "",
    deep_gemm_e8m0: bool | None = None,
) -> Manifest:
    """The manifest of a vLLM model from its load-time parameters ``(name, dtype, shape)``.

    ``draft_params`` are the MTP drafter's (``get_draft_model()``), mapped to the checkpoint names its
    ``load_weights`` takes (the embedding and head it shares with the target model listed once).
    ``param_source`` says where the parameter list came from (:func:`engine_parameters_and_source`);
    ``deep_gemm_e8m0`` is vLLM's ``is_deep_gemm_e8m0_used()`` in the worker (None: unknown). Both go
    to ``info``, where :func:`check_vllm_constraints` reads them.

    ``ep_size > 1`` means vLLM's expert parallelism (experts split across ranks, I not split);
    otherwise the experts are tensor-parallel (I split ``tp_size`` ways). Raises ValueError listing
    every engine parameter that maps to no checkpoint tensor and every expert shape that disagrees.
    """
    hf_config = normalize_hf_config(hf_config)
    model = get_model(model_type_of(hf_config))
    text = model.text_config(hf_config)
    vision = isinstance(hf_config.get("vision_config"), Mapping)
    listed = model.parameters(hf_config, include_mtp=True, include_vision=vision)
    ckpt = {n: tuple(s) for n, s, _ in listed}
    quant = resolve_quant(quant_config)
    tied = bool(hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    moe_tp = 1 if ep_size > 1 else tp_size
    b = _Builder(ckpt, {n: d for n, _, d in listed})
    b.fmt, b.params, b.static_activations = quant.fmt, quant.params, quant.static_activations
    drafted = [(_draft_checkpoint_name(n, ckpt, model.mtp_in_layers), d, s) for n, d, s in draft_params]
    experts, dense = split_params([*params, *drafted], _experts_match)
    for engine_name, dtype in dense:
        b.dense(engine_name, dtype, tied)
    for moe, group in experts.items():
        b.experts(moe, group, moe_tp=moe_tp, ep=ep_size, num_experts=text.get("num_experts"))
    b.refuse_problems("vLLM")
    return engine_manifest(
        EngineKind.VLLM,
        quant.fmt,
        text,
        b.tensors.values(),
        engine_version=engine_version,
        moe_backend=moe_backend or _default_backend(quant),
        moe_tp_size=moe_tp,
        moe_ep_size=ep_size,
        format_params=b.params,
        block_fp8_align=BLOCK_FP8_ALIGN,
        block_fp8_refine=BLOCK_FP8_REFINE,
        mxfp8_align=MXFP8_ALIGN,
        info={
            "model_type": model.model_type,
            "tp_size": tp_size,
            "ep_size": ep_size,
            "moe_tp_size": moe_tp,
            "quant_method": quant.method,
            "keep_bf16": sorted(b.keep_bf16),
            "param_source": param_source,
            "deep_gemm_e8m0": deep_gemm_e8m0,
            # NVFP4 W4A4's static input (global) scales the worker carries over (not published, not refused)
            "carried_input_scales": len(b.carried),
        },
    )


def _experts_match(engine_name: str) -> tuple[str, str, str] | None:
    """``<moe>.[routed_experts.][base_layer.]w13_weight_scale_inv`` -> (moe, "w13", "weight_scale_inv")."""
    head, sep, tail = engine_name.rpartition(".mlp.experts.")
    if not sep:
        return None
    parts = [p for p in tail.split(".") if p not in ("routed_experts", "base_layer")]
    if len(parts) != 1 or "_" not in parts[0]:
        return None
    w, _, leaf = parts[0].partition("_")
    if w not in EXPERT_PROJS or leaf not in ("weight", "weight_packed", *SCALE_LEAVES):
        return None
    return f"{head}.mlp.experts", w, leaf


def _default_backend(quant: VllmQuant) -> str:
    return {
        Format.BLOCK_FP8: "Fp8MoEMethod",
        Format.FP8_PER_TENSOR: "Fp8MoEMethod",
        Format.MXFP8: "ModelOptMxFp8FusedMoE",
        Format.NVFP4: CT_NVFP4_MOE_METHOD
        if quant.params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
        else "ModelOptNvFp4FusedMoE",
        Format.INT4_W4A16: "CompressedTensorsWNA16MoEMethod",
        Format.MXFP4: "CompressedTensorsW4A4Mxfp4MoEMethod",
        Format.BF16: "UnquantizedFusedMoEMethod",
    }[quant.fmt]


def routed_bf16_modules(manifest: Manifest) -> list[str]:
    """The routed-expert modules the engine holds in BF16: the plan's ``keep_bf16``."""
    return list(manifest.info.get("keep_bf16", ()))
