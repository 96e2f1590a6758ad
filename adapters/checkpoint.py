"""What the engine adapters' manifest builders share (pure: no engine import).

An adapter maps its engine's parameters to the checkpoint tensors the engine's loader takes
(``adapters.vllm.checkpoint``, ``adapters.sglang.checkpoint``); each collects them with a
:class:`TensorCollector`, then makes the manifest with :func:`engine_manifest`, whose
``EngineConstraints`` take the expert dimensions from the model's text config the same way for
every engine, so the daemon's attach check compares like with like.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams
from sidecar.protocol.manifest import EngineConstraints, EngineKind, Manifest, ManifestTensor
from transport.wire import dtype_from_name


def param_dtype(value: torch.dtype | str) -> torch.dtype:
    """A parameter's dtype as an engine lists it: a torch dtype, or its name (``"torch.bfloat16"``)."""
    return value if isinstance(value, torch.dtype) else dtype_from_name(str(value).removeprefix("torch."))


def config_size(value: Any) -> int | None:
    """A size from a model's config, None when it is absent or 0 (a dense model has no experts)."""
    return int(value) if value else None


class TensorCollector:
    """The checkpoint tensors an engine expects, the routed-expert modules it holds in BF16, and
    every problem found while mapping its parameters: an adapter's builder collects them all, then
    refuses once, listing every problem."""

    def __init__(self) -> None:
        self.tensors: dict[str, ManifestTensor] = {}
        self.keep_bf16: list[str] = []
        self.problems: list[str] = []

    def add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Expect ``name`` as ``dtype`` ``shape``; two engine parameters that disagree on it are a problem."""
        have = self.tensors.get(name)
        if have is not None and (have.dtype, have.shape) != (dtype, shape):
            self.problems.append(f"{name}: two engine parameters expect it as {have.dtype} and {dtype}")
        self.tensors.setdefault(name, ManifestTensor(name, dtype, shape))


def engine_manifest(
    engine: EngineKind,
    fmt: Format,
    text: Mapping[str, Any],
    tensors: Iterable[ManifestTensor],
    *,
    engine_version: str,
    moe_backend: str,
    moe_tp_size: int,
    moe_ep_size: int,
    info: Mapping[str, Any],
    format_params: FormatParams = DEFAULT_FORMAT_PARAMS,
    **constraints: Any,
) -> Manifest:
    """The manifest of an engine whose routed experts are held in ``fmt``: ``text`` is the model's
    text config (hidden and expert intermediate sizes), ``constraints`` the engine's own
    :class:`EngineConstraints` fields (its alignments)."""
    return Manifest(
        engine=engine,
        engine_version=engine_version,
        moe_backend=moe_backend,
        expert_format=fmt,
        format_params=format_params,
        tensors=tuple(tensors),
        constraints=EngineConstraints(
            engine=engine,
            expert_format=fmt,
            hidden_size=config_size(text.get("hidden_size")),
            intermediate_size=config_size(text.get("moe_intermediate_size")),
            moe_tp_size=moe_tp_size,
            moe_ep_size=moe_ep_size,
            **constraints,
        ),
        info=dict(info),
    )
