"""The plan's vocabulary: the spec a user asks for and the plain data a plan is made of (SPEC §2).

:class:`RefitSpec` (model, format, BF16 exclusions), :class:`EngineLayout` (a node's share of a
multi-node engine), :class:`TensorSpec` (one input: name, dtype, shape), :class:`OutputSpec` (one
output tensor), :class:`Unit` (the inputs one piece of work reads and the outputs it writes), the enums
naming their kinds and the layer helpers. ``sidecar.plan.build`` makes plans out of these; the daemon,
the runners and the adapters read them.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams
from sidecar.plan.models import ModelSpec, get_model

Layer = int | tuple[str, int] | None
MTP = "mtp"
WEIGHT_SUFFIX = ".weight"
#: how many of the largest inputs the summary lists
SUMMARY_LARGEST = 10
_DECODER_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
#: an MTP layer appended to ``model.layers`` (DeepSeek-V3, GLM-4.5): the one holding ``eh_proj``/``enorm``
_APPENDED_MTP_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:eh_proj|enorm|hnorm)\.")


class Role(str, enum.Enum):
    """What an output tensor is: a quantized weight, its scale, or an input passed through."""

    WEIGHT = "weight"
    SCALE = "scale"
    PASSTHROUGH = "passthrough"


class ExpertProj(str, enum.Enum):
    """A routed expert's projection, named as in the checkpoint."""

    GATE = "gate_proj"
    UP = "up_proj"
    DOWN = "down_proj"


class UnitKind(str, enum.Enum):
    PASSTHROUGH = "passthrough"  # one input copied bit for bit (routed experts kept BF16 included)
    SLAB = "slab"  # one grouped slab of one layer, split per expert and quantized
    EXPERT = "expert"  # per-expert projection(s): gate+up of one expert together under fp8_per_tensor
    LINEAR = "linear"  # one non-expert linear weight (attention, dense MLP, shared expert), quantized alone


class KeepReason(str, enum.Enum):
    """Why a routed expert stays BF16 (SPEC §2.2); the first that applies, in this order."""

    FORMAT_BF16 = "format_bf16"
    MANIFEST = "manifest"
    FIRST_LAYERS = "first_layers"
    LAST_LAYERS = "last_layers"
    IGNORE_PATTERN = "ignore_pattern"


# --------------------------------------------------------------------------------------------------
# the spec


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitSpec:
    """What to publish: the model family, the target format and the BF16 exclusions of SPEC §2.2.

    ``num_hidden_layers=None`` means "infer it from the tensor names": the largest ``layers.L`` index
    among non-MTP names, plus one. Give it explicitly (or plan from the config) when the trainer may
    leave out trailing layers, or ``num_last_layers_in_bf16`` would count from the wrong end.
    ``fmt`` accepts a string and ``ignore_patterns`` any collection; they are stored as a
    :class:`Format` and a tuple. Patterns are shell-style ``fnmatch`` (case-sensitive) over module
    names: the tensor name without ``.weight``, or the slab name.

    ``quantize_linears`` widens quantization beyond the routed experts to the linear layers the
    registry names (``ModelSpec.linear_re``: attention projections, dense MLPs, shared experts), as
    block-FP8 checkpoints such as DeepSeek-V3's store them. ``None`` follows the checkpoint: planning
    from a config with ``quantization_config.weight_block_size`` quantizes them (its
    ``modules_to_not_convert`` stay BF16), without one it does not. The BF16 exclusions above (and an
    engine's manifest) narrow it again, module by module.
    """

    model_type: str
    fmt: Format | str
    num_hidden_layers: int | None = None
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    ignore_patterns: tuple[str, ...] | Collection[str] = ()
    quantize_linears: bool | None = None
    #: the checkpoint's dtype (``config.json``'s ``dtype``): passthrough outputs are published in it
    #: (see :meth:`published_dtype`); None publishes each input in its own dtype
    dtype: torch.dtype | str | None = None
    #: the format's parameters the engine decides (INT4 group and scale dtype, NVFP4's names; SPEC
    #: §1.7, §2.3): the daemon takes them from the engine's manifest at attach
    #: (``sidecar.plan.attach.with_engine_params``); those of other formats stay at their defaults
    params: FormatParams = DEFAULT_FORMAT_PARAMS

    def __post_init__(self) -> None:
        get_model(self.model_type)  # raises, listing the known types
        object.__setattr__(self, "fmt", Format.parse(self.fmt))
        if not isinstance(self.params, FormatParams):
            raise ValueError(
                f"RefitSpec params = {self.params!r}: give a sidecar.numerics.formats.FormatParams"
            )
        self.params.check_for(self.fmt)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", _checkpoint_dtype(self.dtype))
        patterns = self.ignore_patterns
        patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        for p in patterns:
            if not isinstance(p, str) or not p:
                raise ValueError(f"ignore_patterns holds {p!r}: each must be a non-empty fnmatch pattern")
        object.__setattr__(self, "ignore_patterns", patterns)
        if self.quantize_linears not in (None, True, False):
            raise ValueError(
                f"quantize_linears = {self.quantize_linears!r}: give True, False or None (the checkpoint's)"
            )
        if self.quantize_linears and self.model.linear_re is None:
            raise ValueError(
                f"quantize_linears: the {self.model_type} registry entry names no quantizable linear layers; "
                "leave it unset"
            )
        for key in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} = {value!r}: give a layer count >= 0")
        layers = self.num_hidden_layers
        if layers is not None:
            if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
                raise ValueError(f"num_hidden_layers = {layers!r}: give a positive count, or None to infer")
            self.check_layer_counts(layers)

    @property
    def model(self) -> ModelSpec:
        return get_model(self.model_type)

    def published_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a passthrough of input ``name`` (of ``dtype``) is published in.

        With :attr:`dtype` set (the checkpoint's), a floating-point input is published as the
        checkpoint holds it: in :attr:`dtype`, except the tensors the model family keeps in FP32
        whatever the checkpoint's dtype (``ModelSpec.fp32_re``: DeepSeek-V3's and GLM-4.5's
        ``e_score_correction_bias``), which are FP32. So an FP32 master's norms and embeddings
        arrive as BF16, the engine's dtype, rounded to nearest even (``Tensor.to``). Without it, or
        for a non-float input, the input's own dtype. Quantized outputs never depend on this: they
        are computed from the input as it arrives (FP32 in is more exact than BF16 in).
        """
        if self.dtype is None or dtype not in _PUBLISHED_FLOATS:
            return dtype
        fp32 = self.model.fp32_re
        return torch.float32 if fp32 is not None and fp32.search(name) else self.dtype  # type: ignore[return-value]

    @property
    def format(self) -> Format:
        """``fmt``, typed as the Format it always is after construction."""
        return Format.parse(self.fmt)

    def check_layer_counts(self, num_hidden_layers: int) -> None:
        first, last = self.num_first_layers_in_bf16, self.num_last_layers_in_bf16
        if first + last > num_hidden_layers:
            raise ValueError(
                f"num_first_layers_in_bf16 ({first}) + num_last_layers_in_bf16 ({last}) exceeds the "
                f"model's {num_hidden_layers} layers; lower one of them (or use fmt='bf16')"
            )


#: the dtypes a passthrough is published in when the checkpoint's dtype is known
_PUBLISHED_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _checkpoint_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)  # type: ignore[assignment]
    if value not in _PUBLISHED_FLOATS:
        raise ValueError(
            f"RefitSpec dtype = {value!r}: the checkpoint's dtype must be one of bfloat16, float16, float32 "
            "(or None to publish every input in its own dtype)"
        )
    return value  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# a node's share of an engine


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLayout:
    """One inference engine's parallel layout across nodes, to plan the share one node publishes.

    The engine runs on ``max(ep, tp)`` GPUs spread evenly over ``nodes`` nodes (with expert
    parallelism the EP group is every GPU: DP x TP). Routed experts are split over the ``ep`` ranks
    in order, as vLLM places them by default (``determine_expert_map``, linear placement):
    rank r holds a contiguous run, the first ``E % ep`` ranks one expert more. Everything else is held
    whole by every node: tensor parallelism stays within a node, whose daemon publishes one copy that
    all of its GPUs read their slices from.

    Usage::

        layout = EngineLayout(ep=16, tp=1, nodes=2)
        plan = plan_from_hf_config(config, spec, share=(layout, 0))   # what node 0 publishes
    """

    ep: int = 1
    tp: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        for key in ("ep", "tp", "nodes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine layout {key} = {value!r}: give a positive integer")
        if self.ep > 1 and self.tp > 1 and self.ep % self.tp:
            raise ValueError(
                f"engine layout ep={self.ep}, tp={self.tp}: the expert-parallel group spans DP x TP, so ep must "
                "be a multiple of tp"
            )
        if self.gpus % self.nodes:
            raise ValueError(
                f"engine layout: {self.gpus} GPUs (max of ep={self.ep}, tp={self.tp}) do not split evenly over "
                f"{self.nodes} nodes; give ep/tp a multiple of nodes"
            )
        if self.tp > self.gpus_per_node:
            raise ValueError(
                f"engine layout: tp={self.tp} spans {self.tp // self.gpus_per_node} nodes of {self.gpus_per_node} "
                "GPUs; refitd plans a node's share for TP within a node (use DP attention + EP across nodes)"
            )

    @property
    def gpus(self) -> int:
        return max(self.ep, self.tp)

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    def check_node(self, node: int) -> None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node {node!r}: the layout has nodes 0..{self.nodes - 1}")

    def experts_of_rank(self, num_experts: int, rank: int) -> range:
        """The experts EP ``rank`` holds of ``num_experts`` (contiguous; the first ``E % ep`` one more)."""
        base, extra = divmod(num_experts, self.ep)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (1 if rank < extra else 0))

    def experts_of_node(self, num_experts: int, node: int) -> range:
        """The experts the engine's GPUs on ``node`` hold: the union of its EP ranks' runs."""
        self.check_node(node)
        if self.ep == 1:
            return range(num_experts)
        ranks_per_node = self.ep // self.nodes
        first = self.experts_of_rank(num_experts, node * ranks_per_node)
        last = self.experts_of_rank(num_experts, (node + 1) * ranks_per_node - 1)
        return range(first.start, last.stop)


# --------------------------------------------------------------------------------------------------
# plan data


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An input tensor, data-free."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def coerce(cls, item: TensorSpec | tuple[Any, ...]) -> TensorSpec:
        """Accept a TensorSpec, ``(name, shape, dtype)`` or ``(name, tensor)``."""
        if isinstance(item, TensorSpec):
            return item
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            return cls(str(item[0]), item[1].dtype, tuple(item[1].shape))
        if isinstance(item, tuple) and len(item) == 3 and isinstance(item[2], torch.dtype):
            return cls(str(item[0]), item[2], tuple(int(d) for d in item[1]))
        raise ValueError(f"cannot read a tensor spec from {item!r}: give TensorSpec or (name, shape, dtype)")


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputSpec:
    """One output tensor and what computes it: ``source[expert][rows[0]:rows[1]]``, quantized (a
    weight), that weight's scale, or ``source`` itself (a passthrough)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    role: Role
    source: str
    expert: int | None = None  # index into a slab's dim 0
    rows: tuple[int, int] | None = None  # row range of a gate_up expert matrix: gate or up
    proj: ExpertProj | None = None
    scale_name: str | None = None  # on a weight: its scale output
    #: on a 4-bit weight: its third output, NVFP4's ``weight_scale_2`` (the global scale; under
    #: compressed-tensors' names ``weight_global_scale``, its reciprocal) or INT4's ``weight_shape``;
    #: None for the other formats
    extra_name: str | None = None

    @property
    def quantized_outputs(self) -> tuple[str, ...]:
        """A weight's output names in the quantizer's ``out=`` order: values, scales[, extra]."""
        return tuple(n for n in (self.name, self.scale_name, self.extra_name) if n is not None)

    def source_view(self, src: torch.Tensor) -> torch.Tensor:
        """The slice of ``src`` this output is computed from: a view, never a copy."""
        view = src if self.expert is None else src[self.expert]
        return view if self.rows is None else view[self.rows[0] : self.rows[1]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """The inputs one piece of work reads and the outputs it writes.

    ``scale_groups`` lists the weight outputs quantized together: a pair sharing one scale (gate and
    up of one expert under fp8_per_tensor) or one weight alone.
    """

    index: int
    kind: UnitKind
    inputs: tuple[str, ...]
    outputs: tuple[OutputSpec, ...]
    layer: Layer
    bytes_in: int
    fmt: Format | None = None  # None: a passthrough
    scale_groups: tuple[tuple[str, ...], ...] = ()
    #: the format's parameters (INT4 group and scale dtype, NVFP4's names): the plan spec's
    params: FormatParams = DEFAULT_FORMAT_PARAMS
    keep_reason: KeepReason | None = None  # set on a routed expert passed through

    @property
    def bytes_out(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def _module_name(name: str) -> str:
    return name.removesuffix(WEIGHT_SUFFIX)


def layer_of_name(name: str) -> Layer:
    """``…layers.L.…`` -> L; ``mtp.layers.N.…`` -> ("mtp", N); anything else -> None."""
    if m := _MTP_LAYER_RE.match(name):
        return (MTP, int(m.group(1)))
    if m := _DECODER_LAYER_RE.search(name):
        return int(m.group(1))
    return None


def _layer_in(name: str, model: ModelSpec, num_hidden_layers: int) -> Layer:
    """:func:`layer_of_name`, with ``layers.L`` for ``L >= num_hidden_layers`` read as MTP layer
    ``L - num_hidden_layers`` for the families that append MTP layers to ``model.layers``."""
    layer = layer_of_name(name)
    if isinstance(layer, int) and (n := model.mtp_layer(layer, num_hidden_layers)) is not None:
        return (MTP, n)
    return layer


def _layer_label(layer: Layer) -> str:
    if layer is None:
        return "-"
    return f"{layer[0]}.{layer[1]}" if isinstance(layer, tuple) else str(layer)


def _layer_sort_key(layer: Layer) -> tuple[int, int]:
    if layer is None:
        return (2, 0)
    return (1, layer[1]) if isinstance(layer, tuple) else (0, layer)
