"""Refit a vLLM engine while it serves: the orchestration RL frameworks run around a weight update of
vLLM's async engine (``AsyncLLM``), with refitd's load in the middle.

    async def rollout_step(engine, step):
        ...  # the trainer pushed step `step` (push_step returned: published)
        timing = await refit_serving_engine(engine, min_step=step)

:func:`refit_serving_engine` runs vLLM's own sequence (``v1/engine/async_llm.py``): ``pause_generation
(mode=..., clear_cache=True)`` (no request is scheduled again until resume; in ``"abort"`` mode those in
flight end with ``finish_reason == "abort"`` and the caller retries them, in ``"wait"`` mode they finish
on the old weights first), then ``collective_rpc("refit_load")`` on every worker (the generation loaded by
vLLM's own loader, adapters.vllm.worker), then ``reset_prefix_cache()`` (no KV computed with the old
weights is ever served again), then ``resume_generation()``. The engine must have been started with
``vllm_engine_args`` (its ``worker_extension_cls``) and attached (``collective_rpc("refit_attach", ...)``).
A failed load resumes generation on the last good weights and raises (adapters.engine.check_results).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ServingRefit", "refit_serving_engine"]


@dataclass(frozen=True, slots=True)
class ServingRefit:
    """What one :func:`refit_serving_engine` did: every worker's load result, how long generation was
    stopped (``pause_s``: from the pause request until generation resumed) and the load inside it."""

    results: list
    pause_s: float
    load_s: float


async def refit_serving_engine(
    engine: Any, min_step: int | None = None, timeout: float | None = None, *, mode: str = "abort"
) -> ServingRefit:
    """Pause ``engine`` (an ``AsyncLLM``), load the next generation >= ``min_step`` on every worker,
    reset the prefix cache, resume; see the module docstring. ``mode``: vLLM's pause mode, ``"abort"``
    (RL rollouts: in-flight requests end aborted, none mixes two generations) or ``"wait"``."""
    from adapters.engine import check_results

    if mode not in ("abort", "wait"):
        raise ValueError(
            f"mode={mode!r}: 'abort' or 'wait'; vLLM's 'keep' resumes requests whose KV cache the old "
            "weights computed, mixing two generations in one response"
        )
    t0 = time.perf_counter()
    await engine.pause_generation(mode=mode, clear_cache=True)
    try:
        t1 = time.perf_counter()
        raw = await engine.collective_rpc("refit_load", args=(min_step, timeout))
        load_s = time.perf_counter() - t1
        results = check_results(raw, step=min_step)
        await engine.reset_prefix_cache()
    finally:
        await engine.resume_generation()
    return ServingRefit(results=results, pause_s=time.perf_counter() - t0, load_s=load_s)
