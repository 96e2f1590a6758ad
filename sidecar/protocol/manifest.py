"""What an engine says it holds: the manifest an adapter sends when it attaches.

Built from the engine's *loaded* model, it lists every checkpoint tensor the engine expects (name,
dtype, shape), the engine kind and version, the MoE backend the engine actually resolved (not the
one requested: TRT-LLM silently falls back from TRTLLM-Gen to CUTLASS for per-tensor FP8) and the
format its routed experts are held in. The daemon checks its plan against it before the first step
(``check_manifest``) and publishes in BF16 whatever the engine holds in BF16 (the manifest wins).

On the wire a manifest is plain msgpack data (``to_wire`` / ``from_wire``); dtypes travel by name.
The daemon parses a manifest on its serve loop, so ``from_wire`` checks every field's type and bounds
(:data:`MAX_MANIFEST_TENSORS` entries, :data:`MAX_NAME_CHARS` per name, :data:`MAX_DIMS` per shape)
before it builds anything, and every check is linear in the number of entries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams
from sidecar.plan.constraints import EngineConstraints, EngineKind
from transport.wire import dtype_from_name, dtype_name, safe_repr

#: the most tensors a manifest may list. A Kimi-K2-size model (~1T parameters: 61 layers of 384
#: routed experts, each with gate/up/down weights and their scales) lists about 140k; DeepSeek-V3
#: about 90k. A million leaves room for larger models while bounding what one ATTACH can cost.
MAX_MANIFEST_TENSORS = 1_000_000
#: the longest tensor name accepted (real checkpoint names are under 200 characters)
MAX_NAME_CHARS = 1024
#: the most dimensions a manifest tensor may have
MAX_DIMS = 16
#: the largest single dimension accepted (2^48 elements is far beyond any weight)
MAX_DIM = 1 << 48
#: how many offending names an error lists
MAX_LISTED = 5


__all__ = ["EngineConstraints", "EngineKind", "Manifest", "ManifestTensor"]


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
    #: what the engine's MoE kernels need of the experts, checked by the adapter and by the daemon
    #: (None: no rule beyond the format's own; it must name this manifest's engine and format)
    constraints: EngineConstraints | None = None
    #: free-form facts for logs and status (tp size, device, model name)
    info: Mapping[str, Any] = field(default_factory=dict)
    #: the expert format's parameters the engine holds (INT4 group and scale dtype, NVFP4's names;
    #: SPEC §1.7, §2.3): the daemon plans with them (the manifest decides). Those of other formats
    #: than ``expert_format`` stay at their defaults; a manifest without them says the defaults.
    format_params: FormatParams = DEFAULT_FORMAT_PARAMS

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", EngineKind(self.engine))
        object.__setattr__(self, "expert_format", Format.parse(self.expert_format))
        if not isinstance(self.format_params, FormatParams):
            raise TypeError(
                f"Manifest.format_params is a FormatParams, got {type(self.format_params).__name__}"
            )
        self.format_params.check_for(self.expert_format)
        if self.constraints is None:
            object.__setattr__(
                self, "constraints", EngineConstraints(engine=self.engine, expert_format=self.expert_format)
            )
        elif not isinstance(self.constraints, EngineConstraints):
            raise TypeError(
                f"Manifest.constraints is an EngineConstraints, got {type(self.constraints).__name__}"
            )
        elif (self.constraints.engine, self.constraints.expert_format) != (self.engine, self.expert_format):
            raise ValueError(
                f"the constraints describe a {self.constraints.engine.value} engine holding "
                f"{self.constraints.expert_format.value} experts, the manifest a {self.engine.value} engine "
                f"holding {self.expert_format.value}: build both from the same engine settings"
            )
        if len(self.tensors) > MAX_MANIFEST_TENSORS:
            raise ValueError(_too_many(len(self.tensors)))
        counts = Counter(t.name for t in self.tensors)  # linear: 24k entries once took 9 s with list.count
        if len(counts) != len(self.tensors):
            dup = [n for n, c in counts.items() if c > 1]
            shown = sorted(dup[: MAX_LISTED * 20])[:MAX_LISTED]
            raise ValueError(
                f"manifest lists {len(dup)} tensor name(s) more than once, e.g. {shown}; list each tensor once"
            )

    def by_name(self) -> dict[str, ManifestTensor]:
        return {t.name: t for t in self.tensors}

    def to_wire(self) -> dict[str, Any]:
        return {
            "engine": self.engine.value,
            "engine_version": self.engine_version,
            "moe_backend": self.moe_backend,
            "expert_format": self.expert_format.value,
            "tensors": [[t.name, dtype_name(t.dtype), list(t.shape)] for t in self.tensors],
            "constraints": self.constraints.to_wire(),
            "info": dict(self.info),
            "format_params": self.format_params.to_wire(),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Manifest:
        """Parse a manifest a peer sent; ValueError saying which field is wrong (never anything else)."""
        try:
            if not isinstance(data, Mapping):
                raise ValueError(f"a manifest is a map, got {type(data).__name__}")
            rows = data["tensors"]
            if not isinstance(rows, list):
                raise ValueError(f"'tensors' is a list of [name, dtype, shape], got {type(rows).__name__}")
            if len(rows) > MAX_MANIFEST_TENSORS:
                raise ValueError(_too_many(len(rows)))
            tensors = tuple(_tensor_from_wire(i, row) for i, row in enumerate(rows))
            engine, fmt = EngineKind(_text(data, "engine")), Format.parse(_text(data, "expert_format"))
            return cls(
                engine=engine,
                engine_version=_text(data, "engine_version", ""),
                moe_backend=_text(data, "moe_backend", ""),
                expert_format=fmt,
                tensors=tensors,
                constraints=EngineConstraints.from_wire(
                    _map(data, "constraints"), engine=engine, expert_format=fmt
                ),
                info=_map(data, "info"),
                format_params=FormatParams.from_wire(_map(data, "format_params")),
            )
        except KeyError as exc:
            raise ValueError(
                f"malformed manifest: it lacks {safe_repr(exc.args[0] if exc.args else exc)}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from None

    @classmethod
    def from_tensors(
        cls, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], **kw: Any
    ) -> Manifest:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return cls(tensors=tuple(ManifestTensor(n, t.dtype, tuple(t.shape)) for n, t in items), **kw)


def _too_many(n: int) -> str:
    return (
        f"manifest lists {n} tensors, more than the {MAX_MANIFEST_TENSORS} any model needs (a 1T-parameter "
        "MoE with per-expert names lists a few hundred thousand); is the adapter listing something twice?"
    )


def _tensor_from_wire(i: int, row: Any) -> ManifestTensor:
    if not isinstance(row, list) or len(row) != 3:
        raise ValueError(f"tensor {i} is not [name, dtype, shape]: {safe_repr(row, 80)}")
    name, dtype, shape = row
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(
            f"tensor {i}: the name must be a non-empty string of at most {MAX_NAME_CHARS} characters, "
            f"got {type(name).__name__} {safe_repr(name, 80)}"
        )
    if not isinstance(dtype, str):
        raise ValueError(
            f"tensor {name!r}: the dtype must be a name such as 'bfloat16', got {safe_repr(dtype, 80)}"
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ValueError(
            f"tensor {name!r}: the shape must be a list of at most {MAX_DIMS} sizes, got {safe_repr(shape, 80)}"
        )
    for x in shape:
        if type(x) is not int or not 0 <= x <= MAX_DIM:
            raise ValueError(
                f"tensor {name!r}: shape {safe_repr(shape, 80)} holds {safe_repr(x, 40)}, not a size"
            )
    return ManifestTensor(name, dtype_from_name(dtype), tuple(shape))


def _text(data: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = data[key] if default is None else data.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ValueError(
            f"{key!r} must be a string of at most {MAX_NAME_CHARS} characters, got {safe_repr(value, 80)}"
        )
    return value


def _map(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"{key!r} must be a map, got {type(value).__name__}")
    return dict(value)
