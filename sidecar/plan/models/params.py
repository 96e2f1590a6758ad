"""The building blocks every checkpoint lister shares: the ``(name, shape, dtype)`` row, the default
dtypes, reading an integer setting out of a config with an error that says what is missing, and the
MLP and norm parameters all the supported families lay out alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: the dtype of a checkpoint parameter unless its lister says otherwise
PARAM_DTYPE = torch.bfloat16
#: the sigmoid router's bias (DeepSeek-V3, GLM-4.5): FP32 in the checkpoints and in the engines
#: (vLLM deepseek_v2.py / glm4_moe.py create it with ``dtype=torch.float32``)
ROUTER_BIAS_DTYPE = torch.float32

#: (name, shape, dtype): one checkpoint parameter, as ``RefitPlan.build`` accepts it
Param = tuple[str, tuple[int, ...], torch.dtype]


def _get(cfg: Mapping[str, Any], key: str, default: Any = None, *, model: str) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"{model} config has no {key!r}; pass the model's full config.json")
    return value


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None, *, model: str) -> int:
    value = _get(cfg, key, default, model=model)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{model} config {key!r} = {value!r}: expected a non-negative integer")
    return value


def _mlp(p: str, h: int, inter: int, dtype: torch.dtype = PARAM_DTYPE) -> list[Param]:
    return [
        (f"{p}.gate_proj.weight", (inter, h), dtype),
        (f"{p}.up_proj.weight", (inter, h), dtype),
        (f"{p}.down_proj.weight", (h, inter), dtype),
    ]


def _layer_norms(p: str, h: int) -> list[Param]:
    return [
        (f"{p}.input_layernorm.weight", (h,), PARAM_DTYPE),
        (f"{p}.post_attention_layernorm.weight", (h,), PARAM_DTYPE),
    ]
