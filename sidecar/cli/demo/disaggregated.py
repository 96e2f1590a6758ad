"""``refitd demo --layout disaggregated``: three nodes on this machine, verified.

One trainer node and two inference nodes, each a real ``refitd serve`` process: the trainer node's
daemon (two trainer rank processes push to it, as in the colocated demo) quantizes once and forwards
each sealed generation over CURVE-authenticated TCP to the inference daemons, which listen on their
own loopback addresses (127.0.0.2, 127.0.0.3). Each inference node runs a reference engine process and
a verifier; every step is checked byte for byte on both nodes. The table adds what crossed the wire
per step: the quantized generation forwarded to every node, against the BF16 weights that would have
been. ``--int4-group`` / ``--int4-scale-dtype`` / ``--nvfp4-names``: the engines hold that variant, and
the generation is planned, forwarded and published in it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sidecar.cli.demo.colocated import (
    WORLD_SIZE,
    Verifier,
    demo_params,
    demo_spec,
    engine,
    model_kwargs,
    wait_ready,
    weights,
)
from sidecar.cli.plan import human_bytes
from sidecar.cli.progress import Progress
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS

HOSTS = ("127.0.0.2", "127.0.0.3")


def gated_trainer(endpoint: str, rank: int, steps: int, kwargs: dict[str, Any], failures, gate) -> None:
    """One trainer rank: push each step once the demo has verified the previous one on every node."""
    import torch

    from sidecar.cli.demo.synthetic import shard_for_rank
    from sidecar.client.client import RefitClient, RefitError

    torch.set_num_threads(1)
    try:
        with RefitClient(endpoint, rank, WORLD_SIZE, local=(rank == 0), timeout=120) as client:
            for step in range(steps):
                gate.wait(timeout=300)
                client.push_step(step, shard_for_rank(weights(step, kwargs), rank, WORLD_SIZE))
    except (RefitError, Exception) as exc:
        failures.put(f"rank {rank}: {exc}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve(run_dir: Path, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli.main",
        "serve",
        "--runtime-dir",
        str(run_dir),
        "--log-level",
        "warning",
    ]
    return subprocess.Popen([*cmd, *args])


def _peers_at(status_reader, step: int, timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        peers = status_reader.status()["peers"]
        if all(p["last_step"] == step for p in peers.values()):
            return peers
    raise RuntimeError(f"the inference nodes did not all acknowledge step {step} within {timeout:.0f} s")


def run_disaggregated(args: argparse.Namespace) -> int:
    from adapters.base import RefitReader
    from sidecar.cli.demo.synthetic import make_hf_config
    from transport.curve import write_keypair

    kwargs = model_kwargs(args)
    # the format parameters the reference engines hold: the trainer node plans with them (the engines
    # attach to the inference nodes, whose daemons publish the forwarded generation as it came), and
    # every daemon is started with them, so each engine's manifest agrees with the plan at attach
    try:
        params = demo_params(args)
        spec = demo_spec(args.format, kwargs, params)
    except ValueError as exc:
        print(f"refitd demo: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    ctx = mp.get_context("spawn")
    daemons: list[subprocess.Popen] = []
    procs: list = []
    progress = Progress("demo", 0, units=args.steps, unit_name="step", quiet=getattr(args, "quiet", False))
    with progress, tempfile.TemporaryDirectory(prefix="refitd-demo-") as tmp:
        root = Path(tmp)
        progress.phase(f"starting {len(HOSTS) + 1} daemons (a trainer node, {len(HOSTS)} inference nodes)")
        config = root / "config.json"
        config.write_text(json.dumps(make_hf_config("qwen3_5_moe", **kwargs)))
        trainer_key, trainer_pub = write_keypair(root, "trainer")
        node_key, node_pub = write_keypair(root, "inference")
        endpoints = [f"tcp://{h}:{_free_port(h)}" for h in HOSTS]
        common = ("--format", args.format, "--layout", "disaggregated", "--forward-timeout", "20")
        if params != DEFAULT_FORMAT_PARAMS:
            common += ("--int4-group", str(params.int4_group), "--int4-scale-dtype", params.int4_scale_dtype)
            common += ("--nvfp4-names", params.nvfp4_names.value)
        locals_ = []
        for i, ep in enumerate(endpoints):
            run_dir = root / f"node{i}"
            daemons.append(
                _serve(
                    run_dir,
                    *common,
                    *("--role", "inference", "--model-type", "qwen3_5_moe", "--publish-bytes", "256MiB"),
                    *("--listen", ep, "--curve-secret-key", str(node_key)),
                    *("--curve-allowed-keys", str(trainer_pub)),
                )
            )
            locals_.append(f"ipc://{run_dir / 'control.sock'}")
        trainer_dir = root / "trainer"
        daemons.append(
            _serve(
                trainer_dir,
                *common,
                *("--role", "trainer", "--hf-config", str(config), "--world-size", str(WORLD_SIZE)),
                *("--peers", ",".join(endpoints), "--curve-secret-key", str(trainer_key)),
                *("--curve-server-key", str(node_pub)),
            )
        )
        trainer_ep = f"ipc://{trainer_dir / 'control.sock'}"
        failures, gate = ctx.Queue(), ctx.Barrier(WORLD_SIZE + 1)
        results = [ctx.Queue() for _ in endpoints]
        verifiers: list[Verifier] = []
        try:
            for ep, proc in zip([*locals_, trainer_ep], daemons):
                wait_ready(ep, proc)
            progress.phase(f"starting {len(locals_)} reference engines (processes of their own)")
            for i, ep in enumerate(locals_):
                attached = ctx.Event()
                procs.append(
                    ctx.Process(
                        target=engine,
                        args=(ep, args.format, args.steps, kwargs, results[i], attached, params),
                    )
                )
                procs[-1].start()
                if not attached.wait(120):
                    raise RuntimeError(f"the reference engine of node {i} did not attach within 120 s")
                verifiers.append(Verifier(ep, spec, kwargs))
                verifiers[-1].worker.attach(timeout=60)
            trainers = [
                ctx.Process(target=gated_trainer, args=(trainer_ep, r, args.steps, kwargs, failures, gate))
                for r in range(WORLD_SIZE)
            ]
            procs += trainers
            progress.phase(f"starting {WORLD_SIZE} trainer ranks; {args.steps} steps follow")
            for p in trainers:
                p.start()
            with RefitReader(trainer_ep, name="demo-status", timeout=120) as status:
                for step in range(args.steps):
                    gate.wait(timeout=300)
                    nodes = []
                    for i, verifier in enumerate(verifiers):
                        checked = verifier.worker.load_intact(min_step=step, timeout=120)
                        loaded = results[i].get(timeout=120)
                        bad = verifier.checked.get(checked.step, ["(not checked)"])
                        nodes.append({"published_exact": not bad, "mismatches": bad[:5], **loaded})
                        if (
                            checked.step != step
                            or bad
                            or not loaded.get("engine_exact")
                            or not loaded.get("ok")
                        ):
                            problems.append(
                                f"step {step} on node {i}: published mismatches {bad[:3]}, engine {loaded}"
                            )
                    peers = _peers_at(status, step)
                    record = next(h for h in status.status()["history"] if h["step"] == step)
                    rows.append({**record, "nodes": nodes, "forward": [peers[ep] for ep in endpoints]})
                    verified = all(n["published_exact"] and n.get("engine_exact") for n in nodes)
                    progress.unit_done(
                        f"step {step}, {'verified' if verified else 'NOT verified'} on every node"
                    )
            for v in verifiers:
                v.worker.detach()
            for p in procs:
                p.join(timeout=60)
            while not failures.empty():
                problems.append(failures.get())
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            gate.abort()
            for p in procs:
                if p.is_alive():
                    p.kill()
            for d in daemons:
                d.send_signal(signal.SIGTERM)
            for d in daemons:
                if d.wait(timeout=30) != 0:
                    problems.append(f"a daemon exited with status {d.returncode}")
    ok = not problems and len(rows) == args.steps
    _report(args, spec, endpoints, rows, ok, problems)
    return 0 if ok else 1


def _report(
    args, spec, endpoints: list[str], rows: list[dict[str, Any]], ok: bool, problems: list[str]
) -> None:
    per_step = [
        {
            "step": r["step"],
            "seconds": r["seconds"],
            "bytes_in": r["bytes_in"],
            "bytes_published": r["bytes_out"],
            "wire_fp8": sum(f["bytes"] for f in r["forward"]),
            "wire_bf16": sum(f["bytes_bf16"] for f in r["forward"]),
            "forward_s": [f["seconds"] for f in r["forward"]],
            "movers": [f["mover"] for f in r["forward"]],
            "kl": [n.get("kl") for n in r["nodes"]],
            "load_s": [n.get("load_s") for n in r["nodes"]],
            "published_exact": all(n["published_exact"] for n in r["nodes"]),
            "engine_exact": all(n.get("engine_exact") for n in r["nodes"]),
        }
        for r in rows
    ]
    if args.json:
        summary = {
            "layout": "disaggregated",
            "steps": len(rows),
            "format": spec.fmt.value,
            "format_params": spec.params.describe(spec.fmt),
            "nodes": endpoints,
            "per_step": per_step,
            "verified": ok,
            "problems": problems,
        }
        print(json.dumps(summary, indent=2))
        return
    print(
        f"refitd demo (disaggregated): synthetic qwen3_5_moe ({args.layers} layers + MTP, {args.experts} experts), "
        f"format {spec.fmt.value}{f' ({d})' if (d := spec.params.describe(spec.fmt)) else ''}; {WORLD_SIZE} trainer ranks -> trainer node daemon -> CURVE/TCP -> "
        f"{len(endpoints)} inference nodes ({', '.join(endpoints)}), 1 reference engine each"
    )
    print(
        f"{'step':>4} {'bytes in':>10} {'published':>10} {'quantize':>8} {'publish':>8} {'forward':>8} "
        f"{'load':>8} {'on wire':>10} {'BF16 would':>10} {'ratio':>6} {'KL vs bf16':>11}  verified"
    )
    for r in per_step:
        s = r["seconds"]
        verified = "yes" if r["published_exact"] and r["engine_exact"] else "NO"
        print(
            f"{r['step']:>4} {human_bytes(r['bytes_in']):>10} {human_bytes(r['bytes_published']):>10} "
            f"{s['quantize'] * 1e3:>6.1f}ms {s['publish'] * 1e3:>6.2f}ms "
            f"{max(x or 0 for x in r['forward_s']) * 1e3:>6.1f}ms {max(x or 0 for x in r['load_s']) * 1e3:>6.1f}ms "
            f"{human_bytes(r['wire_fp8']):>10} {human_bytes(r['wire_bf16']):>10} "
            f"{r['wire_fp8'] / max(1, r['wire_bf16']):>6.2f} {max(k or 0 for k in r['kl']):>11.2e}  {verified}"
        )
    movers = sorted({m for r in per_step for m in r["movers"] if m})
    print(
        f"bytes moved by: {', '.join(movers) or '-'}; verified on every node: every generation byte for byte, "
        "each engine holding exactly the published bytes"
        if ok
        else "VERIFICATION FAILED:\n  " + "\n  ".join(problems)
    )
