"""``refitd demo``: the parser, and the dispatch to the layout asked for (each layout is its own module)."""

from __future__ import annotations

import argparse
import sys

from sidecar.cli.demo.colocated import DEFAULT_MODEL, MODELS
from sidecar.numerics.formats import INT4_SCALE_DTYPE_NAMES, Format, Nvfp4Names


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run refitd end to end on a small synthetic model (CPU) and verify it")
    p.add_argument("--format", default="block_fp8", choices=[f.value for f in Format])
    p.add_argument("--int4-group", type=int, default=None, help="int4_w4a16: the group the engine holds")
    p.add_argument(
        "--int4-scale-dtype", choices=INT4_SCALE_DTYPE_NAMES, default=None, help="int4_w4a16: its scale dtype"
    )
    p.add_argument(
        "--nvfp4-names", choices=[n.value for n in Nvfp4Names], default=None, help="nvfp4: the names it loads"
    )
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS, help="the synthetic model's family")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument(
        "--layout",
        default="colocated",
        choices=["colocated", "disaggregated"],
        help="disaggregated: a trainer node's daemon forwards the quantized generation to two inference nodes' "
        "daemons (loopback)",
    )
    p.add_argument(
        "--staging-regions",
        type=int,
        default=0,
        help="stream each step through N layer-sized staging regions (the GPU default is 4); 0: whole steps",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary object instead of the table")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (by default: each phase and step as it ends; a bar on a terminal)",
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.layout == "disaggregated":
        if args.model != DEFAULT_MODEL:
            print(f"refitd demo: --layout disaggregated runs {DEFAULT_MODEL} only", file=sys.stderr)
            return 2
        from sidecar.cli.demo.disaggregated import run_disaggregated

        return run_disaggregated(args)
    from sidecar.cli.demo.colocated import run_colocated

    return run_colocated(args)
