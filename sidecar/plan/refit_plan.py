"""The :class:`RefitPlan`: every input, unit and output of one refit, built from names and shapes
(``sidecar.plan.build`` tells the whole story and is where callers import it from)."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.numerics.formats import Format
from sidecar.plan.classify import classify
from sidecar.plan.spec import (
    _APPENDED_MTP_RE,
    EngineLayout,
    KeepReason,
    Layer,
    OutputSpec,
    RefitSpec,
    TensorSpec,
    Unit,
    _layer_in,
    _module_name,
    layer_of_name,
)
from sidecar.plan.units import _make_units, _node_share, _validate

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitPlan:
    """Every input, every unit of work and every output of one refit, in a deterministic order.

    ``outputs`` follow input order, then expert order, then gate/up/down, each weight before its
    scale. Build with :meth:`build`; a plan is immutable and holds no tensors.
    """

    spec: RefitSpec
    num_hidden_layers: int
    inputs: tuple[TensorSpec, ...]
    units: tuple[Unit, ...]
    outputs: tuple[OutputSpec, ...]
    keep_bf16: frozenset[str]
    _units_of_input: Mapping[str, tuple[int, ...]]
    #: a node's share: the engine layout and the node this plan publishes for (None: the whole model)
    share: tuple[EngineLayout, int] | None = None
    #: inputs outside the node's share: per-expert tensors of other nodes' experts, not planned
    dropped: frozenset[str] = frozenset()
    #: every input given to :meth:`build`, the dropped ones included: what a re-plan of the same
    #: share starts from (the attach check re-plans for an engine's BF16 modules)
    source: tuple[TensorSpec, ...] = ()
    #: ``units_for_input``'s answers, made once (the daemon asks for every input of every step)
    _input_units: Mapping[str, tuple[Unit, ...]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "_input_units",
            {n: tuple(self.units[i] for i in ix) for n, ix in self._units_of_input.items()},
        )

    @classmethod
    def build(
        cls,
        specs: Iterable[TensorSpec | tuple[Any, ...]],
        spec: RefitSpec,
        *,
        keep_bf16: Collection[str] = (),
        share: tuple[EngineLayout, int] | None = None,
        split_slabs: bool = False,
    ) -> RefitPlan:
        """Plan a refit of ``specs`` (TensorSpec, ``(name, shape, dtype)`` or ``(name, tensor)``).

        Each input keeps its own dtype: a non-BF16 input that is not quantized (the FP32 router bias)
        passes through bit for bit, and staging and wire sizes follow it. ``keep_bf16`` are module
        names the engine's manifest holds in BF16 (the tensor name without ``.weight``; a slab's own
        name); a routed expert or linear listed there passes through whatever else the spec says.
        ``share=(layout, node)`` plans only what ``node`` of an :class:`EngineLayout` holds: routed
        experts outside its expert-parallel share are left out (per-expert inputs are ``dropped``,
        slabs publish only the node's experts). ``split_slabs``: a slab kept unquantized publishes
        its experts under per-expert names, as a quantized slab does (:meth:`rebuild_for` asks for it
        when the plan it follows lists per-expert names). Raises ValueError listing every problem found.
        """
        inputs = source = tuple(TensorSpec.coerce(s) for s in specs)
        dupes = sorted(n for n, c in Counter(i.name for i in inputs).items() if c > 1)
        if dupes:
            raise ValueError(f"input names must be unique; repeated: {dupes}")
        fmt, model = spec.format, spec.model
        keep = frozenset(_module_name(n) for n in keep_bf16)
        num_layers = cls._resolve_layers(inputs, spec)
        layers = {i.name: _layer_in(i.name, model, num_layers) for i in inputs}

        routed = {i.name: r for i in inputs if (r := classify(i, model, layers[i.name])) is not None}
        reasons = {n: cls._keep_reason(n, r.layer, spec, num_layers, keep) for n, r in routed.items()}
        candidates = {
            i.name: i
            for i in inputs
            if spec.quantize_linears
            and model.linear_re is not None
            and i.name not in routed
            and len(i.shape) == 2
            and model.linear_re.match(i.name)
        }
        linears = {
            n: t
            for n, t in candidates.items()
            if cls._keep_reason(n, layers[n], spec, num_layers, keep) is None
        }
        _validate(routed, reasons, fmt, linears, spec.params)
        held, dropped = None, frozenset()
        if share is not None:
            held, dropped = _node_share(routed, *share)
            inputs = tuple(i for i in inputs if i.name not in dropped)
        units = _make_units(inputs, routed, reasons, fmt, layers, linears, held, spec, split_slabs)
        outputs = tuple(o for u in units for o in u.outputs)
        clashes = sorted(n for n, c in Counter(o.name for o in outputs).items() if c > 1)
        if clashes:
            raise ValueError(
                f"two inputs produce the same output names {clashes[:5]}: a layer holds both grouped "
                "slabs and per-expert tensors; send one form only"
            )
        log.debug(
            "refit plan %s/%s: %d inputs -> %d units -> %d outputs (%d layers)",
            spec.model_type,
            fmt.value,
            len(inputs),
            len(units),
            len(outputs),
            num_layers,
        )
        units_of: dict[str, list[int]] = defaultdict(list)
        for u in units:
            for n in u.inputs:
                units_of[n].append(u.index)
        return cls(
            spec=spec,
            num_hidden_layers=num_layers,
            inputs=inputs,
            units=tuple(units),
            outputs=outputs,
            keep_bf16=keep,
            _units_of_input={n: tuple(ix) for n, ix in units_of.items()},
            share=share,
            dropped=dropped,
            source=source,
        )

    @staticmethod
    def _resolve_layers(inputs: tuple[TensorSpec, ...], spec: RefitSpec) -> int:
        seen = [lay for i in inputs if isinstance(lay := layer_of_name(i.name), int)]
        if spec.model.mtp_in_layers:  # MTP layers follow the decoder layers: the first holds eh_proj
            mtp = [int(m.group(1)) for i in inputs if (m := _APPENDED_MTP_RE.search(i.name))]
            if spec.num_hidden_layers is None and mtp:
                seen = [lay for lay in seen if lay < min(mtp)]
            elif spec.num_hidden_layers is not None:
                seen = [lay for lay in seen if lay < spec.num_hidden_layers]
        if spec.num_hidden_layers is None:
            num_layers = max(seen) + 1 if seen else 0
            spec.check_layer_counts(num_layers)
            return num_layers
        if seen and max(seen) >= spec.num_hidden_layers:
            raise ValueError(
                f"an input names layer {max(seen)} but num_hidden_layers is {spec.num_hidden_layers}; "
                "give the model's real layer count (or None to infer it from the names)"
            )
        return spec.num_hidden_layers

    @staticmethod
    def _keep_reason(
        name: str, layer: Layer, spec: RefitSpec, num_layers: int, keep: frozenset[str]
    ) -> KeepReason | None:
        module = _module_name(name)
        if spec.format is Format.BF16:
            return KeepReason.FORMAT_BF16
        if module in keep:
            return KeepReason.MANIFEST
        if isinstance(layer, int):  # MTP layers are not counted by first/last
            if layer < spec.num_first_layers_in_bf16:
                return KeepReason.FIRST_LAYERS
            if layer >= num_layers - spec.num_last_layers_in_bf16:
                return KeepReason.LAST_LAYERS
        if any(fnmatch.fnmatchcase(module, p) for p in spec.ignore_patterns):
            return KeepReason.IGNORE_PATTERN
        return None

    # ---- queries

    @property
    def bytes_in(self) -> int:
        return sum(i.nbytes for i in self.inputs)

    @property
    def bytes_out(self) -> int:
        return sum(o.nbytes for o in self.outputs)

    def layer_of(self, unit: Unit) -> Layer:
        """The unit's layer: an int, ("mtp", n) for an MTP layer, or None outside any layer."""
        return unit.layer

    def units_for_input(self, name: str) -> tuple[Unit, ...]:
        """The units that read input ``name`` (one, for every input of the Qwen families)."""
        units = self._input_units.get(name)
        if units is None:
            raise ValueError(f"no input named {name!r} in this plan")
        return units

    def rebuild_for(self, specs: Iterable[TensorSpec | tuple[Any, ...]]) -> RefitPlan | None:
        """This plan for other inputs that publish exactly its outputs, or None when they do not.

        A plan made from a config lists the checkpoint's inputs: per-expert names (Qwen3, DeepSeek-V3,
        GLM-4.5) in the checkpoint's dtype. A trainer may push the same model otherwise: transformers
        5.x holds the routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]`` and
        ``down_proj [E, H, I]``), an FP32 master holds FP32 tensors. When ``specs`` plan to the very
        same outputs (names, dtypes, shapes), the plan for them is returned, its outputs in this
        plan's order: a generation laid out for this plan holds it unchanged. ``self`` when ``specs``
        are this plan's inputs; None when they publish anything else (or do not plan at all): the
        caller reports what differs, against this plan.
        """
        specs = tuple(TensorSpec.coerce(s) for s in specs)
        if set(specs) == set(self.source or self.inputs):
            return self
        mine = {o.name: o for o in self.outputs}
        # slabs kept unquantized (BF16 format, first/last BF16 layers) publish per expert when this
        # plan's outputs are per-expert, as quantized slabs always do
        for split in (False, True):
            try:
                other = RefitPlan.build(
                    specs, self.spec, keep_bf16=self.keep_bf16, share=self.share, split_slabs=split
                )
            except ValueError:
                return None
            theirs = {o.name: o for o in other.outputs}
            if mine.keys() == theirs.keys() and all(
                (o.dtype, o.shape) == (mine[n].dtype, mine[n].shape) for n, o in theirs.items()
            ):
                return dataclasses.replace(other, outputs=tuple(theirs[o.name] for o in self.outputs))
        return None

    def allocate(self, *, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """An empty tensor for every output, in plan order (tests and the CPU path; the daemon
        allocates these in shared memory itself)."""
        return {o.name: torch.empty(o.shape, dtype=o.dtype, device=device) for o in self.outputs}
