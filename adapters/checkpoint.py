"""What the engine adapters' manifest builders share (pure: no engine import).

An adapter maps its engine's parameters to the checkpoint tensors the engine's loader takes
(``adapters.vllm.checkpoint``, ``adapters.sglang.checkpoint``); each collects them with a
:class:`TensorCollector`, then makes the manifest with :func:`engine_manifest`, whose
``EngineConstraints`` take the expert dimensions from the model's text config the same way for
every engine, so the daemon's attach check compares like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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

    def refuse_problems(self, engine: str) -> None:
        """Raise one ValueError listing every problem found, if any."""
        if self.problems:
            raise ValueError(
                f"cannot map {engine}'s parameters to checkpoint tensors:\n  " + "\n  ".join(self.problems)
            )


#: ``(dtype, shape)`` of one engine parameter, keyed by ``(w13 | w2, leaf)`` within its MoE layer
ExpertParams = dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]]


def split_params(
    params: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    experts_match: Callable[[str], tuple[str, str, str] | None],
    skip: Callable[[str], bool] = lambda name: False,
) -> tuple[dict[str, ExpertParams], list[tuple[str, torch.dtype]]]:
    """An engine's ``(name, dtype, shape)`` parameters, split into its MoE layers' routed-expert ones
    (``experts_match(name)`` gives ``(moe, w, leaf)``), grouped by layer, and the rest ``(name, dtype)``
    in order; names ``skip`` says are state of the engine's own (nothing loads them) are dropped."""
    experts: dict[str, ExpertParams] = {}
    dense: list[tuple[str, torch.dtype]] = []
    for name, dtype, shape in params:
        m = experts_match(name)
        if m is not None:
            experts.setdefault(m[0], {})[(m[1], m[2])] = (param_dtype(dtype), tuple(int(d) for d in shape))
        elif not skip(name):
            dense.append((name, param_dtype(dtype)))
    return experts, dense


class DenseMapper(TensorCollector):
    """:class:`TensorCollector` that maps an engine's non-expert parameters (``{module}.{leaf}``) to
    checkpoint tensors the way vLLM and SGLang both load them: KV-cache scales and a tied ``lm_head``
    skipped, a packed module (``qkv_proj``, ``gate_up_proj``) expanded to the shards the checkpoint
    has, each shard's tensor taken from the checkpoint listing ``ckpt`` or, for a scale the listing
    lacks, shaped from its weight. An engine's builder sets the tables and overrides the hooks."""

    #: packed module -> the checkpoint shards it loads (``qkv_proj`` -> ``q_proj, k_proj, v_proj``)
    PACKED_MODULES: Mapping[str, Sequence[str]] = {}
    #: leaves of KV-cache scales: engine state, not checkpoint tensors
    KV_SCALE_LEAVES: Iterable[str] = ()
    #: scale leaves a dense weight may carry that the checkpoint listing does not name
    SCALE_LEAVES: Iterable[str] = ()
    #: said after "no checkpoint tensor X maps to it"
    UNMAPPED_NOTE = ""

    def __init__(self, ckpt: Mapping[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.ckpt = ckpt

    def checkpoint_name(self, engine_name: str) -> str:
        return engine_name

    def checkpoint_leaf(self, leaf: str) -> str:
        return leaf

    def accepted_dtype(self, target: str, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def dense_scale_shape(
        self, leaf: str, dtype: torch.dtype, weight_shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        raise NotImplementedError

    def dense(self, engine_name: str, dtype: torch.dtype, tied: bool) -> None:
        name = self.checkpoint_name(engine_name)
        module, _, leaf = name.rpartition(".")
        if leaf in self.KV_SCALE_LEAVES or (name == "lm_head.weight" and tied):
            return
        parent, _, proj = module.rpartition(".")
        shards = [module]
        if proj in self.PACKED_MODULES:
            shards = [
                f"{parent}.{s}" for s in self.PACKED_MODULES[proj] if f"{parent}.{s}.weight" in self.ckpt
            ]
            if not shards:
                self.problems.append(f"{engine_name}: none of its packed shards is in the checkpoint")
        for shard in shards:
            target, weight = f"{shard}.{self.checkpoint_leaf(leaf)}", self.ckpt.get(f"{shard}.weight")
            if target in self.ckpt:
                self.add(target, self.accepted_dtype(target, dtype), self.ckpt[target])
            elif leaf in self.SCALE_LEAVES and weight is not None:
                self.add(target, dtype, self.dense_scale_shape(leaf, dtype, weight))
            else:
                self.problems.append(
                    f"{engine_name}: no checkpoint tensor {target} maps to it{self.UNMAPPED_NOTE}"
                )


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
