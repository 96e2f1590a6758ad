"""Streamed refit into vLLM (adapters.vllm.stream) against vLLM 0.33.0's real layerwise reload on CPU.

Runs under ``make test-engines`` (vLLM's reload package in .venv-engines); skipped elsewhere. The toy
engine is test_adapter_vllm's: a block-FP8 MoE layer whose quant method reshapes a scale in
``process_weights_after_loading`` (as kernel repacking does) and a BF16 lm_head; nothing of vLLM is
stubbed. Each layer group is one vLLM layer's tensors: the experts, or the lm_head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_adapter_vllm import E, _started_engine, _toy_generation, real_vllm  # noqa: F401 (a fixture)

from adapters.vllm import worker as avw
from adapters.vllm.stream import WorkerAccess, layerwise_group_loader

EXPERTS = "model.layers.0.mlp.experts."
#: the target model's access as refit_attach gives it (which also reloads an MTP drafter and resets the
#: runner's caches when a step is sealed: streamed_group_loader, tests/test_engine_vllm_fourbit.py)
ACCESS = WorkerAccess(avw._model, avw._config_context, avw.ordered_weights)


def groups(gen: dict[str, torch.Tensor]) -> list[list[str]]:
    """The layer groups refitd would stream: the MoE layer's tensors, then the lm_head."""
    return [sorted(n for n in gen if n.startswith(EXPERTS)), ["lm_head.weight"]]


def holds(model, gen: dict[str, torch.Tensor]) -> bool:
    """Whether the engine's kernel tensors hold ``gen`` (the w13 rows, and the lm_head)."""
    experts = model.model.layers[0].mlp.experts
    for e in range(E):
        gate = gen[f"{EXPERTS}{e}.gate_proj.weight"].float()
        up = gen[f"{EXPERTS}{e}.up_proj.weight"].float()
        if not torch.equal(experts.w13_weight[e].float(), torch.cat([gate, up])):
            return False
    return torch.equal(model.lm_head.weight, gen["lm_head.weight"])


def view(gen: dict[str, torch.Tensor]) -> SimpleNamespace:
    return SimpleNamespace(tensors=gen)


@pytest.mark.engine
def test_a_streamed_step_lands_whole_through_one_layerwise_session(real_vllm):  # noqa: F811
    model, worker = _started_engine(real_vllm)
    experts = model.model.layers[0].mlp.experts
    kernel = experts.w13_weight
    loader = layerwise_group_loader(worker, ACCESS)
    method = type(experts.quant_method)
    for seed in (1, 2):
        gen, before = _toy_generation(seed), method.processed
        for names in groups(gen):  # group by group, as GROUP messages arrive
            loader(view(gen), names)
        assert method.processed == before + 1  # the layer was processed as soon as it was complete
        loader.finish()
        assert holds(model, gen) and experts.w13_weight is kernel


@pytest.mark.engine
def test_a_rollback_reloads_what_the_failed_step_took_in_a_second_session(real_vllm):  # noqa: F811
    """Step 2 fails after the engine took the MoE group: finish its session (the lm_head it never
    reached keeps step 1), reload the MoE group of step 1 in a new session: the engine holds step 1."""
    model, worker = _started_engine(real_vllm)
    loader = layerwise_group_loader(worker, ACCESS)
    one, two = _toy_generation(1), _toy_generation(2)
    for names in groups(one):
        loader(view(one), names)
    loader.finish()
    moe = groups(two)[0]
    loader(view(two), moe)  # streamed part of step 2
    loader.finish()  # the step failed: close its session
    assert not holds(model, one) and torch.equal(model.lm_head.weight, one["lm_head.weight"])
    loader(view(one), moe)  # the rollback
    loader.finish()
    assert holds(model, one)


@pytest.mark.engine
def test_vllm_writes_a_layer_loaded_twice_in_one_session_raw_into_its_kernel_tensors(real_vllm):  # noqa: F811
    """What the adapter's rule "each layer once per session, a rollback in a new session" rests on:
    once vLLM processed a layer in a session, the layer's parameters are its kernel tensors again,
    with their load-time loaders and no layerwise wrapper, so a second load of that layer in the same
    session bypasses processing: checkpoint bytes land raw in the kernel tensor (here the gate rows),
    or the load fails where the processed tensor has no loader any more (here the transposed scale)."""
    model, worker = _started_engine(real_vllm)
    loader = layerwise_group_loader(worker, ACCESS)
    one, two = _toy_generation(1), _toy_generation(2)
    moe = groups(one)[0]
    loader(view(one), moe)  # processed: the kernel holds step 1
    with pytest.raises(AttributeError, match="weight_loader"):
        loader(view(two), moe)  # the same layer again in the same session
    loader.finish()
    kernel = model.model.layers[0].mlp.experts.w13_weight
    gate = two[f"{EXPERTS}0.gate_proj.weight"].float()
    assert torch.equal(kernel[0, : gate.shape[0]].float(), gate)  # raw, unprocessed, in the kernel
    assert not holds(model, one)
