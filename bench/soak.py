"""Soak: many steps through a real ``refitd serve``, watching the daemon for leaks.

One ``refitd serve`` subprocess (``--format block_fp8`` on a small synthetic Qwen3.5-MoE) takes
``--steps`` steps from ``--ranks`` trainer ranks (rank 0 local: it writes into the staging arena;
rank 1 remote: ZeroMQ frames), each a long-lived ``RefitClient`` in a thread of this process, as a
trainer keeps its clients. After every step a ``RefitReader`` loads the new generation (copies every
tensor out, then releases it), as an engine does.

Every ``--sample-every`` steps it samples, from /proc, the daemon's open file descriptors
(``/proc/PID/fd``) and resident memory (``VmRSS`` of ``/proc/PID/status``), the daemon's segments in
/dev/shm (names with its instance prefix) and their bytes, and this process's own fds (the clients
and the reader). The first sample after ``--warmup`` steps is the baseline; growth is the slope of a
least-squares line through the samples after it, scaled to 1000 steps (and the plain difference,
last minus baseline). The per-step time is reported per window against the first window after
warm-up, so a step that slows as the daemon ages shows as a ratio above 1. Every sample also checks
that the generation the reader loaded is byte-exact against ``convert()`` of the step's weights.

    nice -n 19 python bench/soak.py [--steps 300] [--ranks 2] [--sample-every 25] [--out PATH]

Sized for a 2-core machine: 300 steps take about a minute and a few hundred MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

#: ``python bench/soak.py`` puts bench/ first on sys.path, where bench/transport.py hides the
#: ``transport`` package; the repository root goes ahead of it.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from adapters.base import RefitReader  # noqa: E402
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict  # noqa: E402
from sidecar.client.client import RefitClient, Shard  # noqa: E402
from sidecar.errors import RefitError  # noqa: E402
from sidecar.plan.build import RefitSpec  # noqa: E402
from sidecar.plan.run import convert  # noqa: E402

MiB = 1 << 20
MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
FMT = "block_fp8"
EXPERTS_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
READY_TIMEOUT_S = 90.0
STEP_TIMEOUT_S = 60.0
SEEDS = 4  # distinct weight sets, cycled: every step's bytes differ from the one before


class Daemon:
    """``python -m sidecar.cli serve`` in a fresh runtime dir; ready once it answers STATUS."""

    def __init__(self, ranks: int, config: dict[str, Any]):
        self.tmp = Path(tempfile.mkdtemp(prefix="refitd-soak-"))
        self.runtime = self.tmp / "run"
        path = self.tmp / "config.json"
        path.write_text(json.dumps(config))
        argv = [sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(self.runtime)]
        argv += [
            "--hf-config",
            str(path),
            "--world-size",
            str(ranks),
            "--format",
            FMT,
            "--log-level",
            "warning",
        ]
        self.endpoint = f"ipc://{self.runtime}/control.sock"
        self.log = open(self.tmp / "daemon.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        self.status = self._wait_ready()
        self.prefix = f"refitd-{os.getuid()}-{self.status['instance'][:8]}-"

    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.tail()}")
            if self.runtime.joinpath("control.sock").exists():
                with RefitReader(self.endpoint, name="soak-status") as reader:
                    try:
                        return reader.status(timeout=2.0)
                    except RefitError:
                        pass
            time.sleep(0.05)  # the daemon is still starting: poll again, up to the deadline
        raise RuntimeError(f"the daemon was not ready within {READY_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def sample(self) -> dict[str, Any]:
        pid = self.proc.pid
        if self.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.tail()}")
        rss_kib = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
        segments = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(self.prefix)]
        return {
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_mib": rss_kib / 1024,
            "segments": len(segments),
            "segment_mib": sum(p.stat().st_size for p in segments) / MiB,
            "client_fds": len(os.listdir("/proc/self/fd")),
        }

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        left = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(self.prefix)]
        shutil.rmtree(self.tmp, ignore_errors=True)
        if left:
            raise RuntimeError(f"the daemon left {len(left)} segment(s) in /dev/shm after SIGTERM: {left}")
        return self.proc.returncode


def rank_parts(state: dict[str, torch.Tensor], ranks: int) -> list[dict[str, Any]]:
    """Each rank's share: expert slabs split by expert (expert parallel), other tensors by turns."""
    parts: list[dict[str, Any]] = [{} for _ in range(ranks)]
    for i, (name, tensor) in enumerate(state.items()):
        if name.endswith(EXPERTS_SUFFIXES):
            per = -(-tensor.shape[0] // ranks)
            for r in range(ranks):
                lo, hi = r * per, min(tensor.shape[0], (r + 1) * per)
                if lo < hi:
                    offsets = (lo,) + (0,) * (tensor.dim() - 1)
                    parts[r][name] = Shard(tensor[lo:hi], tuple(tensor.shape), offsets)
        else:
            parts[i % ranks][name] = tensor
    return parts


def slope_per_1000(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, per 1000 steps (0 with fewer than two samples)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def check_exact(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], step: int) -> None:
    if sorted(tensors) != sorted(expected):
        raise RuntimeError(f"step {step}: the generation holds other tensors than convert() makes")
    for name, want in expected.items():
        got = tensors[name]
        if got.dtype != want.dtype or not torch.equal(
            got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
        ):
            raise RuntimeError(f"step {step}: {name} differs from convert() of the step's weights")


def soak(args: argparse.Namespace) -> dict[str, Any]:
    config = make_hf_config("qwen3_5_moe", **MODEL)
    states = [make_state_dict("qwen3_5_moe", seed=s, **MODEL) for s in range(SEEDS)]
    parts = [rank_parts(s, args.ranks) for s in states]
    expected = [convert(s, RefitSpec(model_type="qwen3_5_moe", fmt=FMT)) for s in states]
    nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
    daemon = Daemon(args.ranks, config)
    clients = [
        RefitClient(daemon.endpoint, r, args.ranks, local=(r == 0), timeout=STEP_TIMEOUT_S)
        for r in range(args.ranks)
    ]
    reader = RefitReader(daemon.endpoint, name="soak-engine", timeout=STEP_TIMEOUT_S)
    samples: list[dict[str, Any]] = []
    step_s: list[float] = []
    rc = None
    try:
        with ThreadPoolExecutor(args.ranks, thread_name_prefix="soak-rank") as pool:
            for step in range(args.steps):
                t0 = time.perf_counter()
                futures = [
                    pool.submit(c.push_step, step, parts[step % SEEDS][r]) for r, c in enumerate(clients)
                ]
                for f in futures:
                    f.result(timeout=2 * STEP_TIMEOUT_S)
                gen = reader.wait(min_step=step, timeout=STEP_TIMEOUT_S)
                loaded = {n: t.clone() for n, t in gen.tensors.items()}  # the engine's copy out
                reader.release(gen)
                step_s.append(time.perf_counter() - t0)
                if step % args.sample_every == 0 or step == args.steps - 1:
                    check_exact(loaded, expected[step % SEEDS], step)
                    samples.append({"step": step, **daemon.sample()})
                    if not args.quiet:
                        s = samples[-1]
                        print(
                            f"step {step:6d}: fds {s['fds']:4d}  rss {s['rss_mib']:8.1f} MiB  segments "
                            f"{s['segments']:3d} ({s['segment_mib']:.1f} MiB)  client fds {s['client_fds']:4d}  "
                            f"step {1000 * statistics.median(step_s[-args.sample_every :]):.1f} ms",
                            flush=True,
                        )
    finally:
        reader.close()
        for c in clients:
            c.close()
        rc = daemon.stop()
    return report(args, samples, step_s, nbytes, rc)


def report(
    args: argparse.Namespace, samples: list[dict], step_s: list[float], nbytes: int, rc: int | None
) -> dict[str, Any]:
    after = [s for s in samples if s["step"] >= args.warmup]
    if len(after) < 2:
        raise SystemExit(
            f"too few samples after warm-up ({len(after)}): raise --steps or lower --sample-every"
        )
    base, last = after[0], after[-1]
    xs = [s["step"] for s in after]
    keys = ("fds", "rss_mib", "segments", "segment_mib", "client_fds")
    growth = {
        k: {
            "baseline": base[k],
            "last": last[k],
            "slope_per_1000_steps": round(slope_per_1000(xs, [s[k] for s in after]), 3),
            "delta_per_1000_steps": round(
                1000.0 * (last[k] - base[k]) / max(1, last["step"] - base["step"]), 3
            ),
            "max": max(s[k] for s in after),
        }
        for k in keys
    }
    timed = step_s[args.warmup :]
    w = args.sample_every
    windows = [statistics.median(timed[i : i + w]) for i in range(0, len(timed), w) if timed[i : i + w]]
    first = windows[0]
    return {
        "bench": "soak",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "torch": torch.__version__,
        "settings": {
            "steps": args.steps,
            "ranks": args.ranks,
            "warmup": args.warmup,
            "sample_every": args.sample_every,
            "format": FMT,
            "model": MODEL,
            "bf16_bytes_per_step": nbytes,
        },
        "daemon_exit": rc,
        "growth": growth,
        "step_ms": {
            "baseline_window_median": round(1000 * first, 3),
            "last_window_median": round(1000 * windows[-1], 3),
            "last_over_first": round(windows[-1] / first, 3),
            "worst_window_over_first": round(max(windows) / first, 3),
            "max_step": round(1000 * max(timed), 3),
        },
        "samples": samples,
    }


def render(r: dict[str, Any]) -> str:
    s, g, t = r["settings"], r["growth"], r["step_ms"]
    lines = [
        f"# bench/soak.py --steps {s['steps']} --ranks {s['ranks']} --sample-every {s['sample_every']} "
        f"(warm-up {s['warmup']} steps; {s['format']}, {s['bf16_bytes_per_step'] / MiB:.1f} MiB of BF16 per step)",
        f"# {r['machine']['cpus']} CPUs, {r['machine']['platform']}, python {r['machine']['python']}, "
        f"torch {r['torch']}; daemon exit status after SIGTERM: {r['daemon_exit']}",
        "",
        f"{'daemon':<14}{'baseline':>10}{'last':>10}{'max':>10}{'slope/1000 steps':>18}{'delta/1000 steps':>18}",
    ]
    names = {
        "fds": "fds",
        "rss_mib": "RSS MiB",
        "segments": "shm segments",
        "segment_mib": "shm MiB",
        "client_fds": "client fds",
    }
    for k, label in names.items():
        v = g[k]
        lines.append(
            f"{label:<14}{v['baseline']:>10.1f}{v['last']:>10.1f}{v['max']:>10.1f}"
            f"{v['slope_per_1000_steps']:>18.2f}{v['delta_per_1000_steps']:>18.2f}"
        )
    lines += [
        "",
        f"step time (push by every rank + the reader's copy out), median per {s['sample_every']}-step window: "
        f"first {t['baseline_window_median']:.1f} ms, last {t['last_window_median']:.1f} ms "
        f"(last/first {t['last_over_first']:.2f}x, worst window/first {t['worst_window_over_first']:.2f}x, "
        f"slowest step {t['max_step']:.1f} ms)",
        "",
        "json: " + json.dumps(r, sort_keys=True),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ranks", type=int, choices=(1, 2), default=2)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--warmup", type=int, default=25, help="steps before the baseline sample")
    p.add_argument("--out", type=Path, default=None, help="write the report here (text, with a json line)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.steps <= args.warmup + args.sample_every:
        p.error("--steps must exceed --warmup + --sample-every (two samples after warm-up)")
    torch.set_num_threads(1)  # the trainer threads here should not fight the daemon for the CPUs
    result = soak(args)
    text = render(result)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
