"""Megatron-Core policies (NeMo-RL's Megatron worker, verl-megatron, slime): the one call each
trainer rank makes, the same on every rank, whatever its TP, EP, PP or DP coordinate.

    from integrations.megatron import push_megatron

    client = RefitClient(endpoint, rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size())
    declare = declare_of(bridge)          # once: the HF names, shapes and dtypes the export yields
    for step in ...:
        train(...)
        push_megatron(client, step, bridge, model, declare=declare)

Megatron-Bridge's ``export_hf_weights`` gathers every tensor (TP and EP collectives, and a broadcast
from the PP stage that holds it) and yields it whole on every rank of every stage. Every rank
streams it into ``push_step(..., declare=..., replicated=True)``:
the client sends BEGIN before it reads the export (so no rank waits in a collective for a rank that
has not begun), each rank reads the whole export in lockstep, and each tensor is written by exactly
one rank (``sidecar.client.replicated``), the bytes spread over the ranks; the others drop it as it
comes. Megatron and the bridge are imported by the caller, never here; this module imports only
refitd's client and plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sidecar.client import RefitClient, StepResult
from sidecar.plan.build import meta_state_dict

__all__ = ["declare_of", "push_megatron"]


def declare_of(bridge: Any) -> dict[str, torch.Tensor]:
    """The tensors ``bridge.export_hf_weights`` yields, as meta tensors (from its HF config): what
    each step declares."""
    hf = bridge.hf_pretrained  # a PreTrainedCausalLM wrapper, or the config itself (from_hf_config)
    config = getattr(hf, "config", hf)
    return meta_state_dict(config.to_dict() if hasattr(config, "to_dict") else dict(config))


def push_megatron(
    client: RefitClient,
    step: int,
    bridge: Any,
    model: Any,
    *,
    declare: Mapping[str, torch.Tensor] | None = None,
    **push: Any,
) -> StepResult:
    """Stream ``bridge.export_hf_weights(model)`` into refitd as step ``step``; call it on every
    rank. ``push``: ``push_step``'s other keywords (``wait``, ``timeout``)."""
    export = bridge.export_hf_weights(model, show_progress=False)
    declare = declare_of(bridge) if declare is None else declare
    return client.push_step(step, export, declare=declare, replicated=True, **push)
