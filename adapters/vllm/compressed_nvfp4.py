"""NVFP4 under compressed-tensors' names for vLLM (``nvfp4-pack-quantized``), and the format parameters
a compressed-tensors quantization config says (SPEC §1.7 INT4 group, §2.3 NVFP4 names).

refitd publishes NVFP4 under ModelOpt's names by default (``quantization="modelopt_fp4"``). An engine
started with :func:`compressed_tensors_nvfp4` instead runs vLLM 0.33.0's
``CompressedTensorsW4A4Nvfp4MoEMethod`` (``compressed_tensors_moe_w4a4_nvfp4.py``), whose parameters are
``w13/w2_weight_packed`` uint8, ``w13/w2_weight_scale`` float8_e4m3fn per 16, ``w13/w2_weight_global_scale``
float32 per expert (the reciprocal of ModelOpt's ``weight_scale_2``: ``process_weights_after_loading``
passes ``1.0 / w13_weight_global_scale`` as ``w13_scale_2``) and ``w13/w2_input_global_scale``; the
manifest of such an engine says ``nvfp4_names = compressed_tensors`` and the daemon publishes
``.weight_packed``, ``.weight_scale`` and ``.weight_global_scale = float32(1 / gs)`` (shape [1], as
compressed-tensors' ``initialize_qparams`` makes a global scale).

By default the config's ``input_activations`` is None: NVFP4 weights with BF16 activations (vLLM's
``use_a16``, NVFP4A16); the engine's ``input_global_scale`` parameters are then engine state nobody
reads, not published (``ENGINE_ONLY_LEAVES``). With ``w4a4=True`` the config is compressed-tensors'
own ``NVFP4`` preset (W4A4: activations NVFP4 too, ``tensor_group`` per 16 with ``dynamic: "local"``,
i.e. the per-16 activation scales computed on the fly and the activations' global scale static,
calibrated): the engine then holds ``w13/w2_input_global_scale`` per expert, which refitd does not
compute (the trainer has none), so the worker carries the value the engine holds over into every
reload (``adapters.vllm.ct_carry``), and the manifest counts them (``carried_input_scales``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sidecar.numerics.formats import (
    DEFAULT_FORMAT_PARAMS,
    NVFP4_BLOCK,
    Format,
    FormatParams,
    Nvfp4Names,
)

__all__ = [
    "CT_NVFP4_FORMAT",
    "CT_NVFP4_MOE_METHOD",
    "compressed_tensors_nvfp4",
    "compressed_tensors_scheme",
    "nvfp4_w4a4",
]

#: the compressed-tensors format name of NVFP4 (``CompressionFormat.nvfp4_pack_quantized``)
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
#: vLLM 0.33.0's MoE method for it
CT_NVFP4_MOE_METHOD = "CompressedTensorsW4A4Nvfp4MoEMethod"
#: the compressed-tensors strategy of NVFP4's two-level scales (``QuantizationStrategy.TENSOR_GROUP``)
TENSOR_GROUP = "tensor_group"
#: compressed-tensors' ``DynamicType.LOCAL``: NVFP4 activations' per-16 scales dynamic, the global static
DYNAMIC_LOCAL = "local"
#: the checkpoint leaf of W4A4's static activation global scale (``{proj}.input_global_scale``)
INPUT_GLOBAL_SCALE = "input_global_scale"


def compressed_tensors_nvfp4(ignored: Sequence[str], *, w4a4: bool = False) -> tuple[str, dict[str, Any]]:
    """``(quantization, quantization_config)`` for a vLLM engine that loads refitd's NVFP4 experts under
    compressed-tensors' names: one config group with vLLM's ``_is_nvfp4_format`` weights (4-bit float,
    ``tensor_group``, group 16, symmetric) and no input quantization (NVFP4A16), or with ``w4a4`` the
    activations' arguments of compressed-tensors' ``NVFP4`` preset (static global scale, per-16 scales
    ``local``); ``ignored`` stay BF16."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": TENSOR_GROUP,
        "group_size": NVFP4_BLOCK,
        "dynamic": False,
    }
    activations = {**weights, "dynamic": DYNAMIC_LOCAL} if w4a4 else None
    qc = {
        "quant_method": "compressed-tensors",
        "format": CT_NVFP4_FORMAT,
        "ignore": list(ignored),
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
    }
    return "compressed-tensors", qc


def nvfp4_w4a4(activations: Iterable[Any]) -> bool:
    """Whether compressed-tensors NVFP4 config groups quantize the activations (W4A4: each group's
    ``input_activations`` 4-bit float ``tensor_group`` per 16, which vLLM requires of NVFP4 activations),
    so the engine holds a static activation global scale per expert; False for NVFP4A16 (None)."""
    found = [a for a in activations if a is not None]
    return bool(found) and all(
        _field(a, "type") == "float"
        and _field(a, "strategy") == TENSOR_GROUP
        and _field(a, "group_size") == "16"
        for a in found
    )


def _field(args: Any, key: str) -> Any:
    """A weight-quantization field of a config group: a dict's key or a ``QuantizationArgs``'
    attribute (an enum's value)."""
    value = args.get(key) if isinstance(args, Mapping) else getattr(args, key, None)
    value = getattr(value, "value", value)
    return None if value is None else str(value).lower().rsplit(".", 1)[-1]


def compressed_tensors_scheme(weights: Iterable[Any]) -> tuple[Format, FormatParams] | None:
    """The expert format and format parameters of compressed-tensors weight arguments (each a config
    group's ``weights``, as a dict or ``QuantizationArgs``), or None for a scheme refitd does not
    publish. INT4 ``pack-quantized`` takes its group size from the config (SPEC §1.7; its scale
    dtype is the engine's parameter dtype, read by the manifest); 4-bit float ``tensor_group`` per 16
    is NVFP4 under compressed-tensors' names; 4-bit float ``group`` per 32 is MXFP4."""
    seen: set[tuple[Format, FormatParams]] = set()
    for args in weights:
        kind, strategy, group = _field(args, "type"), _field(args, "strategy"), _field(args, "group_size")
        bits = _field(args, "num_bits")
        if bits not in (None, "4"):
            return None
        if kind == "int" and strategy == "group" and group is not None and group.isdigit():
            try:
                seen.add((Format.INT4_W4A16, FormatParams(int4_group=int(group))))
            except ValueError:
                return None
        elif kind == "float" and strategy == TENSOR_GROUP and group == str(NVFP4_BLOCK):
            seen.add((Format.NVFP4, FormatParams(nvfp4_names=Nvfp4Names.COMPRESSED_TENSORS)))
        elif kind == "float" and group in (None, "32"):
            seen.add((Format.MXFP4, DEFAULT_FORMAT_PARAMS))
        else:
            return None
    return next(iter(seen)) if len(seen) == 1 else None
