"""The plan's vocabulary: the spec a user asks for and the plain data a plan is made of (SPEC §2).

:class:`RefitSpec` (model, format, BF16 exclusions), :class:`TensorSpec` (one input: name, dtype,
shape), :class:`OutputSpec` (one output tensor), :class:`Unit` (the inputs one piece of work reads and
the outputs it writes) and the enums naming their kinds. ``sidecar.plan.build`` makes plans out of
these; the daemon, the runners and the adapters read them. No torch work happens here.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.numerics.formats import Format
from sidecar.plan.models import ModelSpec, get_model

#: a layer: a decoder layer index, ("mtp", n) for an MTP layer, or None (embeddings, vision, ...)
Layer = int | tuple[str, int] | None
MTP = "mtp"
WEIGHT_SUFFIX = ".weight"
#: how many of the largest inputs the summary lists
SUMMARY_LARGEST = 10
_DECODER_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")


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
    """

    model_type: str
    fmt: Format | str
    num_hidden_layers: int | None = None
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    ignore_patterns: tuple[str, ...] | Collection[str] = ()

    def __post_init__(self) -> None:
        get_model(self.model_type)  # raises, listing the known types
        object.__setattr__(self, "fmt", Format.parse(self.fmt))
        patterns = self.ignore_patterns
        patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        for p in patterns:
            if not isinstance(p, str) or not p:
                raise ValueError(f"ignore_patterns holds {p!r}: each must be a non-empty fnmatch pattern")
        object.__setattr__(self, "ignore_patterns", patterns)
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


def _layer_label(layer: Layer) -> str:
    if layer is None:
        return "-"
    return f"{layer[0]}.{layer[1]}" if isinstance(layer, tuple) else str(layer)


def _layer_sort_key(layer: Layer) -> tuple[int, int]:
    if layer is None:
        return (2, 0)
    return (1, layer[1]) if isinstance(layer, tuple) else (0, layer)
