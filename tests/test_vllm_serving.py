"""adapters.vllm.refit_serving_engine's orchestration, the order of vLLM AsyncLLM calls it makes (the live
engine runs it in tests/test_live_serving.py, make test-live): pause, load, prefix-cache reset, resume;
resumed on the last good weights when a worker fails; vLLM's "keep" pause mode refused."""

from __future__ import annotations

import asyncio

import pytest

from adapters.vllm import refit_serving_engine
from sidecar.errors import RefitError


class Engine:
    """Records the AsyncLLM methods called, answers refit_load with ``results``."""

    def __init__(self, results):
        self.calls, self.results = [], results

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, *args))
        return self.results

    async def reset_prefix_cache(self):
        self.calls.append(("reset",))

    async def resume_generation(self):
        self.calls.append(("resume",))


def test_pause_load_reset_resume_in_that_order():
    engine = Engine([{"worker": "w0", "step": 3, "ok": True, "seconds": 0.01}])
    timing = asyncio.run(refit_serving_engine(engine, min_step=3))
    assert engine.calls == [("pause", "abort", True), ("refit_load", 3, None), ("reset",), ("resume",)]
    assert [r.step for r in timing.results] == [3] and timing.pause_s >= timing.load_s >= 0


def test_a_failed_load_resumes_on_the_last_good_weights_and_names_the_worker():
    engine = Engine([{"worker": "w0", "step": None, "ok": False, "error": "RefitError: boom"}])
    with pytest.raises(RefitError, match="w0"):
        asyncio.run(refit_serving_engine(engine, min_step=4, mode="wait"))
    assert engine.calls[0] == ("pause", "wait", True) and engine.calls[-1] == ("resume",)
    assert ("reset",) not in engine.calls


def test_keep_mode_is_refused_before_anything_is_paused():
    engine = Engine([])
    with pytest.raises(ValueError, match="keep"):
        asyncio.run(refit_serving_engine(engine, mode="keep"))
    assert engine.calls == []
