"""``refitd plan CONFIG.json --format FMT``: what a refit of this model would publish, without weights.

Builds the plan on the parameter list the config describes (names and shapes only), then prints
what is quantized and what passes through, bytes in and out per layer, totals with the in/out
ratio, and the largest tensors. ``--json`` prints the same data as one JSON object. With an engine
layout (``--engine-ep N --engine-tp N --nodes N``) it also plans what one node publishes (``--node``,
default 0): its share of the routed experts and everything else whole, and that node's generation
memory against the whole model's. Then the memory per tier (``--node-shape h200``, 8 x 141 GB HBM
and 2 TiB of host memory, or ``gb200``, a GB200 NVL72 tray; ``--gpus``, ``--hbm``, ``--host-ram``
override it): per GPU the staging and publish rings within ``--device-budget`` (4 GiB), per node the
two host generations, and what to change where a configuration does not fit.

Exit codes: 0 ok; 1 the plan cannot be built (the message says why); 2 usage (unreadable file, bad
JSON, unknown format).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sidecar.numerics.formats import INT4_SCALE_DTYPE_NAMES, Format, FormatParams, Nvfp4Names
from sidecar.plan.build import EngineLayout, RefitSpec, plan_from_hf_config
from sidecar.plan.models import model_type_of
from sidecar.plan.summary import NODE_SHAPES, NodeShape, memory_tiers, summarize

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``1.50 GiB``)."""
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _format_arg(value: str) -> Format:
    try:
        return Format.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_arg(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a layer count >= 0")
    return n


def _positive_arg(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count >= 1")
    return n


def _size_arg(value: str) -> int:
    from sidecar.config.values import parse_size

    try:
        n = parse_size(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size > 0 (such as 4GiB)")
    return n


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="show what a refit of a model would quantize and publish (no weights needed)",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("config", metavar="CONFIG.json", help="the model's Hugging Face config.json")
    parser.add_argument(
        "--format",
        required=True,
        type=_format_arg,
        metavar="FMT",
        help=f"target format of the routed experts: {', '.join(f.value for f in Format)}",
    )
    parser.add_argument(
        "--int4-group",
        type=_positive_arg,
        default=None,
        metavar="G",
        help="int4_w4a16: the group size along K the engine loads (32 by default; 64, 128)",
    )
    parser.add_argument(
        "--int4-scale-dtype",
        choices=INT4_SCALE_DTYPE_NAMES,
        default=None,
        help="int4_w4a16: the dtype of the engine's weight_scale (bfloat16 by default)",
    )
    parser.add_argument(
        "--nvfp4-names",
        choices=[n.value for n in Nvfp4Names],
        default=None,
        help="nvfp4: ModelOpt's names (default) or compressed-tensors' (weight_packed, weight_global_scale)",
    )
    parser.add_argument(
        "--first-bf16", type=_count_arg, default=0, metavar="N", help="first N layers in BF16"
    )
    parser.add_argument("--last-bf16", type=_count_arg, default=0, metavar="N", help="last N layers in BF16")
    parser.add_argument(
        "--ignore",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="fnmatch patterns over module names whose routed experts stay BF16",
    )
    parser.add_argument(
        "--linears",
        choices=("checkpoint", "yes", "no"),
        default="checkpoint",
        help="also quantize attention/dense-MLP/shared-expert linears: as the config's quantization_config "
        "says (default), always, or never",
    )
    parser.add_argument(
        "--engine-ep", type=_positive_arg, default=None, metavar="N", help="engine expert parallel size"
    )
    parser.add_argument(
        "--engine-tp", type=_positive_arg, default=1, metavar="N", help="engine tensor parallel size"
    )
    parser.add_argument("--nodes", type=_positive_arg, default=1, metavar="N", help="nodes the engine spans")
    parser.add_argument(
        "--node", type=_count_arg, default=0, metavar="K", help="the node to plan the share of"
    )
    from sidecar.config.settings import DEFAULT_DEVICE_BUDGET, DEFAULT_GPU_REGIONS

    parser.add_argument(
        "--node-shape",
        choices=sorted(NODE_SHAPES),
        default="h200",
        help="the node the memory tiers are weighed against: h200 (8 x H200, 2 TiB host) or gb200 "
        "(a GB200 NVL72 tray: 4 GPUs, ~960 GB host)",
    )
    parser.add_argument("--gpus", type=_positive_arg, default=None, metavar="N", help="GPUs per node")
    parser.add_argument("--hbm", type=_size_arg, default=None, metavar="SIZE", help="HBM per GPU (141GB)")
    parser.add_argument(
        "--host-ram", type=_size_arg, default=None, metavar="SIZE", help="host memory per node"
    )
    parser.add_argument(
        "--device-budget",
        type=_size_arg,
        default=DEFAULT_DEVICE_BUDGET,
        metavar="SIZE",
        help="device memory the daemon may use per GPU (refitd serve --device-budget; default 4GiB)",
    )
    parser.add_argument(
        "--residency",
        choices=("host", "device"),
        default="host",
        help="where the generations live with GPU arenas (refitd serve --generation-residency)",
    )
    parser.add_argument(
        "--regions",
        type=_positive_arg,
        default=DEFAULT_GPU_REGIONS,
        metavar="N",
        help=f"ring regions (refitd serve --staging-regions; default {DEFAULT_GPU_REGIONS})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)
    return parser


def _read_config(path: str) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise _UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _UsageError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _UsageError(f"{path} holds a JSON {type(config).__name__}, not a config object")
    return config


class _UsageError(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        config = _read_config(args.config)
    except _UsageError as exc:
        print(f"refitd plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        spec = RefitSpec(
            model_type=model_type_of(config),
            fmt=args.format,
            num_first_layers_in_bf16=args.first_bf16,
            num_last_layers_in_bf16=args.last_bf16,
            ignore_patterns=tuple(args.ignore),
            quantize_linears={"checkpoint": None, "yes": True, "no": False}[args.linears],
            params=format_params_of(args),
        )
        node_plan = plan_from_hf_config(config, spec)
        summary = summarize(node_plan)
        if args.engine_ep is not None or args.nodes > 1 or args.engine_tp > 1:
            layout = EngineLayout(ep=args.engine_ep or 1, tp=args.engine_tp, nodes=args.nodes)
            node_plan = plan_from_hf_config(config, spec, share=(layout, args.node))
            share = summarize(node_plan)
            summary["node_share"] = {**share["share"], "memory": share["memory"], "totals": share["totals"]}
        summary["tiers"] = memory_tiers(
            node_plan,
            _shape(args),
            budget=args.device_budget,
            regions=args.regions,
            host_generations=args.residency == "host",
        )
    except ValueError as exc:
        print(f"refitd plan: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    summary["config"] = str(args.config)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(render_text(summary))
    return EXIT_OK


def format_params_of(args: argparse.Namespace) -> FormatParams:
    """The format parameters the flags give (``--int4-group``, ``--int4-scale-dtype``,
    ``--nvfp4-names``), the defaults for those not given; ValueError for one of another format."""
    given = {
        "int4_group": args.int4_group,
        "int4_scale_dtype": args.int4_scale_dtype,
        "nvfp4_names": args.nvfp4_names,
    }
    return FormatParams(**{k: v for k, v in given.items() if v is not None})


def _shape(args: argparse.Namespace) -> NodeShape:
    base = NODE_SHAPES[args.node_shape]
    if args.gpus is None and args.hbm is None and args.host_ram is None:
        return base
    return NodeShape(
        f"{base.name} (changed)",
        base.gpus if args.gpus is None else args.gpus,
        base.hbm if args.hbm is None else args.hbm,
        base.host_ram if args.host_ram is None else args.host_ram,
        base.source + "; overridden by flags",
    )


def render_tiers(t: dict[str, Any], share: dict[str, Any] | None) -> list[str]:
    """The memory per tier: per GPU (rings within the budget) and per node (host generations)."""
    shape, gpu = t["shape"], t["gpu"]
    whose = f"node {share['node']}'s share" if share else "the whole model"
    lines = [
        "",
        f"memory per tier on {shape['name']}: {shape['gpus']} GPUs x {human_bytes(shape['hbm'])} HBM, "
        f"{human_bytes(shape['host_ram'])} host; generations in {t['residency']} memory ({whose})",
        f"  ({t['source']})",
    ]
    if gpu is not None:
        cut = (
            f", layers cut into parts ({gpu['groups']} groups)"
            if gpu["split"]
            else f", {gpu['groups']} groups"
        )
        ok = "fits" if gpu["device_bytes"] <= t["budget"] <= shape["hbm"] else "DOES NOT FIT"
        lines += [
            f"  per GPU (arena = cuda): {gpu['regions']} ring regions{cut}",
            f"    staging ring  {gpu['regions']} x {human_bytes(gpu['staging_region']):>10} = "
            f"{human_bytes(gpu['staging_ring']):>10}",
            f"    publish ring  {gpu['regions']} x {human_bytes(gpu['publish_region']):>10} = "
            f"{human_bytes(gpu['publish_ring']):>10}",
        ]
        if gpu["generations"]:
            lines.append(f"    generations   2 x {human_bytes(gpu['generations'] // 2):>10}")
        lines.append(
            f"    in all {human_bytes(gpu['device_bytes'])} (as allocated) of a {human_bytes(t['budget'])} "
            f"budget: {ok}"
        )
        if gpu.get("gpus", 1) > 1:
            lines.append(
                f"    on each of the node's {gpu['gpus']} GPUs (gpus = all of them: ring groups spread, "
                f"~{gpu['groups_per_gpu']} of {gpu['groups']} per GPU, each GPU quantizing and copying out "
                "its own); every engine GPU loads from host memory over its own link"
            )
        else:
            lines.append(
                f"    on 1 of the node's {shape['gpus']} GPUs; every engine GPU loads from host memory over "
                "its own link"
            )
    host_ok = "fits" if t["host_generations"] <= shape["host_ram"] else "DOES NOT FIT"
    lines.append(
        f"  per node: {t['generations']} host generations x {human_bytes(t['generation'])} = "
        f"{human_bytes(t['host_generations'])} page-locked, of {human_bytes(shape['host_ram'])}: {host_ok}"
    )
    lines.append(
        f"  (CPU path, arena = shm: whole-step staging + generations = {human_bytes(t['cpu_path_host'])} of host memory)"
    )
    for problem in t["problems"]:
        lines.append(f"  does not fit: {problem}")
    return lines


def render_text(s: dict[str, Any]) -> str:
    """The human-readable report of a plan summary."""
    q, totals = s["quantized"], s["totals"]
    ignore = ", ".join(s["ignore_patterns"]) or "none"
    lines = [
        f"refitd plan: {s['config']}",
        f"model {s['model_type']}, {s['num_hidden_layers']} layers; routed experts -> {s['format']}"
        + (f" ({s['format_params']})" if s.get("format_params") else ""),
        f"BF16 exclusions: first {s['num_first_layers_in_bf16']}, last {s['num_last_layers_in_bf16']} "
        f"layers; ignore patterns: {ignore}",
        "",
        "quantized (routed experts):",
        f"  {q['slabs']} grouped slabs + {q['expert_tensors']} per-expert tensors -> {q['weights']} FP8 weights",
        f"  {q['params']:,} params: {human_bytes(q['bytes_in'])} in -> {human_bytes(q['bytes_out'])} out",
    ]
    kept = s["kept_bf16_experts"]
    if kept:
        reasons = ", ".join(f"{k} {v}" for k, v in kept.items())
        lines.append(f"routed-expert tensors kept BF16: {sum(kept.values())} ({reasons})")
    lines.append("passthrough (bit for bit):")
    for kind, row in s["passthrough"].items():
        lines.append(f"  {kind:<22} {row['tensors']:>7} tensors  {human_bytes(row['bytes']):>12}")
    lin = s["linears"]
    if lin["tensors"]:
        lines.append(
            f"quantized (linears, the checkpoint's scheme): {lin['tensors']} tensors, {lin['params']:,} params: "
            f"{human_bytes(lin['bytes_in'])} in -> {human_bytes(lin['bytes_out'])} out"
        )
    lines += [
        "",
        f"  {'layer':<7} {'bytes in':>12} {'bytes out':>12} {'out/in':>7} {'quantized':>9} {'passthru':>8}",
    ]
    for row in s["layers"]:
        ratio = row["bytes_out"] / row["bytes_in"] if row["bytes_in"] else 0.0
        lines.append(
            f"  {row['layer']:<7} {human_bytes(row['bytes_in']):>12} {human_bytes(row['bytes_out']):>12} "
            f"{ratio:>7.3f} {row['quantized_inputs']:>9} {row['passthrough_inputs']:>8}"
        )
    counts = s["counts"]
    lines += [
        "",
        f"total: {human_bytes(totals['bytes_in'])} in ({counts['inputs']} tensors) -> "
        f"{human_bytes(totals['bytes_out'])} out ({counts['outputs']} tensors), out/in {totals['ratio']:.3f}",
        f"routed-expert params: {s['routed_expert_params']:,}",
    ]
    m = s["memory"]
    gens = m["generations"] * m["generation"]
    ring = f"ring of {m['ring_regions']} x {human_bytes(m['ring_region'])}, {m['ring_groups']} layer groups"
    lines += [
        "",
        f"daemon memory in one place (shm, or generation_residency = device): {m['generations']} "
        f"generations of {human_bytes(m['generation'])}, plus staging:",
        f"  {'':<50} {'staging':>12} {'in all':>12}",
        f"  {'whole steps (staging_regions = 0; shm default)':<50} {human_bytes(m['staging_whole']):>12} "
        f"{human_bytes(m['staging_whole'] + gens):>12}",
        f"  {ring:<50} {human_bytes(m['staging_ring']):>12} {human_bytes(m['staging_ring'] + gens):>12}",
    ]
    if (share := s.get("node_share")) is not None:
        nm = share["memory"]
        lines += [
            "",
            f"node {share['node']} of {share['nodes']} (engine EP {share['ep']}, TP {share['tp']}): a generation of "
            f"{human_bytes(nm['generation'])}, {nm['generation'] / m['generation']:.3f} of the whole model's; "
            f"{share['dropped_inputs']} per-expert inputs of other nodes dropped",
            f"  {nm['generations']} generations {human_bytes(nm['generations'] * nm['generation'])}; "
            f"with whole-step staging {human_bytes(nm['staging_whole'] + nm['generations'] * nm['generation'])}",
        ]
    if "tiers" in s:
        lines += render_tiers(s["tiers"], s.get("node_share"))
    lines += ["", "largest inputs:"]
    for t in s["largest"]:
        shape = "x".join(map(str, t["shape"]))
        lines.append(
            f"  {human_bytes(t['nbytes']):>12}  {t['action']:<11} {t['name']} [{shape}] {t['dtype']}"
        )
    return "\n".join(lines)
