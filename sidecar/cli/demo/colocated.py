"""``refitd demo``: the whole path on this machine's CPU, verified.

Starts a real daemon (``refitd serve`` in a subprocess), a reference engine process that attaches
with its manifest and loads every generation, and two trainer rank processes that push a small
synthetic Qwen3.5-MoE model (or, with ``--model deepseek_v3``, a DeepSeek-V3-shaped one: MLA, a
dense first layer, shared experts, the FP32 router bias, an MTP layer, block-FP8 linears as its
checkpoint's quantization_config says) for several steps (the weights change every step, as an optimizer
changes them; rank 0 writes into shared memory, rank 1 streams over ZeroMQ) and wait until the
engine has loaded each step. Then it checks, per step:

* the published generation, byte for byte, against the in-process conversion of the same weights;
* that the engine holds exactly the published bytes (every parameter, byte for byte, against an
  engine loaded straight from that conversion);
* how far the engine's next-token distributions are from the BF16 model's (KL divergence).

Prints a per-step table (or ``--json``); exits non-zero if any check fails.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sidecar.cli.plan import human_bytes
from sidecar.cli.progress import Progress
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams

WORLD_SIZE = 2
DEFAULT_MODEL = "qwen3_5_moe"
MODELS = ("qwen3_5_moe", "deepseek_v3")
BASE_SEED = 1000
LEARNING_RATE = 2e-3  # each step moves every weight by about this fraction of its scale


# --------------------------------------------------------------------------------------------------
# the model and its "training"


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic model's arguments; ``model_type`` is there only when it is not the default."""
    kwargs: dict[str, Any] = {"num_layers": args.layers, "num_experts": args.experts, "unaligned": True}
    if getattr(args, "model", DEFAULT_MODEL) != DEFAULT_MODEL:
        kwargs["model_type"] = args.model
    return kwargs


def _split(kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rest = dict(kwargs)
    return rest.pop("model_type", DEFAULT_MODEL), rest


def hf_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    from sidecar.cli.demo.synthetic import make_hf_config

    model, rest = _split(kwargs)
    return make_hf_config(model, **rest)


def demo_spec(fmt: str, kwargs: dict[str, Any], params: FormatParams = DEFAULT_FORMAT_PARAMS):
    """The RefitSpec the daemon runs for this model (the checkpoint's own scheme resolved), with the
    format parameters the reference engine holds (its manifest makes the daemon re-plan to them)."""
    from sidecar.plan.build import RefitSpec, plan_from_hf_config

    config = hf_config(kwargs)
    spec = RefitSpec(model_type=_split(kwargs)[0], fmt=fmt, params=params)
    return plan_from_hf_config(config, spec).spec


def demo_params(args: argparse.Namespace) -> FormatParams:
    """The format parameters the demo's engine holds (``--int4-group``, ``--int4-scale-dtype``,
    ``--nvfp4-names``; the defaults for those not given)."""
    given = {k: getattr(args, k, None) for k in ("int4_group", "int4_scale_dtype", "nvfp4_names")}
    params = FormatParams(**{k: v for k, v in given.items() if v is not None})
    params.check_for(Format.parse(args.format))
    return params


def weights(step: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Step ``step``'s weights: the initial ones plus ``step`` small deterministic updates."""
    from sidecar.cli.demo.synthetic import make_state_dict

    model, rest = _split(kwargs)
    state = make_state_dict(model, seed=BASE_SEED, **rest)
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(BASE_SEED + s)
        for t in state.values():
            update = torch.randn(t.shape, generator=g) * (
                LEARNING_RATE * float(t.float().std().clamp_min(1e-3))
            )
            t.copy_(t.float() + update)
    return state


# --------------------------------------------------------------------------------------------------
# processes


def trainer(endpoint: str, rank: int, steps: int, kwargs: dict[str, Any], failures) -> None:
    """One trainer rank: push this rank's shards of every step, wait until the engine loaded it."""
    from sidecar.cli.demo.synthetic import shard_for_rank
    from sidecar.client.client import RefitClient, RefitError

    torch.set_num_threads(1)
    try:
        with RefitClient(endpoint, rank, WORLD_SIZE, local=(rank == 0), timeout=120) as client:
            for step in range(steps):
                client.push_step(step, shard_for_rank(weights(step, kwargs), rank, WORLD_SIZE), wait="loaded")
    except RefitError as exc:
        failures.put(f"rank {rank}: {exc}")


def engine(
    endpoint: str,
    fmt: str,
    steps: int,
    kwargs: dict[str, Any],
    results,
    attached,
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
) -> None:
    """The reference engine: attach, then load, check and measure every step."""
    from adapters.engine import EngineWorker
    from adapters.reference import ReferenceEngine, next_token_kl, sample_inputs
    from sidecar.plan.run import convert

    torch.set_num_threads(1)
    config = hf_config(kwargs)
    spec = demo_spec(fmt, kwargs, params)
    live = ReferenceEngine.from_config(config, expert_format=fmt, format_params=params)
    worker = EngineWorker(
        endpoint,
        name="reference-engine-0",
        manifest=live.manifest(),
        load=lambda g: live.load(g.tensors),
        load_group=lambda g, names: live.load_part({n: g.tensors[n] for n in names}),  # streamed refit
    )
    try:
        worker.attach(timeout=60)
        attached.set()
        ids = sample_inputs(live.vocab_size, batch=4, seq=32)
        for step in range(steps):
            # a load found torn (its hold revoked, HoldRevoked) is refused and the next generation loaded
            loaded = worker.load_intact(min_step=step, timeout=120)
            state = weights(loaded.step, kwargs)
            oracle = ReferenceEngine.from_config(config, expert_format=fmt, format_params=params)
            oracle.load(convert(state, spec))
            exact = all(torch.equal(_bytes(p), _bytes(oracle.params[n])) for n, p in live.params.items())
            bf16 = ReferenceEngine.from_config(config, expert_format="bf16")
            bf16.load_bf16(state)
            kl = next_token_kl(bf16.forward(ids), live.forward(ids))
            results.put(
                {
                    "step": loaded.step,
                    "load_s": loaded.seconds,
                    "engine_exact": exact,
                    "kl": kl,
                    "ok": loaded.ok,
                    "error": loaded.error,
                }
            )
    except Exception as exc:  # reported to the demo, which fails
        results.put({"step": None, "error": f"{type(exc).__name__}: {exc}", "ok": False})
    finally:
        worker.detach()


def _engine_holds(fmt: str, kwargs: dict[str, Any], params: FormatParams) -> None:
    """Refuse, before any process starts, a model and format the reference engine cannot hold (the
    DeepSeek MLA engine holds FP8 or BF16 experts only): ValueError naming it."""
    from adapters.reference import ReferenceEngine

    ReferenceEngine.from_config(hf_config(kwargs), expert_format=fmt, format_params=params)


def wait_attached(attached, proc, what: str, timeout: float = 120.0) -> None:
    """Wait for ``proc`` to set ``attached``; an engine that exits first (its traceback is on stderr)
    fails at once instead of after the whole timeout."""
    deadline = time.monotonic() + timeout
    while not attached.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
        if not proc.is_alive():
            raise RuntimeError(
                f"{what} exited with code {proc.exitcode} before attaching (its error is above)"
            )
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{what} did not attach within {timeout:.0f} s")


def start_daemon(
    run_dir: Path,
    config: Path,
    fmt: str,
    regions: int = 0,
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
    extra: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """``refitd serve`` for the demo's trainers (``extra``: more of its options)."""
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli.main",
        "serve",
        "--runtime-dir",
        str(run_dir),
        "--hf-config",
        str(config),
    ]
    cmd += ["--world-size", str(WORLD_SIZE), "--format", fmt, "--log-level", "warning"]
    cmd += ["--staging-regions", str(regions)]
    if params != DEFAULT_FORMAT_PARAMS:  # sized for what the engine holds (its manifest decides at attach)
        cmd += ["--int4-group", str(params.int4_group), "--int4-scale-dtype", params.int4_scale_dtype]
        cmd += ["--nvfp4-names", params.nvfp4_names.value]
    return subprocess.Popen([*cmd, *extra]), f"ipc://{run_dir / 'control.sock'}"


def wait_ready(endpoint: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    from adapters.base import RefitReader
    from sidecar.errors import RefitError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {proc.returncode} before it was ready")
        with RefitReader(endpoint, name="demo-probe") as reader:
            try:
                reader.status(timeout=1.0)
                return
            except RefitError:
                continue
    raise RuntimeError(f"the daemon did not answer within {timeout:.0f} s")


# --------------------------------------------------------------------------------------------------
# the run


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def verify(tensors, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose published bytes differ from ``expected`` (or are missing)."""
    bad = [n for n in expected if n not in tensors]
    for name, want in expected.items():
        got = tensors.get(name)
        if got is not None and not torch.equal(_bytes(got), _bytes(want)):
            bad.append(name)
    return bad


class Verifier:
    """Reads every generation as an engine worker would, so trainers' wait='loaded' waits for it too."""

    def __init__(self, endpoint: str, spec, kwargs: dict[str, Any]):
        from adapters.engine import EngineWorker
        from sidecar.plan.build import plan_from_hf_config
        from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor

        plan = plan_from_hf_config(hf_config(kwargs), spec)
        manifest = Manifest(
            engine=EngineKind.REFERENCE,
            engine_version="demo-verifier",
            moe_backend="none",
            expert_format=spec.fmt,
            format_params=spec.params,
            tensors=tuple(ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs),
        )
        self.spec, self.kwargs, self.checked = spec, kwargs, {}
        self.worker = EngineWorker(
            endpoint, name="demo-verifier", manifest=manifest, load=self._check, timeout=120
        )

    def _check(self, gen) -> None:
        from sidecar.plan.run import convert

        bad = verify(gen.tensors, convert(weights(gen.step, self.kwargs), self.spec))
        self.checked[gen.step] = bad
        if bad:
            raise ValueError(
                f"published bytes differ from the conversion for {len(bad)} tensors, e.g. {bad[:3]}"
            )


def run_colocated(args: argparse.Namespace) -> int:
    """``refitd demo`` (the default layout): two trainer ranks, one daemon, the reference engine."""
    from adapters.base import RefitReader
    from sidecar.plan.run import convert

    kwargs = model_kwargs(args)
    try:
        params = demo_params(args)
        spec = demo_spec(args.format, kwargs, params)
        _engine_holds(args.format, kwargs, params)
    except ValueError as exc:
        print(f"refitd demo: {exc}", file=sys.stderr)
        return 2
    rows, problems = [], []
    ctx = mp.get_context("spawn")
    progress = Progress("demo", 0, units=args.steps, unit_name="step", quiet=getattr(args, "quiet", False))
    with progress, tempfile.TemporaryDirectory(prefix="refitd-demo-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(hf_config(kwargs)))
        progress.phase("starting the daemon")
        daemon, endpoint = start_daemon(Path(tmp) / "run", config, args.format, args.staging_regions, params)
        failures, results, attached = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs: list = []
        try:
            wait_ready(endpoint, daemon)
            progress.phase(
                "starting the reference engine (a process of its own: importing torch takes a while)"
            )
            procs.append(
                ctx.Process(
                    target=engine, args=(endpoint, args.format, args.steps, kwargs, results, attached, params)
                )
            )
            procs[0].start()
            wait_attached(attached, procs[0], "the reference engine")
            verifier = Verifier(endpoint, spec, kwargs)
            verifier.worker.attach(timeout=60)
            procs += [
                ctx.Process(target=trainer, args=(endpoint, r, args.steps, kwargs, failures))
                for r in range(WORLD_SIZE)
            ]
            progress.phase(f"starting {WORLD_SIZE} trainer ranks; {args.steps} steps follow")
            for p in procs[1:]:
                p.start()
            if not args.json:
                _header(args, spec)
            with RefitReader(endpoint, name="demo-status", timeout=120) as status:
                previous = None
                for step in range(args.steps):
                    checked = verifier.worker.load_intact(min_step=step, timeout=120)
                    bad = verifier.checked.get(checked.step, ["(not checked)"])
                    expected = convert(weights(checked.step, kwargs), spec)
                    record = next(h for h in status.status()["history"] if h["step"] == checked.step)
                    loaded = results.get(timeout=120)
                    rows.append(
                        {
                            **record,
                            "published_exact": not bad,
                            "mismatches": bad[:5],
                            "changed": _changed_fraction(previous, expected),
                            **{k: loaded.get(k) for k in ("load_s", "engine_exact", "kl", "error")},
                        }
                    )
                    if not args.json:
                        _row(rows[-1])
                    verified = not bad and loaded.get("engine_exact") and loaded.get("ok")
                    progress.unit_done(f"step {checked.step}, {'verified' if verified else 'NOT verified'}")
                    if bad or not loaded.get("engine_exact") or not loaded.get("ok"):
                        problems.append(f"step {step}: published mismatches {bad[:3]}, engine {loaded}")
                    previous = {k: v.clone() for k, v in expected.items()}
            verifier.worker.detach()
            for p in procs:
                p.join(timeout=60)
            while not failures.empty():
                problems.append(failures.get())
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            daemon.send_signal(signal.SIGTERM)
            if daemon.wait(timeout=30) != 0:
                problems.append(f"the daemon exited with status {daemon.returncode}")
    ok = not problems and len(rows) == args.steps
    _report(args, spec, rows, ok, problems)
    return 0 if ok else 1


def _changed_fraction(previous: dict[str, torch.Tensor] | None, current: dict[str, torch.Tensor]) -> float:
    """Fraction of published bytes that differ from the previous step's."""
    if previous is None:
        return 1.0
    total = changed = 0
    for name, t in current.items():
        a, b = _bytes(t), _bytes(previous[name])
        total += a.numel()
        changed += int((a != b).sum())
    return changed / max(1, total)


def _header(args: argparse.Namespace, spec) -> None:
    """The table's title and columns, printed before the first step so rows show progress as they land."""
    print(
        f"refitd demo: synthetic {getattr(args, 'model', DEFAULT_MODEL)} ({args.layers} layers + MTP, {args.experts} experts), format "
        f"{spec.fmt.value}{_described(spec)}; {WORLD_SIZE} trainer ranks (rank 0 via shared memory, rank 1 via ZeroMQ frames), "
        "1 reference engine"
    )
    print(
        f"{'step':>4} {'bytes in':>10} {'published':>10} {'receive':>8} {'quantize':>8} {'publish':>8} "
        f"{'load':>8} {'total':>8} {'changed':>8} {'KL vs bf16':>11}  verified",
        flush=True,
    )


def _described(spec) -> str:
    described = spec.params.describe(spec.format)
    return f" ({described})" if spec.params != DEFAULT_FORMAT_PARAMS else ""


def _row(r: dict[str, Any]) -> None:
    s = r["seconds"]
    verified = "yes" if r["published_exact"] and r["engine_exact"] else f"NO {r['mismatches']}"
    print(
        f"{r['step']:>4} {human_bytes(r['bytes_in']):>10} {human_bytes(r['bytes_out']):>10} "
        f"{s['receive'] * 1e3:>6.1f}ms {s['quantize'] * 1e3:>6.1f}ms {s['publish'] * 1e3:>6.2f}ms "
        f"{(r['load_s'] or 0) * 1e3:>6.1f}ms {s['total'] * 1e3:>6.1f}ms {r['changed'] * 100:>7.1f}% "
        f"{r['kl']:>11.2e}  {verified}",
        flush=True,
    )


def _report(
    args: argparse.Namespace, spec, rows: list[dict[str, Any]], ok: bool, problems: list[str]
) -> None:
    if args.json:
        summary = {
            "steps": len(rows),
            "format": spec.fmt.value,
            "format_params": spec.params.describe(spec.format),
            "bytes_in": rows[0]["bytes_in"] if rows else 0,
            "bytes_published": rows[0]["bytes_out"] if rows else 0,
            "per_step": [
                {
                    "step": r["step"],
                    "seconds": {**r["seconds"], "engine_load": r["load_s"]},
                    "kl": r["kl"],
                    "changed": r["changed"],
                    "published_exact": r["published_exact"],
                    "engine_exact": r["engine_exact"],
                }
                for r in rows
            ],
            "verified": ok,
            "problems": problems,
        }
        print(json.dumps(summary, indent=2))
        return
    print(
        "verified: every generation byte for byte, the engine holding exactly the published bytes"
        if ok
        else "VERIFICATION FAILED:\n  " + "\n  ".join(problems)
    )
