"""TensorRT-LLM (PyTorch backend) adapter: manifest, MoE backend rules, LLM kwargs, Ray worker extension.

TensorRT-LLM is never imported at module level: ``import adapters.trtllm`` works without it, and only
the worker extension's methods (which run inside TRT-LLM's Ray workers) import it. Everything else
is pure and tested against facts transcribed from TRT-LLM's source (``tests/data/manifests/``).

Wiring (one source of truth: the daemon's :class:`~sidecar.plan.build.RefitSpec`)::

    from tensorrt_llm import LLM
    from adapters.trtllm import refit_engine, trtllm_llm_args

    llm = LLM(model=model_dir, **trtllm_llm_args(spec, hf_config, sm=100))
    llm._collective_rpc("refit_attach", args=(endpoint,))   # refused, listing mismatches, if plans differ
    for step in range(steps):
        refit_engine(llm, min_step=step)                     # RefitError naming every failed worker

Facts this module relies on, by source file (NVIDIA/TensorRT-LLM as stored; commits where known):

* ``_torch/modules/fused_moe/create_moe.py`` (01f8de52) ``get_moe_cls``: CUTLASS -> CutlassFusedMoE;
  TRTLLM -> TRTLLMGenFusedMoE only for fp8_block_scales (and FP4 modes), otherwise a warning and
  CutlassFusedMoE; CUTEDSL -> CuteDslFusedMoE only for fp8_block_scales/nvfp4; DEEPGEMM ->
  DeepGemmFusedMoE. With ``ENABLE_CONFIGURABLE_MOE=1`` (default) the layer is a ``ConfigurableMoE``
  whose ``backend`` is the implementation; ``_torch/modules/fused_moe/moe_resolution.py`` (newer)
  ``resolve_moe_cls`` does the same per layer, Cutlass being the fallback of every family.
* ``fused_moe_trtllm_gen.py``: TRTLLMGenFusedMoE raises on SM >= 120; its kernels are Blackwell-only.
* ``_torch/model_config.py`` (008e0af8) ``resolve_moe_backend``: AUTO -> TRTLLM for FP8_BLOCK_SCALES on
  SM100f, else CUTLASS. ``load_hf_quant_config``: ``quant_method == "fp8"`` with ``weight_block_size``
  -> FP8_BLOCK_SCALES (``modules_to_not_convert`` become ``exclude_modules``); ``quant_method ==
  "mxfp8"`` with ``weight_block_size [1, 32]`` -> MXFP8; a ModelOpt config (``quant_method:
  "modelopt"``, ``quant_algo``, ``ignore``; ``quantization/modelopt_config.py``) gives per-tensor FP8.
  ``model_kwargs`` are set on the pretrained config before the quant config is read.
* ``_torch/modules/fused_moe/quantization.py`` (newest stored): ``DeepSeekFP8BlockScalesFusedMoEMethod``
  holds ``w3_w1_weight`` fp8 [E_local, 2*I_part, H] (W31: rows [0, I_part) = w3 = up_proj),
  ``w3_w1_weight_scaling_factor`` fp32 [E_local, 2*ceil(I_part/128), ceil(H/128)], ``w2_weight`` fp8
  [E_local, H, I_part], ``w2_weight_scaling_factor`` fp32 [E_local, ceil(H/128), ceil(I_part/128)];
  it reads ``{e}.w1/w3/w2.weight_scale_inv`` and asserts ``I_part % 128 == 0``.
  ``FP8QDQFusedMoEMethod`` holds ``fc31_dequant``/``fc2_dequant`` fp32 [E_local], ``fc2_quant`` and
  ``fc31_input_dequant`` fp32 0-d; it reads ``{e}.w{1,3,2}.weight_scale`` and, for *every* expert,
  ``{e}.w{1,3,2}.input_scale`` into ``torch.empty`` buffers (missing ones stay garbage), then sets
  ``fc31_input_dequant = max(w1/w3 input scales)`` and ``fc2_quant = 1 / max(w2 input scales)``.
  ``DeepSeekFP8BlockScalesFusedMoEMethodDeepGemm`` resmooths scales to UE8M0 when
  ``is_sm_100f() or sm == 120``. Partial loading is accepted for unquantized, FP8QDQ, block-FP8
  (incl. DeepGemm) and NVFP4 methods only. ``MXFP8CutlassFusedMoEMethod`` (per a TRT-LLM unit test
  of it; path not resolved) holds int32-packed scales [E, 2*I_part, H/128] and
  [E, H, I_part/128] and needs SM100+.
* ``_torch/models/checkpoints/hf/qwen2_moe_weight_mapper.py`` (Qwen3 MoE) and
  ``qwen3_5_weight_mapper.py`` / ``qwen3_5_moe_weight_mapper.py``: per-expert names are renamed
  ``gate_proj -> w1``, ``up_proj -> w3``, ``down_proj -> w2`` (scale and input_scale suffixes ride
  along); a module whose weights contain ``gate_up_proj`` loads as FUSED_GATE_UP_PROJ; Qwen3.5 strips
  ``model.language_model.`` to ``model.``, drops ``model.visual.*`` and packs ``in_proj_qkv + z`` /
  ``in_proj_b + a`` (all parts must arrive in one reload call).
* ``_torch/pyexecutor/model_loader.py``: ``ModelLoader.reload(model, weights, allow_partial_loading)``;
  ``load_format="dummy"`` fills every float parameter uniformly in [-1e-3, 1e-3] (no usable input
  scales). ``llmapi/rlhf_utils.py`` ``WorkerExtension.update_weights``: ``pre_reload_weights()`` once per
  cycle, ``reload(..., allow_partial_loading=True)``, then finalize: ``process_weights_after_loading()``
  and ``post_load_weights()`` on every module not ``_weights_removed``, MoE load balancer
  ``register_weight_slots_after_to_cuda()`` + ``finalize_model()``, ``reset_prefix_cache()``, then
  synchronize / gc / ``ipc_collect`` / ``empty_cache``. The Ray GPU worker's ``_inject_worker_extension``: an
  extension class is mixed into the worker; any non-dunder attribute the worker already has is an error.
  ``llmapi/llm.py``: ``LLM._collective_rpc(method, args=(), kwargs=None, ...) -> list``.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from adapters.manifest import EngineConstraints, EngineKind, Manifest, ManifestTensor
from sidecar.numerics.formats import BLOCK, FLOAT_DTYPES, FP8_DTYPE, Format
from sidecar.plan.build import Layer, RefitSpec, UnitKind, layer_of_name, plan_from_hf_config
from sidecar.plan.models import PER_EXPERT_RE, SLAB_RE, get_model, model_type_of

__all__ = [
    "EXTENSION_QUALNAME",
    "MoeBackend",
    "RefitWorkerExtension",
    "build_manifest",
    "check_trtllm_constraints",
    "refit_engine",
    "resolve_moe_backend",
    "trtllm_llm_args",
]

log = logging.getLogger(__name__)

#: what ``LLM(ray_worker_extension_cls=...)`` names
EXTENSION_QUALNAME = "adapters.trtllm.RefitWorkerExtension"
#: CUTLASS MXFP8 MoE packs 4 UE8M0 bytes per int32 along K (MXFP8CutlassFusedMoEMethod)
MXFP8_MOE_ALIGN = 128
#: DeepSeekFP8BlockScalesFusedMoEMethod asserts intermediate_size_per_partition % 128 == 0
BLOCK_FP8_MOE_ALIGN = BLOCK
#: SM100f: the Blackwell family TRTLLM-Gen MoE kernels and TRT-LLM's ``is_sm_100f()`` cover
SM100F = frozenset({100, 103})
#: CUTLASS MXFP8 MoE kernels: SM100/SM103 only (SM107 is served by CuteDSL)
MXFP8_CUTLASS_SMS = frozenset({100, 103})
#: the GPU generations the backend table covers (docs/engines.md)
TABLE_SMS = (90, 100, 103, 107, 120)
_NO_INPUT_SCALES = "static input scales"


class MoeBackend:
    """Resolved MoE implementation class names, as ``type(module).__name__`` reports them."""

    CUTLASS = "CutlassFusedMoE"
    TRTLLM_GEN = "TRTLLMGenFusedMoE"
    CUTEDSL = "CuteDslFusedMoE"
    DEEPGEMM = "DeepGemmFusedMoE"


#: the ``moe_config.backend`` values refitd has a rule for (get_moe_cls's other branches are refused)
REQUESTED_BACKENDS = ("AUTO", "CUTLASS", "TRTLLM", "CUTEDSL", "DEEPGEMM")
#: the block-FP8 quant method that rounds FP32 block scales to UE8M0 on SM100f / SM120
_DEEPGEMM_METHOD = "DeepSeekFP8BlockScalesFusedMoEMethodDeepGemm"


# --------------------------------------------------------------------------------------------------
# backend resolution and the backend table (one source of truth for the code and docs/engines.md)


def resolve_moe_backend(requested: str, expert_format: Format | str, sm: int | None) -> str:
    """The MoE class TRT-LLM builds for ``requested`` (``MoeConfig.backend``) and the experts' format.

    Transcribes ``get_moe_cls`` (``_torch/modules/fused_moe/create_moe.py`` @01f8de52), which looks at
    the quant mode and never at the GPU: TRTLLM -> TRTLLMGenFusedMoE for fp8_block_scales on any SM
    (else CutlassFusedMoE with a warning); CUTEDSL -> CuteDslFusedMoE for fp8_block_scales (else
    Cutlass); DEEPGEMM -> DeepGemmFusedMoE whatever the format; AUTO is ``model_config.
    resolve_moe_backend`` (@008e0af8): TRTLLM for FP8_BLOCK_SCALES on SM100f, else CUTLASS. Whether
    the resolved class can keep what refitd publishes is :func:`backend_refusal`'s question.
    Raises ValueError for a backend refitd has no rule for.
    """
    fmt = Format.parse(expert_format)
    req = str(requested).strip().upper()
    if req == "AUTO":
        req = "TRTLLM" if fmt is Format.BLOCK_FP8 and sm in SM100F else "CUTLASS"
    if req == "CUTLASS":
        return MoeBackend.CUTLASS
    if req == "TRTLLM":
        return MoeBackend.TRTLLM_GEN if fmt is Format.BLOCK_FP8 else MoeBackend.CUTLASS
    if req == "CUTEDSL":
        return MoeBackend.CUTEDSL if fmt is Format.BLOCK_FP8 else MoeBackend.CUTLASS
    if req == "DEEPGEMM":
        return MoeBackend.DEEPGEMM
    raise ValueError(
        f"refitd has no verified rule for TRT-LLM MoE backend {requested!r} with {fmt.value} experts; "
        f"set moe_config backend to one of {', '.join(REQUESTED_BACKENDS)}"
    )


def backend_refusal(
    expert_format: Format | str,
    backend: str,
    sm: int | None,
    *,
    quant_method: str = "",
    mxfp8_reload: bool | None = True,
) -> str | None:
    """Why TRT-LLM's resolved MoE class ``backend`` on SM ``sm`` cannot take refitd's ``expert_format``
    experts, naming the engine setting that would work; None when it can.

    ``sm`` None (unknown) applies only the rules that hold on every GPU. ``quant_method`` is the MoE
    module's resolved quant method class when known: the DeepGEMM block-FP8 method is refused whatever
    class holds it. ``mxfp8_reload`` says whether this TRT-LLM build has the MXFP8 reload path
    (None: unknown, refused; the worker probes it). Facts: ``CutlassFusedMoE._get_quant_method`` picks
    ``DeepSeekFP8BlockScalesFusedMoEMethodDeepGemm`` on SM100f, whose ``_needs_e8m0_resmooth``
    (``is_sm_100f() or sm == 120``) rounds FP32 block scales to UE8M0; ``TRTLLMGenFusedMoE`` kernels
    exist for SM100f and raise on SM >= 120; NeMo-RL's block-FP8 recipe allows only TRTLLM; per-tensor
    FP8 runs as ``FP8QDQFusedMoEMethod`` in CUTLASS; MXFP8 is ``MXFP8CutlassFusedMoEMethod``, SM100/SM103.
    """
    fmt = Format.parse(expert_format)
    where = f"sm={sm}" if sm is not None else "this GPU"
    if not fmt.quantized:
        return None
    if fmt is Format.BLOCK_FP8:
        if quant_method == _DEEPGEMM_METHOD and (sm is None or sm in SM100F or sm >= 120):
            return (
                f"{backend} runs block-FP8 through {_DEEPGEMM_METHOD}, which rounds the FP32 block scales "
                f"refitd publishes to UE8M0 on {where}; set moe_config backend='TRTLLM' on SM100/SM103"
            )
        if sm is not None and (sm >= 120 or sm == 107):
            why = (
                "TRTLLMGenFusedMoE raises on SM >= 120, CUTLASS/DeepGEMM resmooth to UE8M0"
                if sm >= 120
                else "TRTLLM-Gen kernels are SM100/SM103 only; refitd has verified no other path there"
            )
            return (
                f"no TRT-LLM MoE backend keeps block-FP8's FP32 scales on sm={sm} ({why}); serve block-FP8 on "
                "SM90 (moe_config backend='CUTLASS') or SM100/SM103 (backend='TRTLLM'), or publish bf16"
            )
        if backend == MoeBackend.TRTLLM_GEN:
            if sm is not None and sm not in SM100F:
                return (
                    f"{backend} kernels exist only for SM100/SM103, not sm={sm}; set moe_config "
                    "backend='CUTLASS' on Hopper"
                )
            return None
        if sm in SM100F:
            return (
                f"{backend} on sm={sm} does not keep block-FP8's FP32 scales (CutlassFusedMoE and DeepGEMM "
                "resmooth them to UE8M0 on Blackwell; NeMo-RL allows only TRTLLM for block-FP8): set "
                "moe_config backend='TRTLLM' (a TRT-LLM that fell back from TRTLLM to CUTLASS lands here too)"
            )
        if backend in (MoeBackend.CUTLASS, MoeBackend.DEEPGEMM):
            return None  # Hopper (or unknown SM): DeepSeekFP8BlockScalesFusedMoEMethod, FP32 scales
        return (
            f"refitd has no verified rule for block-FP8 through {backend}; set moe_config backend='CUTLASS' "
            "on Hopper or 'TRTLLM' on SM100/SM103"
        )
    if backend != MoeBackend.CUTLASS:
        what = "FP8QDQFusedMoEMethod" if fmt is Format.FP8_PER_TENSOR else "MXFP8CutlassFusedMoEMethod"
        return (
            f"{fmt.value} MoE runs only as {what} in {MoeBackend.CUTLASS}, not {backend}; set moe_config "
            "backend='CUTLASS'"
        )
    if fmt is Format.MXFP8:
        if sm is not None and sm not in MXFP8_CUTLASS_SMS:
            hint = (
                "SM107 is served by CuteDSL MXFP8, which refitd has not verified"
                if sm == 107
                else "there are no MXFP8 MoE kernels for it"
            )
            return (
                f"CUTLASS MXFP8 MoE runs on SM100/SM103 only, not sm={sm} ({hint}); serve MXFP8 on SM100/SM103 "
                "or set the daemon's format to block_fp8"
            )
        if mxfp8_reload is not True:
            return (
                "this TensorRT-LLM build has no MXFP8 MoE reload path (MXFP8CutlassFusedMoEMethod with its "
                "scale swizzle in process_weights_after_loading): upgrade TensorRT-LLM, or set the daemon's "
                "format to block_fp8"
            )
    return None


def backend_table() -> list[tuple[str, str, int, str, str | None]]:
    """Every (format, requested backend, SM) -> (resolved class, refusal or None): the table
    docs/engines.md shows (``tests/test_adapter_trtllm.py`` checks the doc against it)."""
    rows = []
    for fmt in (Format.BLOCK_FP8, Format.FP8_PER_TENSOR, Format.MXFP8):
        for req in REQUESTED_BACKENDS:
            for sm in TABLE_SMS:
                resolved = resolve_moe_backend(req, fmt, sm)
                rows.append((fmt.value, req, sm, resolved, backend_refusal(fmt, resolved, sm)))
    return rows


def backend_table_markdown() -> str:
    """:func:`backend_table` as the markdown table in docs/engines.md."""
    lines = [
        "| format | moe_config.backend | SM | resolved class | refitd |",
        "|---|---|---|---|---|",
    ]
    for fmt, req, sm, resolved, why in backend_table():
        verdict = "allowed" if why is None else "refused: " + why.replace("|", "/")
        lines.append(f"| {fmt} | {req} | {sm} | {resolved} | {verdict} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# manifest from the engine's parameters

EngineParam = tuple[str, torch.dtype, tuple[int, ...]]
#: a fused MoE module's parameters: ``<module>.experts[.backend].<param>``
_MOE_PARAM_RE = re.compile(r"^(?P<module>.+\.experts)(?:\.backend)?\.(?P<param>[A-Za-z0-9_]+)$")
_MOE_WEIGHTS = ("w3_w1_weight", "w2_weight")
#: a checkpoint module fused by TRT-LLM: checkpoint suffix -> engine module suffix
_FUSED_MODULES = (
    ("self_attn.q_proj", "self_attn.qkv_proj"),
    ("self_attn.k_proj", "self_attn.qkv_proj"),
    ("self_attn.v_proj", "self_attn.qkv_proj"),
    ("linear_attn.in_proj_qkv", "linear_attn.in_proj_qkvz"),
    ("linear_attn.in_proj_z", "linear_attn.in_proj_qkvz"),
    ("linear_attn.in_proj_b", "linear_attn.in_proj_ba"),
    ("linear_attn.in_proj_a", "linear_attn.in_proj_ba"),
    ("shared_expert.gate_proj", "shared_expert.gate_up_proj"),
    ("shared_expert.up_proj", "shared_expert.gate_up_proj"),
    ("mlp.gate_proj", "mlp.gate_up_proj"),
    ("mlp.up_proj", "mlp.gate_up_proj"),
)
_LM_PREFIX = "model.language_model."


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {value!r} in the engine's parameter list")
    return dtype


def _coerce_params(params: Iterable[Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for item in params:
        name, rest = item[0], item[1:]
        if len(rest) == 1 and isinstance(rest[0], torch.Tensor):
            dtype, shape = rest[0].dtype, tuple(rest[0].shape)
        elif len(rest) == 2:
            dtype, shape = _dtype(rest[0]), tuple(int(d) for d in rest[1])
        else:
            raise ValueError(f"cannot read an engine parameter from {item!r}: give (name, dtype, shape)")
        out[str(name)] = (dtype, shape)
    return out


def _moe_format(module: str, params: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Format:
    """The expert format a fused MoE module holds, from its parameter names and dtypes."""
    lacking = [p for p in _MOE_WEIGHTS if p not in params]
    if lacking:
        raise ValueError(f"{module}: no {lacking} among its parameters; is it a TRT-LLM fused MoE module?")
    dtype = params["w3_w1_weight"][0]
    if dtype in FLOAT_DTYPES:
        return Format.BF16
    if dtype != FP8_DTYPE:
        raise ValueError(
            f"{module}.w3_w1_weight is {dtype}: refitd handles bf16 and float8_e4m3fn experts only"
        )
    if "w3_w1_weight_scaling_factor" in params:
        return Format.BLOCK_FP8
    if "fc31_dequant" in params or "fc31_input_dequant" in params:
        return Format.FP8_PER_TENSOR
    if "w3_w1_weight_scale" in params:
        return Format.MXFP8
    raise ValueError(f"{module}: float8 experts with scales {sorted(params)} that refitd does not know")


def _linear_format(scales: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Format:
    """The format of an FP8 linear (non-expert) from its scale parameters."""
    if "weight_scale_inv" in scales:
        return Format.BLOCK_FP8
    dtype = scales.get("weight_scale", (torch.float32, ()))[0]
    if dtype in (torch.uint8, torch.int32):
        return Format.MXFP8
    return Format.FP8_PER_TENSOR


def _engine_module(ckpt_module: str) -> str:
    """The TRT-LLM module a checkpoint module loads into (Qwen3.5 strips ``language_model``)."""
    name = "model." + ckpt_module[len(_LM_PREFIX) :] if ckpt_module.startswith(_LM_PREFIX) else ckpt_module
    for ckpt_suffix, engine_suffix in _FUSED_MODULES:
        if name.endswith("." + ckpt_suffix):
            return name[: -len(ckpt_suffix)] + engine_suffix
    return name


def _quantized(name: str, shape: tuple[int, ...], fmt: Format) -> list[ManifestTensor]:
    scale_shape = fmt.scale_shape(shape)
    return [
        ManifestTensor(name, FP8_DTYPE, shape),
        ManifestTensor(f"{name.removesuffix('.weight')}.{fmt.scale_suffix}", fmt.scale_dtype, scale_shape),
    ]


def _expand_slab(name: str, shape: tuple[int, ...], fmt: Format) -> list[ManifestTensor]:
    """A grouped slab as the per-expert FP8 tensors refitd publishes for it (SPEC §2.3)."""
    m = SLAB_RE.match(name)
    prefix, proj = m.group("prefix"), m.group("proj")
    experts, rows, cols = shape
    projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
    out_rows = rows // 2 if proj == "gate_up_proj" else rows
    out: list[ManifestTensor] = []
    for e in range(experts):
        for p in projs:
            out += _quantized(f"{prefix}.{e}.{p}.weight", (out_rows, cols), fmt)
    return out


def build_manifest(
    params: Iterable[Any],
    hf_config: Mapping[str, Any],
    *,
    moe_backend: str,
    requested_backend: str = "",
    sm: int | None = None,
    tp_size: int = 1,
    moe_tp_size: int | None = None,
    moe_ep_size: int = 1,
    engine_version: str = "",
    input_scales: bool | None = None,
    quant_method: str = "",
    mxfp8_reload_path: bool | None = None,
) -> Manifest:
    """The manifest of a TRT-LLM model: the *checkpoint* tensors it expects, in global shapes.

    ``params`` is the model's ``named_parameters()`` as ``(name, dtype, shape)`` (or ``(name,
    tensor)``); ``moe_backend`` the resolved MoE class name. Fused MoE modules (``w3_w1_weight``,
    ``w2_weight`` and their scales) are mapped back to one tensor per expert and projection as refitd
    publishes them; a module held in BF16 keeps the checkpoint's own expert tensors (a Qwen3.5 slab
    stays a slab). Everything else is the checkpoint's BF16 tensor, unless the engine holds its
    module in FP8 (then the manifest says so, and :func:`check_trtllm_constraints` objects).
    Per-tensor FP8 ``input_scale`` tensors are not listed: refitd does not publish them; the worker
    extension carries the engine's own static input scales into every reload (``constraints``).
    Layers the engine does not hold (pipeline parallelism, no MTP) are left out. ``quant_method`` is
    the MoE modules' resolved quant method class and ``mxfp8_reload_path`` whether the build has the
    MXFP8 reload path (both recorded in ``info``; :func:`backend_refusal` reads them).
    """
    engine = _coerce_params(params)
    model = get_model(model_type_of(hf_config))
    moe_params: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = defaultdict(dict)
    linear_params: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = defaultdict(dict)
    for name, value in engine.items():
        if m := _MOE_PARAM_RE.match(name):
            moe_params[m.group("module")][m.group("param")] = value
        else:
            module, _, leaf = name.rpartition(".")
            linear_params[module][leaf] = value
    moe_format: dict[Layer, Format] = {
        layer_of_name(mod + "."): _moe_format(mod, p) for mod, p in moe_params.items()
    }
    quantized = sorted({f.value for f in moe_format.values() if f.quantized})
    if len(quantized) > 1:
        raise ValueError(f"the engine's routed experts mix formats {quantized}; refitd publishes one format")
    expert_format = Format(quantized[0]) if quantized else Format.BF16
    fp8_linears = {
        mod: _linear_format(p) for mod, p in linear_params.items() if p.get("weight", (None,))[0] == FP8_DTYPE
    }
    held_layers = {layer_of_name(n) for n in engine} | {None}
    include_mtp = any(isinstance(layer, tuple) for layer in held_layers)

    tensors: list[ManifestTensor] = []
    for name, shape, dtype in model.parameters(hf_config, include_mtp=include_mtp):
        layer = layer_of_name(name)
        if layer not in held_layers:
            continue
        routed = SLAB_RE.match(name) or PER_EXPERT_RE.match(name)
        if routed:
            fmt = moe_format.get(layer, Format.BF16)
            if not fmt.quantized:
                tensors.append(ManifestTensor(name, dtype, shape))
            elif SLAB_RE.match(name):
                tensors += _expand_slab(name, shape, fmt)
            else:
                tensors += _quantized(name, shape, fmt)
            continue
        module = name.removesuffix(".weight")
        fmt = fp8_linears.get(_engine_module(module)) if name.endswith(".weight") else None
        tensors += _quantized(name, shape, fmt) if fmt else [ManifestTensor(name, dtype, shape)]

    text = model.text_config(hf_config)
    moe_tp = tp_size if moe_tp_size is None else moe_tp_size
    constraints = EngineConstraints(
        engine=EngineKind.TRTLLM,
        expert_format=expert_format,
        hidden_size=int(text["hidden_size"]) if text.get("hidden_size") else None,
        intermediate_size=int(text["moe_intermediate_size"]) if text.get("moe_intermediate_size") else None,
        moe_tp_size=moe_tp,
        moe_ep_size=moe_ep_size,
        block_fp8_align=BLOCK_FP8_MOE_ALIGN,
        mxfp8_align=MXFP8_MOE_ALIGN,
        unsupported_formats=frozenset(Format(f) for f in _unsupported_formats(moe_backend)),
    )
    info = {
        "model_type": model.model_type,
        "requested_moe_backend": requested_backend,
        "sm": sm,
        "tp_size": tp_size,
        "hidden_size": text.get("hidden_size"),
        "moe_intermediate_size": text.get("moe_intermediate_size"),
        "moe_modules": len(moe_params),
        "bf16_moe_modules": sum(not f.quantized for f in moe_format.values()),
        "input_scales": None if input_scales is None else bool(input_scales),
        "moe_quant_method": quant_method,
        "mxfp8_reload_path": mxfp8_reload_path,
    }
    return Manifest(
        engine=EngineKind.TRTLLM,
        engine_version=engine_version,
        moe_backend=moe_backend,
        expert_format=expert_format,
        tensors=tuple(tensors),
        constraints=constraints,
        info=info,
    )


def _unsupported_formats(moe_backend: str) -> list[str]:
    quantized = [f.value for f in Format if f.quantized]
    supported = {
        MoeBackend.CUTLASS: quantized,
        MoeBackend.TRTLLM_GEN: [Format.BLOCK_FP8.value],
        MoeBackend.CUTEDSL: [Format.BLOCK_FP8.value],
        MoeBackend.DEEPGEMM: [Format.BLOCK_FP8.value],
    }.get(moe_backend, quantized)
    return [f for f in quantized if f not in supported]


# --------------------------------------------------------------------------------------------------
# constraints


def _routed_weight(name: str) -> bool:
    base = re.sub(r"\.(weight_scale_inv|weight_scale|input_scale)$", ".weight", name)
    return bool(SLAB_RE.match(base) or PER_EXPERT_RE.match(base))


def check_trtllm_constraints(manifest: Manifest, config: Mapping[str, Any] | None = None) -> list[str]:
    """Every reason this TRT-LLM engine cannot take refitd's generations; empty means fine.

    ``config`` is the model's Hugging Face config (for H and I; default: what the manifest recorded).
    Checks the resolved MoE backend against the expert format, the kernels' alignment per
    tensor-parallel rank (the manifest's :class:`EngineConstraints`, which the daemon runs too),
    static input scales for per-tensor FP8, and non-expert modules the engine holds in FP8 (refitd
    publishes them BF16). ``EngineWorker.attach`` runs it before contacting the daemon.
    """
    problems: list[str] = []
    fmt, backend = manifest.expert_format, manifest.moe_backend
    sm = manifest.info.get("sm")
    hidden = inter = None
    if config is not None:
        text = get_model(model_type_of(config)).text_config(config)
        hidden, inter = int(text["hidden_size"]), int(text["moe_intermediate_size"])
    backends = [b for b in str(backend).split(",") if b] or [""]
    for one in backends:  # a model whose layers resolved differently lists every class
        why = backend_refusal(
            fmt,
            one,
            sm,
            quant_method=str(manifest.info.get("moe_quant_method") or ""),
            mxfp8_reload=manifest.info.get("mxfp8_reload_path"),
        )
        if why is not None:
            problems.append(why)
    # backend_refusal names the backend that cannot hold the format, with the setting that can
    shared = replace(manifest.constraints, unsupported_formats=frozenset())
    problems += shared.problems(hidden=hidden, intermediate=inter)
    if fmt is Format.FP8_PER_TENSOR and manifest.info.get("input_scales") is not True:
        problems.append(
            "per-tensor FP8 MoE needs a static input_scale for every expert, which refitd does not "
            "publish: load a calibrated per-tensor FP8 checkpoint (load_format='auto') so the engine "
            "holds them, or pass input_scale= to refit_attach"
        )
    fp8_modules = sorted(
        {
            t.name.removesuffix(".weight")
            for t in manifest.tensors
            if t.dtype == FP8_DTYPE and not _routed_weight(t.name)
        }
    )
    if fp8_modules:
        shown = ", ".join(fp8_modules[:8]) + (
            f" and {len(fp8_modules) - 8} more" if len(fp8_modules) > 8 else ""
        )
        problems.append(
            f"the engine holds {len(fp8_modules)} non-expert modules in FP8 ({shown}), but refitd publishes "
            "everything outside the routed experts in BF16; list them in modules_to_not_convert "
            "(trtllm_llm_args does)"
        )
    return problems


# --------------------------------------------------------------------------------------------------
# LLM(...) kwargs from the RefitSpec

#: modules TRT-LLM must keep BF16 besides the routed experts, in TRT-LLM module names (fnmatch);
#: Qwen3.5 from NeMo-RL PR #3677 (nemo_rl/models/generation/trtllm/quantization/fp8.py)
_NOT_CONVERT = {
    "qwen3_moe": (
        "model.layers.*.self_attn*",
        "model.layers.*.mlp.gate",
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    ),
    "qwen3_5_moe": (
        "model.layers.*.self_attn*",
        "model.layers.*.linear_attn*",
        "model.layers.*.mlp.gate",
        "model.layers.*.mlp.shared_expert*",
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    ),
}
_MTP_NOT_CONVERT = ("self_attn*", "linear_attn*", "mlp.gate", "mlp.shared_expert*")
_MTP_TOP_NOT_CONVERT = ("mtp.fc*", "mtp.norm*", "mtp.pre_fc_norm_embedding*", "mtp.pre_fc_norm_hidden*")


def _layer_key(layer: Layer) -> tuple[int, int]:
    return (1, layer[1]) if isinstance(layer, tuple) else (0, layer if layer is not None else -1)


def _engine_layer(layer: Layer) -> str:
    return f"mtp.layers.{layer[1]}" if isinstance(layer, tuple) else f"model.layers.{layer}"


def _kept_expert_modules(hf_config: Mapping[str, Any], spec: RefitSpec) -> list[str]:
    """TRT-LLM MoE modules whose experts the refit plan keeps BF16; whole layers only."""
    plan = plan_from_hf_config(hf_config, spec)
    kept: dict[Layer, set[bool]] = defaultdict(set)
    for unit in plan.units:
        if unit.kind is UnitKind.PASSTHROUGH and unit.keep_reason is None:
            continue
        kept[unit.layer].add(unit.kind is UnitKind.PASSTHROUGH)
    mixed = [lay for lay, kinds in kept.items() if len(kinds) > 1]
    if mixed:
        raise ValueError(
            f"the refit plan keeps only part of the routed experts of layer(s) {mixed} in BF16; TRT-LLM "
            "quantizes a whole MoE module, so ignore_patterns must cover whole layers' experts"
        )
    layers = sorted((lay for lay, kinds in kept.items() if kinds == {True}), key=_layer_key)
    return [f"{_engine_layer(lay)}.mlp.experts" for lay in layers]


def _modules_to_not_convert(hf_config: Mapping[str, Any], spec: RefitSpec) -> list[str]:
    model = spec.model
    out = list(_NOT_CONVERT[model.model_type])
    mtp = int(model.text_config(hf_config).get("mtp_num_hidden_layers", 0) or 0) if model.has_mtp else 0
    for n in range(mtp):
        out += [f"mtp.layers.{n}.{p}" for p in _MTP_NOT_CONVERT]
    if mtp:
        out += list(_MTP_TOP_NOT_CONVERT)
    return out + _kept_expert_modules(hf_config, spec)


def trtllm_llm_args(
    spec: RefitSpec,
    hf_config: Mapping[str, Any],
    *,
    sm: int | None = None,
    moe_backend: str | None = None,
    load_format: str = "dummy",
    extension_cls: str = EXTENSION_QUALNAME,
) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments that make TRT-LLM hold exactly what refitd publishes for ``spec``.

    The quantization config is the Hugging Face form TRT-LLM reads from ``model_kwargs``; it lists in
    ``modules_to_not_convert`` every non-expert module and every MoE module the refit plan keeps in
    BF16. The MoE backend keeps FP32 block scales (TRTLLM on Blackwell, else CUTLASS; never DEEPGEMM).
    ``load_format='dummy'`` leaves the weights for the first refit to fill; per-tensor FP8 needs a
    calibrated checkpoint instead (its static input scales are not published by refitd).
    """
    fmt = spec.format
    if spec.model.model_type != get_model(model_type_of(hf_config)).model_type:
        raise ValueError(f"the spec is for {spec.model_type} but the config describes another model")
    if fmt is Format.FP8_PER_TENSOR and load_format == "dummy":
        raise ValueError(
            "per-tensor FP8 MoE needs calibrated static input scales that refitd does not publish: load a "
            "per-tensor FP8 checkpoint (load_format='auto'), whose input_scale tensors the adapter carries "
            "over on every refit"
        )
    requested = (moe_backend or ("TRTLLM" if fmt is Format.BLOCK_FP8 and sm in SM100F else "CUTLASS")).upper()
    why = backend_refusal(fmt, resolve_moe_backend(requested, fmt, sm), sm)
    if why is not None:
        raise ValueError(f"moe_config backend {requested!r} with {fmt.value} experts: {why}")
    args: dict[str, Any] = {
        "load_format": load_format,
        "dtype": "bfloat16",
        "moe_config": {"backend": requested},
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": extension_cls,
    }
    if not fmt.quantized:
        return args
    not_convert = _modules_to_not_convert(hf_config, spec)
    quant: dict[str, Any]
    if fmt is Format.BLOCK_FP8:
        quant = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": not_convert,
        }
    elif fmt is Format.MXFP8:
        quant = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "modules_to_not_convert": not_convert}
    else:
        quant = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": not_convert}
    args["model_kwargs"] = {"quantization_config": quant}
    return args


# --------------------------------------------------------------------------------------------------
# engine-touching surface: the Ray worker extension


def _require_tensorrt_llm() -> Any:
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise RuntimeError(
            "adapters.trtllm.RefitWorkerExtension runs inside TensorRT-LLM's Ray workers and needs "
            "tensorrt_llm importable there (pip install tensorrt-llm); the pure helpers "
            "(trtllm_llm_args, build_manifest, check_trtllm_constraints) work without it"
        ) from exc
    return tensorrt_llm


def _moe_impl(module: torch.nn.Module) -> torch.nn.Module:
    """The module holding a MoE layer's weights: a ``ConfigurableMoE``'s ``backend`` (the default with
    ``ENABLE_CONFIGURABLE_MOE=1``), else the layer itself."""
    impl = getattr(module, "backend", None)
    return impl if isinstance(impl, torch.nn.Module) else module


def _resolved_moe(module: torch.nn.Module) -> str:
    return type(_moe_impl(module)).__name__


def _moe_quant_method(model: torch.nn.Module) -> str:
    """The resolved quant method class of the model's MoE modules (``CutlassFusedMoE._get_quant_method``
    may pick the DeepGEMM block-FP8 method); several joined by commas, "" when none says."""
    names = set()
    for name, m in model.named_modules():
        if name.endswith(".experts"):
            method = getattr(_moe_impl(m), "quant_method", None)
            if method is not None:
                names.add(type(method).__name__)
    return ",".join(sorted(names))


def _mxfp8_reload_path() -> bool:
    """Whether this TensorRT-LLM build has the MXFP8 MoE reload path: ``MXFP8CutlassFusedMoEMethod``
    exists and swizzles its scales in its own ``process_weights_after_loading`` (older builds swizzle
    while loading, which a partial reload cannot redo, or cannot run the MXFP8 MoE forward at all)."""
    try:
        from tensorrt_llm._torch.modules.fused_moe import quantization
    except ImportError:
        return False
    method = getattr(quantization, "MXFP8CutlassFusedMoEMethod", None)
    return method is not None and "process_weights_after_loading" in vars(method)


def _sync_copies(device: torch.device) -> None:
    """Wait for the host-to-device copies queued on ``device``'s current stream: TRT-LLM's loader
    reads the tensors from worker threads that do not order themselves after that stream."""
    torch.cuda.current_stream(device).synchronize()


class RefitWorkerExtension:
    """Mixed into TRT-LLM's Ray GPU worker (``ray_worker_extension_cls``); ``self.engine`` is its
    PyExecutor and ``self.device_id`` its GPU. Every attribute is prefixed ``refit_`` / ``_refit_``
    because TRT-LLM refuses an extension that shadows a worker attribute.

        llm._collective_rpc("refit_attach", args=(endpoint,))
        results = llm._collective_rpc("refit_load", args=(step, 600.0))
        llm._collective_rpc("refit_detach")
    """

    def refit_attach(
        self,
        endpoint: str,
        name: str | None = None,
        input_scale: float | None = None,
        hf_config: Mapping[str, Any] | None = None,
    ) -> dict:
        """Attach this worker to the daemon with the model's manifest (refused if plans differ).

        ``hf_config`` is the config the daemon plans from (default: the engine's pretrained config);
        pass it when they differ in form (a Qwen3.5 multimodal config names its text weights
        ``model.language_model.*``). ``input_scale`` gives per-tensor FP8 experts a calibrated static
        activation scale when the engine holds none (dummy load).
        """
        from adapters.engine import EngineWorker

        tensorrt_llm = _require_tensorrt_llm()
        model = self.engine.model_engine.model
        if hf_config is None:
            pretrained = model.model_config.pretrained_config
            hf_config = pretrained.to_dict() if hasattr(pretrained, "to_dict") else dict(vars(pretrained))
        self._refit_fp8_input = self._refit_capture_input_scales(model, input_scale)
        manifest = self._refit_manifest(model, getattr(tensorrt_llm, "__version__", ""), hf_config)
        self._refit_format = manifest.expert_format
        rank = getattr(self.engine.model_engine, "global_rank", None)
        self._refit_worker = EngineWorker(
            endpoint,
            name=name or f"trtllm-{rank if rank is not None else self.device_id}",
            manifest=manifest,
            load=self._refit_apply,
            check=lambda m: check_trtllm_constraints(m, hf_config),
        )
        info = self._refit_worker.attach()
        return {"moe_backend": manifest.moe_backend, "expert_format": manifest.expert_format.value, **info}

    def refit_load(self, min_step: int | None = None, timeout: float | None = None) -> dict:
        """Wait for a generation (the engine keeps serving), load it with the engine drained,
        acknowledge it to the daemon; returns a LoadResult as a dict.

        A load that fails after the reload began leaves this worker's weights torn: the error goes
        to the daemon and to ``refit_engine``'s caller, which must not serve before the next
        successful refit (every generation is complete, so it repairs everything).
        """
        worker = getattr(self, "_refit_worker", None)
        if worker is None:
            raise RuntimeError(
                "refit_load before refit_attach: call llm._collective_rpc('refit_attach', ...) first"
            )
        return worker.load_next(min_step=min_step, timeout=timeout).to_dict()

    def refit_detach(self) -> None:
        worker = getattr(self, "_refit_worker", None)
        if worker is not None:
            worker.detach()
            self._refit_worker = None

    # ---- internals

    def _refit_manifest(self, model: torch.nn.Module, version: str, hf_config: Mapping[str, Any]) -> Manifest:
        from tensorrt_llm._utils import get_sm_version

        config = model.model_config
        mapping = config.mapping
        backends = {_resolved_moe(m) for n, m in model.named_modules() if n.endswith(".experts")}
        params = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
        return build_manifest(
            params,
            hf_config,
            moe_backend=",".join(sorted(backends)) if len(backends) > 1 else next(iter(backends), ""),
            quant_method=_moe_quant_method(model),
            mxfp8_reload_path=_mxfp8_reload_path(),
            requested_backend=str(getattr(config, "moe_backend", "")),
            sm=get_sm_version(),
            tp_size=mapping.tp_size,
            moe_tp_size=getattr(mapping, "moe_tp_size", mapping.tp_size),
            moe_ep_size=getattr(mapping, "moe_ep_size", 1),
            engine_version=version,
            input_scales=bool(self._refit_fp8_input) or None,
        )

    def _refit_capture_input_scales(self, model: torch.nn.Module, override: float | None) -> dict:
        """Per-tensor FP8 MoE modules' static input scales, read once at attach: {module: (fc31, fc2)}.

        After loading only the maxima survive (``fc31_input_dequant``, ``1 / fc2_quant``); giving every
        expert those values reproduces the same maxima on reload (``1 / fc2_quant`` to within one
        rounding, taken once here, so it does not drift across refits). Dummy-loaded (uniform in
        [-1e-3, 1e-3]) or non-positive scales are not usable: the manifest then says so and the attach
        is refused, unless ``override`` gives a calibrated scale.
        """
        scales = {}
        for name, layer in model.named_modules():
            m = _moe_impl(layer)  # ConfigurableMoE: the parameters live on its backend
            if not (
                name.endswith(".experts") and hasattr(m, "fc31_input_dequant") and hasattr(m, "fc2_quant")
            ):
                continue
            if override is not None:
                fc31 = fc2 = float(override)
            else:
                fc31 = float(m.fc31_input_dequant.detach().float().cpu())
                fc2 = 1.0 / float(m.fc2_quant.detach().float().cpu())
            if not (fc31 > 0 and fc2 > 0 and fc31 < float("inf") and fc2 < float("inf")):
                return {}
            scales[name] = (fc31, fc2, int(m.num_experts))
        return scales

    def _refit_input_scale_tensors(self) -> dict[str, torch.Tensor]:
        """``{module}.{e}.{gate|up|down}_proj.input_scale`` for every expert (the mappers rename them
        with the weights; a TRT-LLM module name is also a valid checkpoint prefix for them)."""
        out = {}
        for module, (fc31, fc2, experts) in self._refit_fp8_input.items():
            a, b = torch.tensor(fc31, dtype=torch.float32), torch.tensor(fc2, dtype=torch.float32)
            for e in range(experts):
                out[f"{module}.{e}.gate_proj.input_scale"] = a
                out[f"{module}.{e}.up_proj.input_scale"] = a
                out[f"{module}.{e}.down_proj.input_scale"] = b
        return out

    def _refit_apply(self, gen: Any) -> None:
        """Load one generation with the engine drained (``control_action``, as rlhf_utils does)."""
        with self.engine.control_action():
            self._refit_reload(gen)
            self._refit_finalize()

    def _refit_reload(self, gen: Any) -> None:
        """``pre_reload_weights`` once, then one partial ``reload`` per layer (copied host to device)."""
        model_engine = self.engine.model_engine
        model = model_engine.model
        device = torch.device("cuda", torch.cuda.current_device())
        live = [m for m in model.modules() if not getattr(m, "_weights_removed", False)]
        for module in live:  # capability preflight first: nothing is torn if a module refuses
            if hasattr(module, "check_reload_capability"):
                module.check_reload_capability()
        for module in live:
            if hasattr(module, "pre_reload_weights"):
                module.pre_reload_weights()
        groups: dict[Layer, list[str]] = defaultdict(list)
        for name in gen.tensors:
            groups[layer_of_name(name)].append(name)
        extra = self._refit_input_scale_tensors() if self._refit_format is Format.FP8_PER_TENSOR else {}
        for layer, names in groups.items():
            # one layer per call: Qwen3.5's mapper packs in_proj_qkv+z and in_proj_b+a within a call
            weights = {n: gen.tensors[n].to(device, non_blocking=True) for n in names}
            weights.update({n: t.to(device) for n, t in extra.items() if layer_of_name(n) == layer})
            _sync_copies(device)  # the loader's threads must not read half-copied tensors
            model_engine.model_loader.reload(model, weights, allow_partial_loading=True)
            del weights

    def _refit_finalize(self) -> None:
        """Exactly rlhf_utils.WorkerExtension.update_weights(None): process + post-load every module,
        finalize the MoE load balancer, reset the prefix cache, release cached memory."""
        model_engine = self.engine.model_engine
        for module in model_engine.model.modules():
            if getattr(module, "_weights_removed", False):
                continue
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
            if hasattr(module, "post_load_weights"):
                module.post_load_weights()
        balancer = getattr(model_engine, "moe_load_balancer", None)
        if balancer is not None and hasattr(balancer, "finalize_model"):  # a MoeLoadBalancer
            balancer.register_weight_slots_after_to_cuda()
            balancer.finalize_model()
        torch.cuda.synchronize()
        self.engine.reset_prefix_cache()
        torch.cuda.empty_cache()


def refit_engine(llm: Any, min_step: int | None = None, timeout: float | None = None) -> list[Any]:
    """Load the next generation (step >= ``min_step``) on every worker of ``llm``; checked results.

    Raises RefitError naming every failed worker; no result at all is a failure too.
    """
    from adapters.engine import check_results

    started = time.monotonic()
    results = llm._collective_rpc("refit_load", args=(min_step, timeout))
    checked = check_results(list(results or []), step=min_step)
    log.info(
        "trtllm refit: %d workers loaded step >= %s in %.2fs",
        len(checked),
        min_step,
        time.monotonic() - started,
    )
    return checked
