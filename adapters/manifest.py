"""What an engine says it holds: the manifest an adapter sends when it attaches.

Built from the engine's *loaded* model, it lists every checkpoint tensor the engine expects (name,
dtype, shape), the engine kind and version, the MoE backend the engine actually resolved (not the
one requested: TRT-LLM silently falls back from TRTLLM-Gen to CUTLASS for per-tensor FP8) and the
format its routed experts are held in. The daemon checks its plan against it before the first step
(``check_manifest``) and publishes in BF16 whatever the engine holds in BF16 (the manifest wins).

On the wire a manifest is plain msgpack data (``to_wire`` / ``from_wire``); dtypes travel by name.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.formats import Format
from transport.wire import dtype_from_name, dtype_name


class EngineKind(str, enum.Enum):
    REFERENCE = "reference"
    VLLM = "vllm"
    TRTLLM = "trtllm"


@dataclass(frozen=True, slots=True)
class ManifestTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """Everything the daemon needs to know about one attached engine worker."""

    engine: EngineKind
    engine_version: str
    moe_backend: str  # the resolved MoE implementation's class name, e.g. "CutlassFusedMoE"
    expert_format: Format  # what the engine's routed experts hold: block_fp8, mxfp8, fp8_per_tensor, bf16
    tensors: tuple[ManifestTensor, ...]
    #: backend constraints the daemon checks: e.g. {"mxfp8_align": 128, "block_fp8_align": 128}
    constraints: Mapping[str, Any] = field(default_factory=dict)
    #: free-form facts for logs and status (tp size, device, model name)
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", EngineKind(self.engine))
        object.__setattr__(self, "expert_format", Format.parse(self.expert_format))
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:5]
            raise ValueError(f"manifest lists tensors more than once: {dup}")

    def by_name(self) -> dict[str, ManifestTensor]:
        return {t.name: t for t in self.tensors}

    def to_wire(self) -> dict[str, Any]:
        return {
            "engine": self.engine.value,
            "engine_version": self.engine_version,
            "moe_backend": self.moe_backend,
            "expert_format": self.expert_format.value,
            "tensors": [[t.name, dtype_name(t.dtype), list(t.shape)] for t in self.tensors],
            "constraints": dict(self.constraints),
            "info": dict(self.info),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Manifest:
        try:
            tensors = tuple(
                ManifestTensor(str(n), dtype_from_name(d), tuple(int(x) for x in s))
                for n, d, s in data["tensors"]
            )
            return cls(
                engine=data["engine"],
                engine_version=str(data.get("engine_version", "")),
                moe_backend=str(data.get("moe_backend", "")),
                expert_format=data["expert_format"],
                tensors=tensors,
                constraints=dict(data.get("constraints", {})),
                info=dict(data.get("info", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from None

    @classmethod
    def from_tensors(
        cls, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], **kw: Any
    ) -> Manifest:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return cls(tensors=tuple(ManifestTensor(n, t.dtype, tuple(t.shape)) for n, t in items), **kw)
