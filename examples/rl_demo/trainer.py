"""A trainer rank of the demo: the policy under FSDP2 (``fully_shard``, gloo, CPU), one GRPO update a
step on the engine's rollouts, and ``push_step(step, model.state_dict())`` to ``refitd serve`` before
each step's rollouts (each rank sends its own DTensor shards, FP32 masters, experts fused as
transformers holds them; the daemon publishes BF16 or quantized experts).

Started by :mod:`examples.rl_demo.run` with the ``spawn`` context, one process per rank
(:func:`run_rank`); the driver hands each rank its half of the rollouts on ``inbox`` and rank 0 puts
one dict a step on ``outbox``.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from examples.rl_demo import policy

#: how long a rank waits for the driver's rollouts before giving up (seconds)
ROLLOUT_TIMEOUT = 300.0


def run_rank(rank: int, world: int, job: dict[str, Any], inbox, outbox) -> None:
    try:
        _run_rank(rank, world, job, inbox, outbox)
    except BaseException:
        outbox.put({"rank": rank, "error": traceback.format_exc()})
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(rank: int, world: int, job: dict[str, Any], inbox, outbox) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sidecar.client import RefitClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job['init_file']}", rank=rank, world_size=world)
    task: policy.Task = job["task"]
    model = policy.build_policy(job["vocab"], seed=job["seed"], model=job["model"])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=job["lr"])
    with RefitClient(job["endpoint"], rank=rank, world_size=world, timeout=120) as client:
        for step in range(job["steps"]):
            t0 = time.perf_counter()
            pushed = client.push_step(step, model.state_dict())  # this rank's shards, where they lie
            refit_s = time.perf_counter() - t0
            if rank == 0:  # published: the driver asks the engine to refit now
                outbox.put({"rank": rank, "pushed": step})
            batch = inbox.get(timeout=ROLLOUT_TIMEOUT)
            if batch is None:  # the driver stopped
                return
            tokens, engine_lp, adv = batch["tokens"], batch["engine_lp"], batch["adv"]
            trainer_lp = policy.token_logprobs(model(input_ids=tokens).logits, tokens, task.prompt_len)
            k3, diff, n = policy.gen_kl_sums(trainer_lp, engine_lp)
            stale = batch.get("stale_lp")
            stale_k3 = policy.gen_kl_sums(trainer_lp, stale)[0] if stale is not None else float("nan")
            sums = torch.tensor([k3, diff, float(n), stale_k3], dtype=torch.float64)
            dist.all_reduce(sums)
            loss = policy.grpo_loss(trainer_lp, adv, int(sums[2]))
            loss.backward()
            optim.step()
            optim.zero_grad()
            if rank == 0:
                outbox.put(
                    {
                        "rank": rank,
                        "step": step,
                        "generation": pushed.generation,
                        "refit_s": refit_s,
                        "gen_kl_error": float(sums[0] / sums[2]),
                        "mean_lp_diff": float(sums[1] / sums[2]),
                        "stale_kl": float(sums[3] / sums[2]),
                        "tokens": int(sums[2]),
                        "bytes_out": pushed.bytes_out,
                    }
                )
    outbox.put({"rank": rank, "done": True})
