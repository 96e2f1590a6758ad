"""``summarize(plan)``: plain data describing a plan, for ``refitd plan`` and logs."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from sidecar.plan.build import RefitPlan
from sidecar.plan.spec import SUMMARY_LARGEST, Layer, Role, Unit, UnitKind, _layer_label, _layer_sort_key

# --------------------------------------------------------------------------------------------------
# summary

#: passthrough tensors grouped by what they are, for the summary; the first pattern that matches wins
_PASSTHROUGH_KINDS = (
    ("vision", re.compile(r"(?:^|\.)visual\.")),
    ("mtp", re.compile(r"\.(?:eh_proj|enorm|hnorm|shared_head)\.")),  # DeepSeek-V3/GLM-4.5 MTP glue
    ("attention", re.compile(r"\.self_attn\.")),
    ("linear_attention", re.compile(r"\.linear_attn\.")),
    ("shared_expert", re.compile(r"\.mlp\.shared_expert")),
    ("router", re.compile(r"\.mlp\.gate\.(?:weight|e_score_correction_bias)$")),
    ("dense_mlp", re.compile(r"\.mlp\.")),
    ("embeddings", re.compile(r"embed_tokens")),
    ("lm_head", re.compile(r"^lm_head\.")),
    ("norms", re.compile(r"norm[^.]*\.weight$")),
    ("mtp", re.compile(r"^mtp\.")),
)
ROUTED_KEPT_KIND = "routed_experts_bf16"


def _passthrough_kind(unit: Unit) -> str:
    if unit.keep_reason is not None:
        return ROUTED_KEPT_KIND
    name = unit.inputs[0]
    return next((kind for kind, pattern in _PASSTHROUGH_KINDS if pattern.search(name)), "other")


def summarize(plan: RefitPlan) -> dict[str, Any]:
    spec = plan.spec
    by_name = {i.name: i for i in plan.inputs}
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    kept_reasons: Counter[str] = Counter()
    layers: dict[Layer, dict[str, int]] = defaultdict(
        lambda: {"bytes_in": 0, "bytes_out": 0, "quantized_inputs": 0, "passthrough_inputs": 0}
    )
    quantized = {"slabs": 0, "expert_tensors": 0, "weights": 0, "params": 0, "bytes_in": 0, "bytes_out": 0}
    linears = {"tensors": 0, "params": 0, "bytes_in": 0, "bytes_out": 0}
    routed_params = 0
    for u in plan.units:
        row = layers[u.layer]
        row["bytes_in"] += u.bytes_in
        row["bytes_out"] += u.bytes_out
        params = sum(by_name[n].numel for n in u.inputs)
        if u.kind is UnitKind.PASSTHROUGH:
            row["passthrough_inputs"] += 1
            kind = kinds[_passthrough_kind(u)]
            kind["tensors"] += 1
            kind["bytes"] += u.bytes_in
            if u.keep_reason is not None:
                kept_reasons[u.keep_reason.value] += 1
                routed_params += params
            continue
        row["quantized_inputs"] += len(u.inputs)
        if u.kind is UnitKind.LINEAR:  # a non-expert linear the checkpoint's scheme quantizes
            linears["tensors"] += 1
            linears["params"] += params
            linears["bytes_in"] += u.bytes_in
            linears["bytes_out"] += u.bytes_out
            continue
        quantized["slabs" if u.kind is UnitKind.SLAB else "expert_tensors"] += len(u.inputs)
        quantized["weights"] += sum(o.role is Role.WEIGHT for o in u.outputs)
        quantized["params"] += params
        quantized["bytes_in"] += u.bytes_in
        quantized["bytes_out"] += u.bytes_out
        routed_params += params
    largest = sorted(plan.inputs, key=lambda i: -i.nbytes)[:SUMMARY_LARGEST]  # stable: input order
    unit_of = {n: plan.units[ix[0]] for n, ix in plan._units_of_input.items()}
    return {
        "model_type": spec.model_type,
        "format": spec.format.value,
        "format_params": spec.params.describe(spec.format),
        "num_hidden_layers": plan.num_hidden_layers,
        "num_first_layers_in_bf16": spec.num_first_layers_in_bf16,
        "num_last_layers_in_bf16": spec.num_last_layers_in_bf16,
        "ignore_patterns": list(spec.ignore_patterns),
        "keep_bf16_modules": len(plan.keep_bf16),
        "counts": {"inputs": len(plan.inputs), "outputs": len(plan.outputs), "units": len(plan.units)},
        "quantized": quantized,
        "quantize_linears": bool(spec.quantize_linears),
        "linears": linears,
        "share": None
        if plan.share is None
        else {
            "ep": plan.share[0].ep,
            "tp": plan.share[0].tp,
            "nodes": plan.share[0].nodes,
            "node": plan.share[1],
            "dropped_inputs": len(plan.dropped),
        },
        "kept_bf16_experts": dict(sorted(kept_reasons.items())),
        "passthrough": dict(sorted(kinds.items())),
        "routed_expert_params": routed_params,
        "layers": [
            {"layer": _layer_label(lay), **row}
            for lay, row in sorted(layers.items(), key=lambda kv: _layer_sort_key(kv[0]))
        ],
        "memory": daemon_memory(plan),
        "totals": {
            "bytes_in": plan.bytes_in,
            "bytes_out": plan.bytes_out,
            "ratio": plan.bytes_out / plan.bytes_in if plan.bytes_in else 0.0,
        },
        "largest": [
            {
                "name": i.name,
                "shape": list(i.shape),
                "dtype": str(i.dtype).removeprefix("torch."),
                "nbytes": i.nbytes,
                "action": "quantize" if unit_of[i.name].fmt is not None else "passthrough",
            }
            for i in largest
        ],
    }


def daemon_memory(plan: RefitPlan) -> dict[str, int]:
    """What a daemon serving ``plan`` allocates: staging (whole steps, or a ring of the default GPU
    region count) and each of its two publish generations, in bytes as the arenas carve them."""
    from sidecar.config.settings import DEFAULT_GPU_REGIONS
    from sidecar.daemon.memory.generations import N_GENERATIONS, layouts
    from sidecar.daemon.memory.staging import region_size, ring_groups

    staging, outputs = layouts(plan)
    groups = ring_groups(plan)
    regions = min(DEFAULT_GPU_REGIONS, len(groups))
    return {
        "staging_whole": staging.size,
        "ring_groups": len(groups),
        "ring_regions": regions,
        "ring_region": region_size(groups),
        "staging_ring": regions * region_size(groups),
        "generation": outputs.size,
        "generations": N_GENERATIONS,
    }


# --------------------------------------------------------------------------------------------------
# memory per tier (refitd plan)


@dataclass(frozen=True, slots=True)
class NodeShape:
    """A node's memory as the planner weighs it: GPUs, HBM per GPU, host RAM (bytes)."""

    name: str
    gpus: int
    hbm: int
    host_ram: int
    source: str


#: ``refitd plan --node-shape``: the defaults the issue asks for, with where the figures come from
NODE_SHAPES = {
    "h200": NodeShape(
        "8 x H200",
        8,
        141 * 10**9,
        2 << 40,
        "H200 SXM: 141 GB HBM3e per GPU (NVIDIA H200 datasheet); host RAM varies by server, 2 TiB assumed",
    ),
    "gb200": NodeShape(
        "GB200 NVL72 compute tray",
        4,
        186 * 10**9,
        960 * 10**9,
        "NVL72: 13.4 TB HBM3e over 72 GPUs = 186 GB each; 17 TB LPDDR5X over 36 Grace CPUs = ~480 GB "
        "each, 2 per tray (NVIDIA GB200 NVL72 specifications)",
    ),
}


def memory_tiers(
    plan: RefitPlan, shape: NodeShape, *, budget: int, regions: int, host_generations: bool = True
) -> dict[str, Any]:
    """What a daemon serving ``plan`` (one node's: a share when the engine spans nodes) needs per
    tier on a node of ``shape``: per GPU (its rings, under ``budget``) and per node (the host
    generations; with shm arenas, whole-step staging too), and whether each fits, with what to
    change where it does not."""
    from sidecar.daemon.memory.generations import N_GENERATIONS, layouts
    from sidecar.daemon.memory.tiers import BudgetTooSmall, fit_device_tier

    staging, outputs = layouts(plan)
    out: dict[str, Any] = {
        "shape": {"name": shape.name, "gpus": shape.gpus, "hbm": shape.hbm, "host_ram": shape.host_ram},
        "source": shape.source,
        "budget": budget,
        "residency": "host" if host_generations else "device",
        "generation": outputs.size,
        "generations": N_GENERATIONS,
        "host_generations": N_GENERATIONS * outputs.size if host_generations else 0,
        "cpu_path_host": staging.size + N_GENERATIONS * outputs.size,
        "problems": [],
    }
    # host generations: the ring groups spread over the node's GPUs (docs/multi_gpu.md,
    # "Per-GPU work", with ``gpus`` listing them), each GPU's rings within the budget
    spread = shape.gpus if host_generations else 1
    try:
        tier = fit_device_tier(
            plan, regions=regions, budget=budget, host_generations=host_generations, gpus=spread
        )
        out["gpu"] = {
            "gpus": spread,
            "groups_per_gpu": -(-tier.groups // spread),
            "regions": tier.regions,
            "groups": tier.groups,
            "split": tier.max_group_bytes is not None,
            "staging_region": tier.staging_region,
            "publish_region": tier.publish_region,
            "staging_ring": tier.staging,
            "publish_ring": tier.publish,
            "generations": tier.generations,
            "device_bytes": tier.device_bytes,
        }
    except BudgetTooSmall as exc:
        out["gpu"] = None
        out["problems"].append(str(exc))
    if budget > shape.hbm:
        out["problems"].append(
            f"device_budget ({budget / 2**30:.2f} GiB) is more than a GPU's HBM ({shape.hbm / 2**30:.2f} GiB): "
            "lower --device-budget"
        )
    if out["host_generations"] > shape.host_ram:
        out["problems"].append(
            f"the two host generations need {out['host_generations'] / 2**30:.2f} GiB but the node has "
            f"{shape.host_ram / 2**30:.2f} GiB of host memory: spread the engine over more nodes "
            "(--engine-ep/--nodes: each node holds its share), or publish a smaller format"
        )
    out["fits"] = not out["problems"]
    return out
