"""The quantizer threads' chunks against fixed halves, on the daemon's call path, in the same rounds.

``sidecar.numerics.threads.Pool`` cuts a call into chunks that the threads take one after another, so
a core that runs slower than the other (another process on it, a busy neighbour on a shared host)
takes fewer. This times bench/quant.py's n/unit (``run_unit`` on a Qwen3.5-35B-A3B layer's two slab
units, 32 experts, 192 MiB bf16) three ways each round, one after the other: a copy of the same
bytes, then the pool's chunks and one fixed share a thread (``chunks_per_thread = 1``, the pool before
chunks), which of the two first alternating. Each round's three times share the same moment of the
machine; the table gives medians and the slowest round, each as a fraction of the copy, and chunks'
median time against halves'.

A scale-group pipeline (NVFP4, FP8 per-tensor) hands out its groups itself (threads.Claims: each
thread runs the call whole and takes groups from a shared counter); with ``chunks_per_thread = 1`` it is
cut into one run of groups a thread instead, as before.

``--contend`` makes one core slow on purpose, to show what chunks are for where a shared host shows it
only now and then: the caller is pinned to the first CPU, the pool's worker to the second, and a busy
process pinned to the second takes half of it for the timed rounds (2 threads; Linux).

    python bench/pool.py [--threads 2] [--rounds 15] [--formats F,..] [--contend] [--chunks N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, as bench/quant.py

from sidecar.config.environment import brief_openmp_spin

brief_openmp_spin()  # before torch loads (bench/quant.py says why)

import torch  # noqa: E402
from quant import HIDDEN, INTER, machine, slab_units  # noqa: E402  (bench/quant.py)

from sidecar.numerics import cpu  # noqa: E402
from sidecar.numerics.formats import Format  # noqa: E402
from sidecar.numerics.native_calls import POOL  # noqa: E402
from sidecar.numerics.threads import CHUNKS_PER_THREAD  # noqa: E402

FORMATS = ("block_fp8", "mxfp8", "mxfp4", "int4_w4a16", "nvfp4", "fp8_per_tensor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--contend", action="store_true", help="a busy process on the worker's CPU")
    ap.add_argument("--chunks", type=int, default=CHUNKS_PER_THREAD, help="chunks a thread (at most)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    busy = contend() if args.contend else None
    g = torch.Generator().manual_seed(0)
    slabs = {
        "gate_up": (torch.randn(args.experts, 2 * INTER, HIDDEN, generator=g) * 0.02).bfloat16(),
        "down": (torch.randn(args.experts, HIDDEN, INTER, generator=g) * 0.02).bfloat16(),
    }
    done = cpu.warm_up()
    m = machine()
    mib = sum(t.nbytes for t in slabs.values()) >> 20
    print(
        f"refitd bench/pool: {args.experts} experts, {mib} MiB bf16, {args.threads} threads, {m['cpu']}, "
        f"{m['cores']} cores, CPU path: {done.impl}; chunks: up to {args.chunks} a thread"
        + ("; the worker's CPU shared with a busy process" if busy else "")
    )
    print(
        f"{'format':<16}{'copy ms':>8}{'chunks':>8}{'halves':>8} |{'chunks':>8}{'halves':>8}"
        f" of copy, slowest round | chunks x halves"
    )

    try:
        table(args, slabs)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def table(args: argparse.Namespace, slabs: dict[str, torch.Tensor]) -> None:
    """A row a format: the medians and slowest rounds of the copy, chunks and halves."""
    copies = {k: torch.empty_like(t) for k, t in slabs.items()}

    def copy() -> None:
        for k, t in slabs.items():
            copies[k].copy_(t)

    for fmt in [Format.parse(f).value for f in args.formats.split(",")]:
        units = slab_units(fmt, args.experts, slabs)

        def run(per_thread: int, units=units) -> None:
            POOL.chunks_per_thread = per_thread
            try:
                for call in units:
                    call()
            finally:
                POOL.chunks_per_thread = CHUNKS_PER_THREAD

        copy(), run(args.chunks), run(1)  # warm-up: the units' kept calls
        rounds: list[tuple[float, float, float]] = []
        for i in range(args.rounds):
            # the copy first (its dirty lines are written back during whatever runs next), then the two
            # ways, which goes first alternating round by round
            ways = [lambda: run(args.chunks), lambda: run(1)]
            times = {}
            for j, fn in [(0, copy)] + [(1 + (i + w) % 2, ways[(i + w) % 2]) for w in range(2)]:
                t0 = time.perf_counter()
                fn()
                times[j] = time.perf_counter() - t0
            rounds.append((times[0], times[1], times[2]))
        t_copy, t_chunks, t_halves = (statistics.median(r[i] for r in rounds) for i in range(3))
        # each round's ratio to its own copy: the slowest round is the one that fell furthest behind it
        worst_chunks = min(r[0] / r[1] for r in rounds)
        worst_halves = min(r[0] / r[2] for r in rounds)
        print(
            f"{fmt:<16}{t_copy * 1e3:>8.1f}{t_copy / t_chunks:>8.0%}{t_copy / t_halves:>8.0%} |"
            f"{worst_chunks:>8.0%}{worst_halves:>8.0%}                        |"
            f"{t_halves / t_chunks:>8.2f}x"
        )


def contend() -> subprocess.Popen:
    """Pin this thread to the first allowed CPU and the pool's worker to the second, then start a busy
    process on the second; returns it (the caller kills it)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or torch.get_num_threads() != 2:
        sys.exit("--contend needs 2 CPUs and --threads 2")
    os.sched_setaffinity(0, {cpus[0]})  # Linux: 0 is the calling thread
    (worker,) = POOL._get(1)
    worker.start(lambda: os.sched_setaffinity(0, {cpus[1]}) or 0)
    worker.wait()
    # busy until killed, or until this process is gone (it then has another parent)
    spin = (
        f"import os; os.sched_setaffinity(0, {{{cpus[1]}}}); p = os.getppid()\nwhile os.getppid() == p: pass"
    )
    return subprocess.Popen([sys.executable, "-c", spin])


if __name__ == "__main__":
    main()
