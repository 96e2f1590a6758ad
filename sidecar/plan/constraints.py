"""What an engine's resolved MoE kernels need of the routed experts: one frozen type, checked twice.

The adapter that builds a manifest (``adapters.vllm``, ``adapters.trtllm``) fills one
:class:`EngineConstraints` from the engine's settings; :meth:`EngineConstraints.problems` is the rule
(SPEC §2.4), run by the adapter before it contacts the daemon (``adapters.engine.EngineWorker.attach``)
and again by the daemon's attach check (``sidecar.plan.attach``) against the dims of its own plan. One
type and one rule, so the two checks cannot read different keys (they once did: the daemon read
``tp_size`` while the vLLM manifest wrote ``moe_tp_size``, and a TP=4 Qwen3-30B-A3B vLLM worker,
I/tp = 192, attached in block-FP8).

    c = EngineConstraints(engine=EngineKind.VLLM, expert_format=Format.BLOCK_FP8, hidden_size=2048,
                          intermediate_size=768, moe_tp_size=4, block_fp8_align=128)
    c.problems()   # ["block-FP8 MoE needs moe_intermediate_size / tp = 768/4 = 192 ... enable_expert_parallel=True"]

On the wire the constraints are the manifest's ``constraints`` map (:meth:`to_wire` /
:meth:`from_wire`); the engine kind and the expert format travel in the manifest's own fields.
This module imports nothing of refitd but the formats, so adapters and the daemon can share it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.numerics.formats import Format

__all__ = ["EngineConstraints", "EngineKind"]

#: the largest size or alignment a constraint may hold (a bound for values read off the wire)
MAX_VALUE = 1 << 48


class EngineKind(str, enum.Enum):
    REFERENCE = "reference"
    VLLM = "vllm"
    TRTLLM = "trtllm"
    SGLANG = "sglang"


#: per engine: the kernel whose rule a block-FP8 refusal cites, and the settings that fix a TP split
_BLOCK_FP8_KERNEL = {
    EngineKind.VLLM: "vLLM 0.33.0 Fp8MoEMethod: oracle/fp8.py resolve_fp8_moe_weight_block_shape",
    EngineKind.TRTLLM: "DeepSeekFP8BlockScalesFusedMoEMethod asserts it",
    EngineKind.REFERENCE: "SPEC §2.4",
    EngineKind.SGLANG: "SGLang Fp8MoEMethod.create_weights",
}
_MXFP8_KERNEL = {
    EngineKind.VLLM: "vLLM ModelOpt MXFP8 MoE",
    EngineKind.TRTLLM: "CUTLASS packs 4 UE8M0 scales per int32 along K",
    EngineKind.REFERENCE: "SPEC §2.4",
    EngineKind.SGLANG: "SGLang Fp8MoEMethod MXFP8",
}
TP_FIX = {
    EngineKind.VLLM: "pick a tensor_parallel_size that keeps it aligned, or set enable_expert_parallel=True "
    "(experts split whole across ranks, I not split)",
    EngineKind.TRTLLM: "set moe_tensor_parallel_size (or moe_expert_parallel_size, which keeps I whole) so "
    "that each rank's part is aligned",
    EngineKind.REFERENCE: "run the engine with fewer tensor-parallel ranks for the experts",
    EngineKind.SGLANG: "pick a --tp-size that keeps it aligned, or set --ep-size to the TP size (experts split "
    "whole across ranks, I not split)",
}
_INT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "moe_tp_size",
    "moe_ep_size",
    "block_fp8_align",
    "mxfp8_align",
    "block_fp8_refine",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConstraints:
    """The routed experts' shapes an engine's resolved MoE backend can take."""

    engine: EngineKind
    #: the format the engine's routed experts are held in (the manifest's ``expert_format``)
    expert_format: Format
    #: H of the routed experts (None: not known to the adapter; the daemon uses its plan's)
    hidden_size: int | None = None
    #: the whole ``moe_intermediate_size`` I, before any tensor-parallel split (None: not known)
    intermediate_size: int | None = None
    #: how many ways the experts' I is split across ranks (1 under expert parallelism)
    moe_tp_size: int = 1
    #: how many ways the experts themselves are split across ranks (their dims stay whole)
    moe_ep_size: int = 1
    #: block-FP8: I / moe_tp_size must be a multiple of this (None: no rule)
    block_fp8_align: int | None = None
    #: MXFP8: H and I / moe_tp_size must be multiples of this (None: no rule)
    mxfp8_align: int | None = None
    #: block-FP8 where the engine refines the block to fit the TP shard (vLLM 0.33.0
    #: ``oracle/fp8.py refine_fp8_moe_block_shape``: ``gcd(128, I/tp, H)``, at least this, with the
    #: scales upsampled at load): then the whole I must be a multiple of ``block_fp8_align`` and
    #: I / moe_tp_size and H multiples of this (None: I / moe_tp_size itself must be aligned)
    block_fp8_refine: int | None = None
    #: expert formats the resolved backend cannot hold at all
    unsupported_formats: frozenset[Format] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", EngineKind(self.engine))
        object.__setattr__(self, "expert_format", Format.parse(self.expert_format))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            optional = name not in ("moe_tp_size", "moe_ep_size")
            if (value is None and optional) or (type(value) is int and 1 <= value <= MAX_VALUE):
                continue
            raise ValueError(
                f"engine constraint {name!r} must be a positive integer{' or None' if optional else ''}, "
                f"got {value!r}"
            )
        formats = frozenset(Format.parse(f) for f in self.unsupported_formats)
        object.__setattr__(self, "unsupported_formats", formats)

    def problems(self, *, hidden: int | None = None, intermediate: int | None = None) -> list[str]:
        """Every way the routed experts break the engine's rules, one line each naming the setting to
        change; empty when all is well. ``hidden`` / ``intermediate`` (the whole I) override the
        sizes the adapter recorded: the daemon passes its plan's."""
        h = self.hidden_size if hidden is None else hidden
        i = self.intermediate_size if intermediate is None else intermediate
        fmt, tp, fix, out = self.expert_format, self.moe_tp_size, TP_FIX[self.engine], []
        if fmt in self.unsupported_formats:
            out.append(
                f"the engine's resolved MoE backend cannot take {fmt.value} experts; change the engine's MoE "
                "backend or the daemon's format"
            )
        if i is None:
            return out
        if i % tp:
            out.append(f"moe_intermediate_size {i} does not split {tp} ways (tensor-parallel experts); {fix}")
        part = i // tp
        align, refine = self.block_fp8_align, self.block_fp8_refine
        if fmt is Format.BLOCK_FP8 and align and refine:
            if i % align:
                out.append(
                    f"block-FP8 MoE needs moe_intermediate_size = {i} to be a multiple of {align} "
                    f"({_BLOCK_FP8_KERNEL[self.engine]}: a ragged last block cannot be loaded); publish bf16 "
                    "experts for this model"
                )
            elif part % align and (part % refine or (h is not None and h % refine)):
                out.append(
                    f"block-FP8 MoE needs moe_intermediate_size / tp = {i}/{tp} = {part} to be a multiple of "
                    f"{align}, or of {refine} with hidden_size {h} too (the engine refines its {align}-block "
                    f"to gcd({align}, I/tp, H) >= {refine}; {_BLOCK_FP8_KERNEL[self.engine]}); {fix}"
                )
        elif fmt is Format.BLOCK_FP8 and align and part % align:
            out.append(
                f"block-FP8 MoE needs moe_intermediate_size / tp = {i}/{tp} = {part} to be a multiple of "
                f"{align} ({_BLOCK_FP8_KERNEL[self.engine]}); {fix}"
            )
        if fmt is Format.MXFP8 and self.mxfp8_align:
            for label, size in (("hidden_size", h), (f"moe_intermediate_size / tp ({i}/{tp})", part)):
                if size is not None and size % self.mxfp8_align:
                    setting = fix if label != "hidden_size" else "set the daemon's format to block_fp8"
                    out.append(
                        f"MXFP8 MoE needs {label} = {size} to be a multiple of {self.mxfp8_align} "
                        f"({_MXFP8_KERNEL[self.engine]}); {setting}"
                    )
        return out

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _INT_FIELDS}
        out["unsupported_formats"] = sorted(f.value for f in self.unsupported_formats)
        return out

    @classmethod
    def from_wire(
        cls, data: Mapping[str, Any], *, engine: EngineKind | str, expert_format: Format | str
    ) -> EngineConstraints:
        """Parse a manifest's ``constraints`` map; ValueError naming the field (an unknown key is
        refused: a key one side writes and the other never reads is how the TP check was lost)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"'constraints' must be a map, got {type(data).__name__}")
        known = (*_INT_FIELDS, "unsupported_formats")
        unknown = sorted(str(k)[:40] for k in data if k not in known)
        if unknown:
            raise ValueError(
                f"unknown engine constraint(s) {unknown[:5]}; refitd knows {list(known)}: is the adapter from "
                "another refitd version than the daemon?"
            )
        formats = data.get("unsupported_formats", [])
        if not isinstance(formats, list) or len(formats) > 16 or not all(isinstance(f, str) for f in formats):
            raise ValueError(
                f"constraint 'unsupported_formats' must be a list of format names, got {formats!r:.80}"
            )
        for name in _INT_FIELDS:
            value = data.get(name)
            if value is not None and (type(value) is not int or not 1 <= value <= MAX_VALUE):
                raise ValueError(f"constraint {name!r} must be a positive integer or nil, got {value!r:.80}")
        kw = {name: data[name] for name in _INT_FIELDS if data.get(name) is not None}
        return cls(engine=engine, expert_format=expert_format, unsupported_formats=frozenset(formats), **kw)
