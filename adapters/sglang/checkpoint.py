"""SGLang's parameters -> the manifest of checkpoint tensors its loader takes, and the attach-time
rules SGLang 0.5.23 adds (pure: no SGLang import).

SGLang's ``load_weights`` skips a name it does not know without a word, so the manifest is the only
place a naming mismatch shows: every engine parameter must map to checkpoint tensors here, or the
attach is refused listing it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from adapters.checkpoint import DenseMapper, config_size, engine_manifest, split_params
from adapters.sglang.fourbit import (
    INFO_CAPABILITY,
    INFO_MOE_BACKEND,
    INFO_NO_LOADER,
    INT4_MOE_METHOD,
    LOADED_LEAVES,
    NVFP4_MOE_METHOD,
    four_bit_problems,
    int4_params_from_engine,
)
from adapters.sglang.quant import (
    BLOCK_FP8_ALIGN,
    EXPERT_PROJS,
    KV_SCALE_LEAVES,
    MXFP8_ALIGN,
    PACKED_MODULES,
    SglangQuant,
    resolve_quant,
)
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan.models import get_model, model_type_of
from sidecar.protocol.manifest import EngineKind, Manifest

#: routed-expert parameter dtypes of an expert layer SGLang holds unquantized
_UNQUANTIZED = (torch.bfloat16, torch.float16, torch.float32)
#: ``manifest.info`` keys the attach check reads
INFO_DEEPGEMM_UE8M0 = "deepgemm_scale_ue8m0"
INFO_DP_SIZE = "dp_size"


def _scale_leaf(fmt: Format, engine_leaf: str) -> str:
    """The checkpoint leaf of an engine scale parameter: SGLang holds MXFP8 scales as
    ``weight_scale_inv`` and ``load_weights_only`` renames the checkpoint's ``weight_scale``."""
    if engine_leaf == "weight_scale_inv" and fmt is Format.MXFP8:
        return "weight_scale"
    return engine_leaf


def _scale_shape(fmt: Format, leaf: str, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    if leaf == "input_scale":
        return ()
    shape = fmt.scale_shape(weight_shape)
    if shape is None:
        raise ValueError(f"a {fmt.value} engine holds a {leaf}: refitd publishes none for it")
    return shape


class _Builder(DenseMapper):
    PACKED_MODULES = PACKED_MODULES
    KV_SCALE_LEAVES = KV_SCALE_LEAVES
    SCALE_LEAVES = ("weight_scale_inv", "weight_scale", "input_scale")
    UNMAPPED_NOTE = " (SGLang would skip it silently and serve what it holds now)"

    def __init__(self, ckpt: Mapping[str, tuple[int, ...]], fmt: Format, params: FormatParams) -> None:
        super().__init__(ckpt)
        self.fmt, self.params = fmt, params
        #: NVFP4's activation-scale parameters SGLang keeps as held across updates (not published)
        self.held: set[str] = set()

    def checkpoint_leaf(self, leaf: str) -> str:
        return _scale_leaf(self.fmt, leaf)

    def dense_scale_shape(
        self, leaf: str, dtype: torch.dtype, weight_shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        return _scale_shape(self.fmt, leaf, weight_shape)

    def experts(
        self, moe: str, params: Mapping[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]]
    ) -> None:
        """One MoE layer's ``w13_*`` / ``w2_*`` -> per-expert checkpoint tensors (global shapes: the
        checkpoint's, whatever the engine's TP/EP split)."""
        gate = self.ckpt.get(f"{moe}.0.gate_proj.weight")
        w13 = params.get(("w13", "weight")) or params.get(("w13", "weight_packed"))
        if gate is None or w13 is None:
            self.problems.append(
                f"{moe}: the engine holds {sorted(params)} but the checkpoint has no experts here"
            )
            return
        experts = sum(1 for n in self.ckpt if n.startswith(f"{moe}.") and n.endswith(".gate_proj.weight"))
        i, h = gate
        four_bit = self.fmt.four_bit and w13[0] not in _UNQUANTIZED
        if four_bit and self.fmt is Format.INT4_W4A16:
            self.params, problem = int4_params_from_engine(
                params.get(("w13", "weight_scale")), h, self.params
            )
            if problem:
                self.problems.append(f"{moe}: {problem}")
        for w, projs in EXPERT_PROJS.items():
            weight = params.get((w, "weight")) or params.get((w, "weight_packed"))
            if weight is None:
                self.problems.append(f"{moe}: the engine holds no {w}_weight")
                continue
            shape = (i, h) if w == "w13" else (h, i)
            wdtype = weight[0]
            quantized = wdtype not in _UNQUANTIZED
            suffix = self.params.weight_suffix(self.fmt) if four_bit and quantized else "weight"
            wshape = self.fmt.weight_shape(shape) if four_bit and quantized else shape
            for x in range(experts):
                for proj in projs:
                    module = f"{moe}.{x}.{proj}"
                    self.add(f"{module}.{suffix}", wdtype, wshape)
                    if not quantized:
                        self.keep_bf16.append(module)
                        continue
                    for (pw, leaf), (sdtype, _) in params.items():
                        if pw != w or leaf in ("weight", "weight_packed"):
                            continue
                        if self.fmt.four_bit and leaf not in LOADED_LEAVES:
                            # engine state: NVFP4's activation scales (kept as held), WNA16's g_idx, the
                            # swizzled / derived copies processing makes
                            if leaf == "input_scale":
                                self.held.add(f"{moe}.{w}_input_scale")
                            continue
                        if leaf == "weight_shape":  # held in the model dtype; the loader copies int64 in
                            self.add(f"{module}.weight_shape", torch.int64, (2,))
                            continue
                        ckpt_leaf = _scale_leaf(self.fmt, leaf)
                        self.add(f"{module}.{ckpt_leaf}", sdtype, self._scale_shape(leaf, shape))

    def _scale_shape(self, leaf: str, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        if leaf == "weight_scale_2":  # NVFP4's per-tensor global scale
            return ()
        if leaf == "weight_scale" and self.fmt.four_bit:
            return self.params.scale_shape(self.fmt, weight_shape) or ()
        return _scale_shape(self.fmt, leaf, weight_shape)


def _expert_layer_state(engine_name: str) -> bool:
    """A parameter of a MoE layer itself that is no ``w13_`` / ``w2_`` one (``g1_alphas``, ...)."""
    _, sep, tail = engine_name.rpartition(".mlp.experts.")
    return bool(sep) and "." not in tail


def _experts_match(engine_name: str) -> tuple[str, str, str] | None:
    """``<moe>.mlp.experts.w13_weight_scale_inv`` -> (``<moe>.mlp.experts``, "w13", "weight_scale_inv")."""
    head, sep, tail = engine_name.rpartition(".mlp.experts.")
    if not sep or "." in tail:
        return None
    w, _, leaf = tail.partition("_")
    if w not in EXPERT_PROJS:
        return None
    return f"{head}.mlp.experts", w, leaf


def build_manifest(
    params: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    hf_config: Mapping[str, Any],
    quant_config: Any,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    dp_size: int = 1,
    engine_version: str = "",
    moe_backend: str = "",
    deepgemm_scale_ue8m0: bool | None = None,
    no_loader: Sequence[str] = (),
    moe_runner_backend: str | None = None,
    device_capability: int | None = None,
) -> Manifest:
    """The manifest of an SGLang model from its parameters ``(name, dtype, shape)`` (SGLang keeps
    the loader's parameters: the ones ``restore_weights_before_loading`` brings back at
    ``begin_weight_update``). ValueError lists every engine parameter no checkpoint tensor maps to.
    ``no_loader``: routed-expert parameters without a ``weight_loader`` (processing replaced them);
    ``moe_runner_backend`` / ``device_capability``: SGLang's, for the attach rules' messages."""
    hf_config = hf_field_names(hf_config)
    model = get_model(model_type_of(hf_config))
    text = model.text_config(hf_config)
    ckpt = {n: tuple(s) for n, s, _ in model.parameters(hf_config, include_mtp=False)}
    quant: SglangQuant = resolve_quant(quant_config)
    tied = bool(text.get("tie_word_embeddings", False))
    b = _Builder(ckpt, quant.fmt, quant.params)
    # what processing derives on a 4-bit MoE layer (g1_alphas, ...): nothing loads it
    experts, dense = split_params(
        params, _experts_match, skip=lambda n: quant.fmt.four_bit and _expert_layer_state(n)
    )
    for name, dtype in dense:
        b.dense(name, dtype, tied)
    for moe, group in experts.items():
        b.experts(moe, group)
    b.refuse_problems("SGLang")
    return engine_manifest(
        EngineKind.SGLANG,
        quant.fmt,
        text,
        b.tensors.values(),
        engine_version=engine_version,
        moe_backend=moe_backend or _DEFAULT_BACKEND.get(quant.fmt, "Fp8MoEMethod"),
        format_params=b.params.for_format(quant.fmt),
        moe_tp_size=1 if ep_size > 1 else tp_size,
        moe_ep_size=ep_size,
        block_fp8_align=BLOCK_FP8_ALIGN,
        mxfp8_align=MXFP8_ALIGN,
        info={
            "model_type": model.model_type,
            "tp_size": tp_size,
            "ep_size": ep_size,
            INFO_DP_SIZE: dp_size,
            "quant_method": quant.method,
            "keep_bf16": sorted(b.keep_bf16),
            INFO_DEEPGEMM_UE8M0: deepgemm_scale_ue8m0,
            INFO_NO_LOADER: sorted(no_loader),
            INFO_MOE_BACKEND: moe_runner_backend,
            INFO_CAPABILITY: device_capability,
            # NVFP4's activation scales SGLang keeps across updates (carried over by not publishing them)
            "held_input_scales": sorted(b.held),
        },
    )


_DEFAULT_BACKEND = {
    Format.BF16: "UnquantizedFusedMoEMethod",
    Format.NVFP4: NVFP4_MOE_METHOD,
    Format.INT4_W4A16: INT4_MOE_METHOD,
}

#: transformers 5.x field names -> the names refitd's model registry reads (``Qwen3MoeConfig``'s
#: ``attribute_map`` turns ``num_experts`` into ``num_local_experts`` in ``to_dict()``)
HF_ALIASES = {"num_experts": "num_local_experts"}


def hf_field_names(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """``hf_config`` with the registry's field names filled in from transformers 5.x's."""
    out = dict(hf_config)
    for want, alias in HF_ALIASES.items():
        if want not in out and alias in out:
            out[want] = out[alias]
    return out


def check_sglang_constraints(manifest: Manifest, hf_config: Mapping[str, Any] | None = None) -> list[str]:
    """What SGLang 0.5.23 cannot reload, one line each naming the setting that works; empty when all
    is well. ``EngineWorker.attach`` runs it before the daemon is contacted."""
    h = i = None
    if hf_config is not None:
        hf_config = hf_field_names(hf_config)
        text = get_model(model_type_of(hf_config)).text_config(hf_config)
        h, i = config_size(text.get("hidden_size")), config_size(text.get("moe_intermediate_size"))
    fmt = manifest.expert_format
    problems = manifest.constraints.problems(hidden=h, intermediate=i)
    if fmt is Format.FP8_PER_TENSOR and any(".mlp.experts." in t.name for t in manifest.tensors):
        problems.append(
            "SGLang cannot reload per-tensor FP8 MoE experts: Fp8MoEMethod.process_weights_after_loading replaces "
            "w13_weight_scale with a parameter that has no weight_loader, so the next update fails; set the "
            "daemon's format to block_fp8 (quant_method fp8 with weight_block_size [128, 128]) or bf16"
        )
    if fmt is Format.BLOCK_FP8 and manifest.info.get(INFO_DEEPGEMM_UE8M0) is True:
        problems.append(
            "SGLang's DeepGEMM requantizes block-FP8 scales to UE8M0 on SM100/SM120 (DEEPGEMM_SCALE_UE8M0), so the "
            "FP32 scales refitd publishes cannot be reloaded: start every SGLang process with "
            "SGLANG_ENABLE_JIT_DEEPGEMM=0 (adapters.sglang.SGLANG_ENV)"
        )
    tp = manifest.constraints.moe_tp_size or 1
    h4 = h if h is not None else manifest.constraints.hidden_size
    i4 = i if i is not None else manifest.constraints.intermediate_size
    part = i4 // tp if i4 is not None and i4 % tp == 0 else i4
    problems += four_bit_problems(fmt, manifest.format_params, h4, part, manifest.info)
    linears = sorted(
        t.name
        for t in manifest.tensors
        if fmt.four_bit and ".mlp.experts." not in t.name and t.dtype in (torch.uint8, torch.int32)
    )
    if linears:
        problems.append(
            f"SGLang would hold {len(linears)} non-expert tensors in {fmt.value} (e.g. {linears[0]}): refitd's SGLang "
            "adapter publishes 4-bit routed experts only (its 4-bit linear methods, e.g. ModelOptFp4LinearMethod "
            "with static input scales, are not verified): set quantize_linears off (the linears stay BF16)"
        )
    dp = manifest.info.get(INFO_DP_SIZE)
    if isinstance(dp, int) and dp > 1:
        problems.append(
            f"SGLang's update_weights_from_tensor does not support dp_size > 1 (this engine runs dp_size={dp}): "
            "run one SGLang engine per data-parallel replica (dp_size=1 each) and refit each"
        )
    static = sorted(t.name for t in manifest.tensors if t.name.endswith(".input_scale"))
    if static:
        problems.append(
            f"the engine expects static activation scales ({len(static)} tensors, e.g. {static[0]}); refitd "
            "publishes none: set activation_scheme 'dynamic' (sglang_quantization_config does)"
        )
    return problems
