"""A real trainer rank for ``tests/test_trainers.py``: a tiny transformers 5.x MoE model under FSDP2
(``fully_shard``, gloo, CPU), or with tensor-parallel attention (``parallelize_module``), taking AdamW steps and pushing ``model.state_dict()`` (FP32 DTensors, the
routed experts fused) to refitd daemons after each, as an RL trainer would.

Started with the ``spawn`` context, one process per rank (:func:`run_rank`). Rank 0 also plays the
checks: after each step every rank gathers the full state dict (``full_tensor()``, outside the push),
rank 0 converts it with ``sidecar.plan.run.convert`` under the daemon's spec and compares each live
generation byte for byte, then loads the dequantized generation into the same transformers class
and measures the KL divergence of its next-token distribution from the trainer's own.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from pathlib import Path
from typing import Any

import torch

#: the tiny models: transformers' own config classes, random init. Odd vocab and expert counts make
#: FSDP2's dim-0 shards uneven (rank 0 holds one row / expert more)
SIZES: dict[str, Any] = dict(vocab_size=131, hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
EXPERTS = 5
SEQ, BATCH, EVAL_BATCH = 12, 2, 2
LR = 3e-3


def make_config(model: str):
    """The transformers config of ``model`` (``qwen3_moe`` or ``deepseek_v3``), checkpoint dtype BF16.
    No MTP layer: transformers' DeepseekV3ForCausalLM builds none, so a trainer on it has none to push
    (a config saying ``num_nextn_predict_layers: 1`` makes the daemon wait for it)."""
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **SIZES, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=EXPERTS, num_experts_per_tok=2, dtype="bfloat16",
        )  # fmt: skip
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **SIZES, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        num_nextn_predict_layers=0, dtype="bfloat16",
    )  # fmt: skip


def model_class(model: str):
    from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM if model == "qwen3_moe" else DeepseekV3ForCausalLM


# --------------------------------------------------------------------------------------------------
# counting collectives


#: every collective a process could run through torch.distributed's Python API
DIST_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "all_reduce",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "scatter", "gather", "barrier", "send", "recv", "isend", "irecv",
)  # fmt: skip
FUNCOL = ("all_gather_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


class Collectives:
    """Counts the collectives run while it is entered: calls of torch.distributed's collectives and
    of the functional collectives (wrapped), and every c10d op dispatched (torch's CommDebugMode:
    what DTensor's redistribute and full_tensor() run)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> Collectives:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.tensor.debug import CommDebugMode

        self._saved = []
        for module, names in ((dist, DIST_COLLECTIVES), (funcol, FUNCOL)):
            for name in names:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                self._saved.append((module, name, fn))
                setattr(module, name, self._counting(f"{module.__name__}.{name}", fn))
        self._mode = CommDebugMode()
        self._mode.__enter__()
        return self

    def _counting(self, label: str, fn):
        def wrapper(*args, **kwargs):
            self.calls.append(label)
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        for module, name, fn in self._saved:
            setattr(module, name, fn)
        counts = self._mode.get_comm_counts()
        self.calls += [str(op) for op, n in counts.items() for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# the engine side


def dequantized(gen: dict[str, torch.Tensor], plan) -> dict[str, torch.Tensor]:
    """Checkpoint names -> FP32 values of a generation (quantized weights dequantized, SPEC §1)."""
    from sidecar.numerics.reference import dequantize
    from sidecar.plan.build import Role

    out = {}
    for o in plan.outputs:
        if o.role is Role.WEIGHT:
            out[o.name] = dequantize(gen[o.name], gen[o.scale_name], plan.spec.format)
        elif o.role is Role.PASSTHROUGH:
            out[o.name] = gen[o.name].float()
    return out


def engine_state_dict(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The transformers 5.x module's own names (routed experts fused) from checkpoint names."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix(".gate_up_proj")
            out[name] = torch.stack(
                [
                    torch.cat([weights[f"{p}.{e}.gate_proj.weight"], weights[f"{p}.{e}.up_proj.weight"]])
                    for e in range(t.shape[0])
                ]
            )
        elif name.endswith("mlp.experts.down_proj"):
            p = name.removesuffix(".down_proj")
            out[name] = torch.stack([weights[f"{p}.{e}.down_proj.weight"] for e in range(t.shape[0])])
        else:
            out[name] = weights[name]
    return out


def kl(trainer_logits: torch.Tensor, engine_logits: torch.Tensor) -> float:
    """Mean over tokens of KL(trainer || engine) of the next-token distributions."""
    p = torch.log_softmax(trainer_logits.double(), -1)
    q = torch.log_softmax(engine_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# --------------------------------------------------------------------------------------------------
# a rank


def run_rank(rank: int, world: int, job: dict[str, Any], results) -> None:
    """Train ``job["steps"]`` steps, pushing to every daemon in ``job["daemons"]`` ({fmt: endpoint})
    after each; rank 0 puts one dict per step and format on ``results`` (or {"error": ...})."""
    try:
        _run_rank(rank, world, job, results)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(rank: int, world: int, job: dict[str, Any], results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from sidecar.plan.build import RefitSpec, plan_from_hf_config
    from sidecar.plan.run import convert

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job['init_file']}", rank=rank, world_size=world)
    model_name, steps = job["model"], job["steps"]
    config = make_config(model_name)
    torch.manual_seed(0)  # the same initial weights on every rank, as a trainer loading a checkpoint
    model = model_class(model_name)(config)
    mesh = init_device_mesh("cpu", (world,))
    if job.get("parallel", "fsdp") == "tp":  # tensor parallel attention: Shard(0) q/k/v, Shard(1) o_proj
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer.self_attn, mesh, {**plan, "o_proj": RowwiseParallel()})
    else:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    hf_config = json.loads(Path(job["config_path"]).read_text())
    plans = {
        fmt: plan_from_hf_config(hf_config, RefitSpec(model_type=model_name, fmt=fmt))
        for fmt in job["daemons"]
    }
    eval_tokens = torch.randint(
        0, SIZES["vocab_size"], (EVAL_BATCH, SEQ), generator=torch.Generator().manual_seed(99)
    )
    engine = model_class(model_name)(config) if rank == 0 else None
    with contextlib.ExitStack() as stack:
        clients = {
            fmt: stack.enter_context(RefitClient(endpoint, rank=rank, world_size=world, timeout=120))
            for fmt, endpoint in job["daemons"].items()
        }
        readers = {}
        if rank == 0:
            readers = {
                fmt: stack.enter_context(RefitReader(endpoint, name=f"check-{fmt}", timeout=120))
                for fmt, endpoint in job["daemons"].items()
            }
        for step in range(steps):
            # data parallel: each rank its own batch; tensor parallel: the same batch on every rank
            g = torch.Generator().manual_seed(
                1000 * step + (rank if job.get("parallel", "fsdp") == "fsdp" else 0)
            )
            tokens = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            sd = model.state_dict()
            kinds = sorted({str(p) for v in sd.values() if isinstance(v, DTensor) for p in v.placements})
            with Collectives() as seen:
                pushed = {fmt: client.push_step(step, sd) for fmt, client in clients.items()}
            # the checks: collectives from here on are the test's, not the push's
            with Collectives() as gathering:  # the counter sees what a gather would run
                full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}
            with torch.no_grad():
                trainer_logits = model(input_ids=eval_tokens).logits
            if rank != 0:
                continue
            # the baseline: the engine holding the masters as the checkpoint keeps them (BF16, the router
            # bias FP32), nothing quantized
            engine.load_state_dict(
                {
                    k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16).float()
                    for k, v in full.items()
                }
            )
            with torch.no_grad():
                kl_bf16 = kl(trainer_logits, engine(input_ids=eval_tokens).logits)
            for fmt, reader in readers.items():
                plan = plans[fmt]
                expected = convert(full, plan.spec)
                gen = reader.wait(min_step=step)
                try:
                    got = {n: t.clone() for n, t in gen.tensors.items()}
                finally:
                    reader.release(gen)
                differ = sorted(n for n in expected if n not in got or not same_bytes(got[n], expected[n]))
                extra = sorted(set(got) - set(expected))
                dtypes = {str(t.dtype) for n, t in got.items() if n.endswith("norm.weight")}
                engine.load_state_dict(engine_state_dict(engine, dequantized(got, plan)))
                with torch.no_grad():
                    engine_logits = engine(input_ids=eval_tokens).logits
                results.put(
                    {
                        "rank": rank,
                        "model": model_name,
                        "fmt": fmt,
                        "step": step,
                        "gen_step": gen.step,
                        "generation": pushed[fmt].generation,
                        "loss": float(loss.detach()),
                        "collectives": list(seen.calls),
                        "gather_collectives": len(gathering.calls),
                        "placements": kinds,
                        "differ": differ[:10],
                        "extra": extra[:10],
                        "outputs": len(expected),
                        "norm_dtypes": sorted(dtypes),
                        "kl": kl(trainer_logits, engine_logits),
                        "kl_bf16": kl_bf16,
                    }
                )
    results.put({"rank": rank, "done": True})
