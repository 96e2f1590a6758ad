"""Streamed refit into vLLM: each layer group through vLLM's layerwise reload as it is published.

``layerwise_group_loader(worker, fmt)`` is the ``load_group`` an ``EngineWorker`` streams with
(``adapters.stream``); None on a vLLM without layerwise reload, which then loads whole generations.
One layerwise-reload session spans one streamed step: ``initialize_layerwise_reload`` before the
first group, ``model.load_weights`` per group (each group is whole layers: a decoder layer with its
attention and experts, or one other module, so every vLLM layer receives all of its weights in one
call, in layer order), ``finalize_layerwise_reload`` when the step is sealed (``finish``).

What vLLM 0.33.0's layerwise reload does with a layer (``vllm/model_executor/model_loader/reload/
layerwise.py``; checked against the real package in tests/test_stream_vllm.py): at
``initialize_layerwise_reload`` each layer's tensors are put back on the meta device at load-time
shapes and their weight loaders wrapped; the wrappers buffer the layer's weights and count the
elements loaded, and the moment a layer has all of them it is materialised, loaded, processed
(``process_weights_after_loading``) and copied into the kernel tensors, which go back on the layer.
So a layer loaded twice in one session is NOT reprocessed: its parameters are the kernel tensors
again, with their load-time loaders, and the second load writes checkpoint bytes raw into them (or
fails where the processed tensor has no loader) -- a layer must never be split across groups or sent
twice per session. A layer not loaded at all keeps its kernel tensors (finalize puts them back,
warning "Failed to load weights"); a layer only partly loaded is processed at finalize with the rest
uninitialised; attention layers are deferred to finalize. Hence a rollback here: finalize the failed
step's session (the layers it did not reach keep their old values), then a second session reloads
every group taken from it, from the live generation, and finalizes; a group that failed halfway is
among those reloaded whole.

The MTP drafter (``get_draft_model()``) is not streamed: its ``load_weights`` picks its own names
out of the whole generation and its lm_head is re-derived from the target's
(``share_source_lm_heads`` / ``restore_quantized_lm_heads``), so it is reloaded whole
(``WorkerAccess.complete``: ``adapters.vllm.worker.complete_reload``, what a whole load runs after
the target, the runner's cache resets included) when ``finish`` is given the complete generation:
the sealed step, after the target's session is finalized and before the step is acknowledged; a
drafter that fails there fails the step. The rollback's ``finish`` gives the live generation, so
the drafter returns to it as the target does (a drafter the failed step never reached is reloaded
with the same bytes it holds).

NVFP4 W4A4's activation scales (``adapters.vllm.carry``) come from the worker's one
``adapters.vllm.last_good.LastGoodScales``, which its whole loads use too: read from the engine
when a step's first group is loaded (before the session opens), unless a load (whole or streamed)
failed since the last good one; then, and through the step's rollback, the scales read for that
load, not the engine's (a layer processed half-loaded holds garbage ones). A sealed step, or a
rollback that ends with the live generation loaded, is a good load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from adapters.vllm.carry import carried_input_scales
from adapters.vllm.last_good import last_good_scales


class WorkerAccess:
    """How ``adapters.vllm.worker`` reaches a vLLM worker's model (given, not imported: it imports
    this module): the model, the ``set_current_vllm_config`` context, the loaders' weight order;
    ``carry(worker)``, the NVFP4 activation scales the worker holds, named as the generation names
    them (default: the target model's; read only through ``adapters.vllm.last_good``); ``complete(worker, tensors)``, what a whole load does after
    the target's reload, from the whole generation: the MTP drafter's reload (if any) and the
    runner's cache resets (None: nothing)."""

    def __init__(
        self,
        model: Callable[[Any], torch.nn.Module],
        config_context: Callable[[Any], AbstractContextManager],
        order: Callable[[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]],
        *,
        carry: Callable[[Any], dict[str, torch.Tensor]] | None = None,
        complete: Callable[[Any, Mapping[str, torch.Tensor]], None] | None = None,
    ):
        self.model, self.config_context, self.order = model, config_context, order
        self.carry = carry or (lambda worker: carried_input_scales(model(worker).named_modules()))
        self.complete = complete


class LayerwiseGroups:
    """``load_group`` for a vLLM worker: layer groups into one layerwise-reload session per step."""

    def __init__(self, worker: Any, access: WorkerAccess, initialize: Callable, finalize: Callable):
        self.worker, self.access, self._initialize, self._finalize = worker, access, initialize, finalize
        self._open = False  # a session is in progress (initialized, not yet finalized)

    def _carried(self) -> dict[str, torch.Tensor]:
        """NVFP4 W4A4's activation scales to carry (adapters.vllm.last_good): read from the engine
        at a step's first group if the worker's last load succeeded, else the last good ones."""
        worker = self.worker
        return last_good_scales(worker).for_load(lambda: self.access.carry(worker))

    def __call__(self, gen: Any, names: Sequence[str]) -> None:
        worker, access = self.worker, self.access
        model = access.model(worker)
        carried = self._carried()  # before initialize puts the layers on the meta device
        tensors = {n: gen.tensors[n] for n in names}
        if carried:  # NVFP4 W4A4: the held activation scales of this group's MoE layers
            moes = {n.partition(".mlp.experts.")[0] for n in names if ".mlp.experts." in n}
            tensors.update({n: t for n, t in carried.items() if n.partition(".mlp.experts.")[0] in moes})
        weights = access.order(tensors)
        with access.config_context(worker), torch.device(worker.device):
            if not self._open:
                self._initialize(model)
                self._open = True
            model.load_weights(weights)

    def finish(self, whole: Any = None) -> None:
        """Finalize the session (the step is sealed, or a rollback closes or ends one); then, given
        ``whole`` (the generation the loaded groups complete: the sealed step, or the live one a
        rollback returned to), reload the MTP drafter from it with the carried scales and reset the
        runner's caches, as ``load_generation`` does; the load was good. None: the step was
        abandoned; the drafter is left as it is, and the rollback (whose own ``finish`` reloads the
        drafter) carries the scales read for the failed step."""
        worker, access = self.worker, self.access
        if self._open:
            self._open = False
            with access.config_context(worker), torch.device(worker.device):
                self._finalize(access.model(worker), worker.model_config)
        if whole is None:
            return
        if access.complete is not None:  # (if it fails, the rollback reloads with the same scales)
            access.complete(worker, {**whole.tensors, **self._carried()})
        last_good_scales(worker).succeeded()  # the next step reads the engine's scales afresh


def layerwise_group_loader(worker: Any, access: WorkerAccess) -> LayerwiseGroups | None:
    """The streaming ``load_group`` of a vLLM worker; None when this vLLM has no layerwise reload."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return LayerwiseGroups(worker, access, initialize_layerwise_reload, finalize_layerwise_reload)
