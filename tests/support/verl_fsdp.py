"""A verl actor rank for ``tests/test_integration_verl.py``: a tiny transformers Qwen3-MoE under FSDP2
(``fully_shard``, gloo, CPU), its weights exported by verl 0.9.1's own
``FSDPEngine.get_per_tensor_param`` and handed to refitd's verl backend as verl's actor worker does
(``await checkpoint_engine.send_weights(per_tensor_param, global_steps=...)``).

``get_per_tensor_param`` is verl's real method, run on an object holding only what it reads (the FSDP
module, the model config, verl's offload flags): building a whole ``FSDPEngine`` needs verl's worker
configs, an optimizer and a device mesh of its own, none of which the export touches. Two CPU
workarounds, both names in verl's module rebound, nothing else touched: ``get_device_id()`` (a CUDA
index: ``param.to(device)`` must stay on the CPU) returns "cpu", and ``log_gpu_memory_usage`` (it asks
``torch.cuda.mem_get_info``, which a CPU torch refuses) does nothing.

Started with the ``spawn`` context, one process per rank; rank 0 also writes the gathered weights
(verl's same export, iterated again by every rank) as the BF16 checkpoint the test converts with
``refitd convert``.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

SIZES: dict[str, Any] = dict(vocab_size=131, hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
EXPERTS = 5  # odd: FSDP2's dim-0 shards are uneven


def make_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **SIZES, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=2, dtype="bfloat16", tie_word_embeddings=False,
    )  # fmt: skip


def verl_export(module: torch.nn.Module, hf_config) -> Any:
    """verl's own ``FSDPEngine.get_per_tensor_param`` over ``module``: a generator of gathered tensors."""
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.get_device_id = lambda: "cpu"  # the CPU workarounds (module doc)
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None
    holder = SimpleNamespace(
        module=module,
        model_config=SimpleNamespace(lora={}, hf_config=hf_config),
        _uses_fsdp2_cpu_offload_policy=False,
        _is_offload_param=False,
        _qat_enabled=False,
    )
    per_tensor, peft = transformer_impl.FSDPEngine.get_per_tensor_param(holder)
    assert peft is None
    return per_tensor


def run_rank(rank: int, world: int, job: dict[str, Any], results, checked) -> None:
    """``checked[i]``: set by the test once it compared step i (the next push replaces it)."""
    try:
        _run_rank(rank, world, job, results, checked)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(rank: int, world: int, job: dict[str, Any], results, checked) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeForCausalLM
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job['init_file']}", rank=rank, world_size=world)
    config = make_config()
    torch.manual_seed(0)  # the same initial weights on every rank, as from a checkpoint
    model = Qwen3MoeForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # what verl's actor worker does in init_model: its config dataclass, the custom module, the registry
    ce_config = omega_conf_to_dataclass(job["checkpoint_engine"])
    import_external_libs(ce_config.custom_backend_module or None)
    engine = CheckpointEngineRegistry.new(
        ce_config.backend,
        is_master=dist.get_rank() == 0,
        bucket_size=ce_config.update_weights_bucket_megabytes << 20,
        **ce_config.engine_kwargs.get(ce_config.backend, {}),
    )
    engine.init_process_group(rank=rank, world_size=world)
    for i, step in enumerate(job["steps"]):
        g = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=g)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad()
        metrics = asyncio.run(engine.send_weights(verl_export(model, config), global_steps=step))
        # the checkpoint the test converts: verl's same export, every rank iterating it (collectives)
        t0 = time.perf_counter()  # the baseline: verl's export alone (its gathers), cast as the push casts
        full = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in verl_export(model, config)}
        export_s = time.perf_counter() - t0
        dtypes = sorted({str(t.dtype) for _, t in verl_export(model, config)})
        if rank == 0:
            out = Path(job["out"]) / f"step{step}"
            out.mkdir(parents=True)
            save_file(full, str(out / "model.safetensors"))
            (out / "config.json").write_text(json.dumps(job["hf_config"]))
        results.put(
            {
                "rank": rank,
                "step": step,
                "metrics": metrics,
                "names": len(full),
                "dtypes": dtypes,
                "export_s": export_s,
            }
        )
        if not checked[i].wait(240):
            raise TimeoutError(f"the test never checked step {step}")
    engine.close()
    results.put({"rank": rank, "done": True})
