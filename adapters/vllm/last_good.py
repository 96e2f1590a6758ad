"""The NVFP4 activation scales of a vLLM worker's last good load: what its loads carry (pure Python).

refitd publishes no static activation scales (``adapters.vllm.carry``): every reload is given the
ones the engine holds, read from its processed parameters just before. That read is only right
while the engine holds a whole generation. After a load that failed halfway (a layer's
``load_weights`` raised, or its processing did, or the MTP drafter's reload did) a layer that vLLM's
layerwise reload processed half-loaded holds what processing made of uninitialised memory; read
then, those values would be carried into the next load (the return to the last good generation, or
the next step) and from it into every later one.

So each worker keeps one :class:`LastGoodScales` (on the worker object, :func:`last_good_scales`)
that both of its load paths use, ``adapters.vllm.worker.load_generation`` and the streamed
``adapters.vllm.stream.LayerwiseGroups``: a load asks it for the scales to carry
(:meth:`~LastGoodScales.for_load`) and tells it when it succeeded
(:meth:`~LastGoodScales.succeeded`). A load that begins while the last one succeeded (or before any
load: the first one after attach) reads the engine; from then until a load succeeds, every load --
the rest of a streamed step, its rollback, the next whole load -- carries what was read then. No
failure has to be reported: a load that did not succeed, however it ended, never marked the record
good again. The record stays with the worker across ``refit_detach`` / ``refit_attach`` (it
describes the engine's weights, not the connection to a daemon).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: the attribute of a vLLM worker that holds its :class:`LastGoodScales`
_ATTR = "_refit_last_good_scales"


class LastGoodScales:
    """The carried activation scales read while the worker last held a whole generation, and whether
    a load has begun since without succeeding (the engine's own are then not to be read)::

        record = last_good_scales(worker)
        carried = record.for_load(lambda: carried_scales(worker))  # before the reload touches the model
        ...  # the reload, given ``carried`` (a streamed step: every group, and its rollback)
        record.succeeded()  # only when the load completed
    """

    __slots__ = ("_loading", "_scales")

    def __init__(self) -> None:
        self._scales: dict[str, torch.Tensor] | None = None
        self._loading = False  # a load began and has not succeeded (yet, or ever)

    def for_load(self, read: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The scales to carry into the load now beginning or going on: ``read()`` (the engine's
        own, read before the reload touches it) when no load is unfinished, else the ones read when
        the unfinished load began. A ``read`` that raises leaves the record as it was."""
        if not self._loading or self._scales is None:  # (None: never read)
            self._scales = read()
            self._loading = True
        return self._scales

    def succeeded(self) -> None:
        """The load completed: the engine holds a whole generation with the carried scales, so the
        next load reads them from it again."""
        self._loading = False


def last_good_scales(worker: Any) -> LastGoodScales:
    """``worker``'s one record, created on its first load (nothing remembered: that load reads)."""
    record = getattr(worker, _ATTR, None)
    if record is None:
        record = LastGoodScales()
        setattr(worker, _ATTR, record)
    return record
