"""``refitd demo``: the whole path on this machine's CPU, verified.

Starts a real daemon (``refitd serve`` in a subprocess), two trainer rank processes that push a small
synthetic Qwen3.5-MoE model for several steps (the weights change every step, as training changes
them; rank 0 writes into shared memory, rank 1 streams over ZeroMQ), and reads every published
generation back here, checking it byte for byte against the in-process conversion of the same
weights. Prints a per-step table; exits non-zero if any byte differs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sidecar.formats import Format
from sidecar.plan_cli import human_bytes

WORLD_SIZE = 2
SEED_BASE = 1000  # step s trains to weights drawn with seed SEED_BASE + s


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run refitd end to end on a small synthetic model (CPU) and verify it")
    p.add_argument("--format", default="block_fp8", choices=[f.value for f in Format])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON summary object instead of the table")
    p.set_defaults(run=run)
    return p


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"num_layers": args.layers, "num_experts": args.experts, "unaligned": True}


def weights(step: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    from sidecar.synthetic import make_state_dict

    return make_state_dict("qwen3_5_moe", seed=SEED_BASE + step, **kwargs)


def trainer(endpoint: str, rank: int, steps: int, kwargs: dict[str, Any], failures) -> None:
    """One trainer rank: push this rank's shards of every step's weights."""
    from sidecar.client import RefitClient, RefitError
    from sidecar.synthetic import shard_for_rank

    try:
        with RefitClient(endpoint, rank, WORLD_SIZE, local=(rank == 0), timeout=120) as client:
            for step in range(steps):
                client.push_step(step, shard_for_rank(weights(step, kwargs), rank, WORLD_SIZE))
    except RefitError as exc:
        failures.put(f"rank {rank}: {exc}")


def start_daemon(run_dir: Path, config: Path, fmt: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli",
        "serve",
        "--runtime-dir",
        str(run_dir),
        "--hf-config",
        str(config),
    ]
    cmd += ["--world-size", str(WORLD_SIZE), "--format", fmt, "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    return proc, f"ipc://{run_dir / 'control.sock'}"


def wait_ready(endpoint: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    from adapters.base import RefitReader
    from sidecar.errors import RefitError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {proc.returncode} before it was ready")
        reader = RefitReader(endpoint, name="demo-probe")
        try:
            reader.status(timeout=1.0)
            return
        except RefitError:
            continue
        finally:
            reader.close()
    raise RuntimeError(f"the daemon did not answer within {timeout:.0f} s")


def verify(gen, expected: dict[str, torch.Tensor]) -> list[str]:
    bad = [n for n in expected if n not in gen.tensors]
    for name, want in expected.items():
        got = gen.tensors.get(name)
        if got is not None and not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            bad.append(name)
    return bad


def run(args: argparse.Namespace) -> int:
    from adapters.base import RefitReader
    from sidecar.plan import RefitSpec, convert
    from sidecar.synthetic import make_hf_config

    kwargs = model_kwargs(args)
    spec = RefitSpec(model_type="qwen3_5_moe", fmt=args.format)
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="refitd-demo-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(make_hf_config("qwen3_5_moe", **kwargs)))
        daemon, endpoint = start_daemon(Path(tmp) / "run", config, args.format)
        ctx = mp.get_context("spawn")
        failures = ctx.Queue()
        trainers = []
        try:
            wait_ready(endpoint, daemon)
            trainers = [
                ctx.Process(target=trainer, args=(endpoint, r, args.steps, kwargs, failures))
                for r in range(WORLD_SIZE)
            ]
            for p in trainers:
                p.start()
            reader = RefitReader(endpoint, name="demo-reader", timeout=120)
            previous: dict[str, torch.Tensor] | None = None
            try:
                for step in range(args.steps):
                    gen = reader.wait(min_step=step)
                    expected = convert(weights(step, kwargs), spec)
                    bad = verify(gen, expected)
                    changed = _changed_fraction(previous, expected)
                    previous = {k: v.clone() for k, v in expected.items()}
                    record = next(h for h in reader.status()["history"] if h["step"] == gen.step)
                    rows.append({**record, "verified": not bad, "mismatches": bad[:5], "changed": changed})
                    ok &= not bad
                    reader.release(gen)
            finally:
                reader.close()
            for p in trainers:
                p.join(timeout=60)
            while not failures.empty():
                print(failures.get(), file=sys.stderr)
                ok = False
        finally:
            for p in trainers:
                if p.is_alive():
                    p.kill()
            daemon.send_signal(signal.SIGTERM)
            rc = daemon.wait(timeout=30)
            ok &= rc == 0
    _report(args, spec, rows, ok)
    return 0 if ok and len(rows) == args.steps else 1


def _changed_fraction(previous: dict[str, torch.Tensor] | None, current: dict[str, torch.Tensor]) -> float:
    """Fraction of published bytes that differ from the previous step's."""
    if previous is None:
        return 1.0
    total = changed = 0
    for name, t in current.items():
        a, b = (
            t.contiguous().view(torch.uint8).reshape(-1),
            previous[name].contiguous().view(torch.uint8).reshape(-1),
        )
        total += a.numel()
        changed += int((a != b).sum())
    return changed / max(1, total)


def _report(args: argparse.Namespace, spec, rows: list[dict[str, Any]], ok: bool) -> None:
    if args.json:
        summary = {
            "steps": len(rows),
            "format": spec.fmt.value,
            "bytes_in": rows[0]["bytes_in"] if rows else 0,
            "bytes_published": rows[0]["bytes_out"] if rows else 0,
            "per_step": [
                {
                    "step": r["step"],
                    "seconds": r["seconds"],
                    "changed": r["changed"],
                    "verified": r["verified"],
                }
                for r in rows
            ],
            "verified": ok,
        }
        print(json.dumps(summary, indent=2))
        return
    print(
        f"refitd demo: synthetic qwen3_5_moe ({args.layers} layers + MTP, {args.experts} experts), format "
        f"{spec.fmt.value}, {WORLD_SIZE} trainer ranks (rank 0 via shared memory, rank 1 via ZeroMQ frames)"
    )
    head = f"{'step':>4} {'bytes in':>10} {'bytes out':>10} {'receive':>8} {'validate':>8} {'quantize':>8} {'publish':>8} {'total':>8} {'changed':>8}  verified"
    print(head)
    for r in rows:
        s = r["seconds"]
        print(
            f"{r['step']:>4} {human_bytes(r['bytes_in']):>10} {human_bytes(r['bytes_out']):>10} "
            f"{s['receive'] * 1e3:>6.1f}ms {s['validate'] * 1e3:>6.1f}ms {s['quantize'] * 1e3:>6.1f}ms "
            f"{s['publish'] * 1e3:>6.2f}ms {s['total'] * 1e3:>6.1f}ms {r['changed'] * 100:>7.1f}%  "
            + ("yes" if r["verified"] else f"NO: {r['mismatches']}")
        )
    print("all generations verified byte for byte" if ok else "VERIFICATION FAILED")
