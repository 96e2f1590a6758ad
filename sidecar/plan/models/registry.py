"""The registry rows (:class:`ModelSpec`, one per supported ``model_type``, in :data:`MODELS`) and the
reading of a Hugging Face ``config.json`` through them.

The config normalisation lives here, beside the rows, because each needs the other: which field
aliases apply depends on the family a ``model_type`` names (a row's ``aliases``), and every row
reads its config normalized.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.plan.models.deepseek import (
    DEEPSEEK_LINEAR_RE,
    ROUTER_BIAS_RE,
    _deepseek_v3_params,
    _glm4_moe_params,
)
from sidecar.plan.models.experts import PER_EXPERT_RE, SLAB_RE, ExpertForm, with_expert_form
from sidecar.plan.models.params import PARAM_DTYPE, Param, _int
from sidecar.plan.models.qwen import _qwen3_5_moe_params, _qwen3_moe_params

# --------------------------------------------------------------------------------------------------
# config field names: transformers writes some fields under other names than the ones refitd reads

#: the field refitd reads -> the other names a ``config.json`` may carry it under. transformers 5.x
#: renames through each config class's ``attribute_map``: ``Qwen3MoeConfig`` maps ``num_experts`` to
#: ``num_local_experts`` (and ``save_pretrained`` writes the latter); ``DeepseekV3Config`` and
#: ``Glm4MoeConfig`` map ``num_local_experts`` to ``n_routed_experts`` and ``num_mtp_layers`` to
#: ``num_nextn_predict_layers``; every 5.x config writes ``dtype`` where 4.x wrote ``torch_dtype``.
CONFIG_ALIASES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "qwen3_moe": (("num_experts", ("num_local_experts",)),),
    "qwen3_5_moe": (("num_experts", ("num_local_experts",)), ("mtp_num_hidden_layers", ("num_mtp_layers",))),
    "deepseek_v3": (
        ("n_routed_experts", ("num_local_experts", "num_experts")),
        ("num_nextn_predict_layers", ("num_mtp_layers",)),
    ),
    "glm4_moe": (
        ("n_routed_experts", ("num_local_experts", "num_experts")),
        ("num_nextn_predict_layers", ("num_mtp_layers",)),
    ),
}
#: every family: the checkpoint's dtype (read as ``dtype``; 4.x configs say ``torch_dtype``)
DTYPE_ALIASES: tuple[str, tuple[str, ...]] = ("dtype", ("torch_dtype",))
#: nested configs that carry the text model's fields (Qwen3.5, Kimi-K2.5)
NESTED_CONFIG_KEYS = ("text_config",)


def normalize_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` dict, transformers 4.x or 5.x) with the field names refitd reads.

    A field refitd reads (``num_experts``, ``n_routed_experts``, ``num_nextn_predict_layers``,
    ``dtype``) that the config holds only under one of its aliases (:data:`CONFIG_ALIASES`:
    ``num_local_experts``, ``num_mtp_layers``, ``torch_dtype``) is copied to refitd's name, at the
    top level and inside ``text_config``; nothing else changes, and the input is not modified. Two
    names that disagree raise ValueError naming both. Idempotent: every reader of a config calls
    it (the registry's listers, the daemon's plan, the engine adapters' manifests), so a config as
    transformers 5.x ``save_pretrained`` writes it reads the same as a 4.x one.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"a Hugging Face config must be a dict (config.json), got {type(config).__name__}")
    out = dict(config)
    model_type = config.get("model_type")
    for key in NESTED_CONFIG_KEYS:
        nested = out.get(key)
        if isinstance(nested, Mapping):
            out[key] = _normalized_fields(nested, nested.get("model_type") or model_type, f"{key}.")
    return _normalized_fields(out, model_type, "")


def _normalized_fields(cfg: Mapping[str, Any], model_type: Any, where: str) -> dict[str, Any]:
    out = dict(cfg)
    family = None
    if isinstance(model_type, str):
        family = next((s for s in MODELS.values() if model_type in (s.model_type, *s.aliases)), None)
    pairs = (*CONFIG_ALIASES.get(family.model_type, ()), DTYPE_ALIASES) if family else (DTYPE_ALIASES,)
    for name, aliases in pairs:
        for alias in aliases:
            if out.get(alias) is None:
                continue
            if out.get(name) is None:
                out[name] = out[alias]
            elif out[name] != out[alias]:
                raise ValueError(
                    f"config {where}{name} = {out[name]!r} but {where}{alias} = {out[alias]!r}: they name the "
                    "same setting; keep one (or make them agree)"
                )
    return out


#: ``dtype`` strings a config may give -> torch dtypes
_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype the checkpoint stores its parameters in (``dtype``/``torch_dtype``, top level, else
    ``text_config``'s), or None when the config names none. ValueError for one refitd cannot hold."""
    cfg = normalize_hf_config(config)
    value = cfg.get("dtype")
    if value is None and isinstance(cfg.get("text_config"), Mapping):
        value = cfg["text_config"].get("dtype")
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in _CONFIG_DTYPES:
        raise ValueError(
            f"config dtype {value!r}: refitd publishes checkpoints in {sorted(_CONFIG_DTYPES)}; fix the config"
        )
    return _CONFIG_DTYPES[name]


# --------------------------------------------------------------------------------------------------
# the registry

ParamLister = Callable[..., list[Param]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """One supported model family. Data, so the plan never branches on a model's name."""

    model_type: str
    description: str
    #: grouped slabs of routed experts (SPEC §2.1); None for a family that never has them
    slab_re: re.Pattern[str] | None
    #: per-expert routed projections (SPEC §2.1)
    per_expert_re: re.Pattern[str]
    #: key under which a multimodal config nests the text settings, or None for flat configs
    text_config_key: str | None
    #: other ``model_type`` strings (e.g. a nested text config's own) that mean this family
    aliases: tuple[str, ...] = ()
    has_mtp: bool = False
    #: MTP layers are ``model.layers.{num_hidden_layers + n}`` (DeepSeek-V3, GLM-4.5), not ``mtp.layers.n``
    mtp_in_layers: bool = False
    #: non-expert linear weights a block-FP8 checkpoint quantizes (``quantization_config``); None: none
    linear_re: re.Pattern[str] | None = None
    #: tensors the checkpoint holds in FP32 whatever its dtype (published in FP32); None: none
    fp32_re: re.Pattern[str] | None = None
    #: ``lister(config, *, include_mtp, include_vision) -> [(name, shape, dtype), ...]``, ``config`` as
    #: :func:`normalize_hf_config` returns it
    lister: ParamLister

    def text_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The text model's settings (:func:`normalize_hf_config`'s names): ``config[text_config_key]``
        if present, else ``config``."""
        config = normalize_hf_config(config)
        if self.text_config_key and isinstance(config.get(self.text_config_key), Mapping):
            return config[self.text_config_key]
        return config

    def num_hidden_layers(self, config: Mapping[str, Any]) -> int:
        """Decoder layers of the text model (MTP layers not counted)."""
        return _int(self.text_config(config), "num_hidden_layers", model=self.model_type)

    def mtp_layer(self, layer: int, num_hidden_layers: int) -> int | None:
        """The MTP index of decoder-named ``layers.{layer}`` (None: a decoder layer)."""
        if self.mtp_in_layers and layer >= num_hidden_layers:
            return layer - num_hidden_layers
        return None

    def parameters(
        self,
        config: Mapping[str, Any],
        *,
        include_mtp: bool = True,
        include_vision: bool = False,
        experts: ExpertForm | str | None = None,
    ) -> list[Param]:
        """Every checkpoint parameter as ``(name, shape, dtype)``, in module order, with the names
        and dtypes the checkpoint holds: the config's ``dtype`` (BF16 when it names none), the
        tensors a checkpoint keeps in FP32 (:data:`ROUTER_BIAS_DTYPE`) in FP32. ``experts`` lists
        the routed experts in that form instead of the checkpoint's (:func:`with_expert_form`)."""
        config = normalize_hf_config(config)
        params = self.lister(config, include_mtp=include_mtp, include_vision=include_vision)
        if experts is not None:  # the other form (a trainer's run-time modules): same outputs
            params = with_expert_form(params, experts)
        dtype = checkpoint_dtype(config)
        if dtype is None or dtype == PARAM_DTYPE:
            return params
        return [(n, s, dtype if d == PARAM_DTYPE else d) for n, s, d in params]


QWEN3_MOE = ModelSpec(
    model_type="qwen3_moe",
    description="Qwen3 MoE (e.g. Qwen3-30B-A3B): per-expert projections",
    slab_re=SLAB_RE,  # transformers v5 exports may group Qwen3 MoE experts too
    per_expert_re=PER_EXPERT_RE,
    text_config_key=None,
    lister=_qwen3_moe_params,
)

QWEN3_5_MOE = ModelSpec(
    model_type="qwen3_5_moe",
    description="Qwen3.5 MoE (e.g. Qwen3.5-35B-A3B): grouped expert slabs, hybrid attention, MTP",
    slab_re=SLAB_RE,
    per_expert_re=PER_EXPERT_RE,
    text_config_key="text_config",
    aliases=("qwen3_5_moe_text",),
    has_mtp=True,
    lister=_qwen3_5_moe_params,
)

DEEPSEEK_V3 = ModelSpec(
    model_type="deepseek_v3",
    description="DeepSeek-V3 family (DeepSeek-V3/R1/V3.1, Kimi-K2): MLA, shared experts, FP32 router bias, MTP",
    slab_re=SLAB_RE,  # a trainer may send grouped slabs; the checkpoint names experts one by one
    per_expert_re=PER_EXPERT_RE,
    text_config_key=None,
    aliases=("kimi_k2",),
    has_mtp=True,
    mtp_in_layers=True,
    linear_re=DEEPSEEK_LINEAR_RE,
    fp32_re=ROUTER_BIAS_RE,
    lister=_deepseek_v3_params,
)

GLM4_MOE = ModelSpec(
    model_type="glm4_moe",
    description="GLM-4.5/4.6 MoE: GQA attention with q/k/v bias, shared experts, FP32 router bias, MTP",
    slab_re=SLAB_RE,
    per_expert_re=PER_EXPERT_RE,
    text_config_key=None,
    has_mtp=True,
    mtp_in_layers=True,
    linear_re=DEEPSEEK_LINEAR_RE,
    fp32_re=ROUTER_BIAS_RE,
    lister=_glm4_moe_params,
)

#: model_type -> ModelSpec; add a row to support a new family
MODELS: dict[str, ModelSpec] = {
    spec.model_type: spec for spec in (QWEN3_MOE, QWEN3_5_MOE, DEEPSEEK_V3, GLM4_MOE)
}


def get_model(model_type: str) -> ModelSpec:
    """The registry row for ``model_type`` (or one of its aliases); ValueError lists the known ones."""
    if isinstance(model_type, str):
        for spec in MODELS.values():
            if model_type == spec.model_type or model_type in spec.aliases:
                return spec
    known = ", ".join(sorted(MODELS))
    raise ValueError(f"unknown model type {model_type!r}: refitd knows {known}")


def model_type_of(config: Mapping[str, Any]) -> str:
    """The registry model type a ``config.json`` dict describes (top-level ``model_type`` first)."""
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), Mapping):
        model_type = config["text_config"].get("model_type")
    if model_type is None:
        raise ValueError("config has no 'model_type'; pass the model's Hugging Face config.json")
    return get_model(model_type).model_type
