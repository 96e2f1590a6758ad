"""The CPU path's four figures (issue 17) in one run: ``bench/quant.py`` then ``bench/ingest.py``.

Runs both benches as they are (each measures its own baselines in the same run), writes their JSON
and text next to each other, and prints one table: each figure, its baseline, the ratio and the
goal. Nothing here times anything itself.

    python bench/goals.py [--out bench/results] [--tag cpu] [--repeat 3]

| figure | baseline (same run) | goal |
|---|---|---|
| local ingest (shm), to committed | ``dst.copy_(src)`` of the step, private memory | >= 0.8x memcpy |
| per-tensor cost of a step, local, to published | the same bytes as one tensor | <= 5 us/tensor |
| remote ipc rank through a staging ring of 2 regions | the same step staged whole | <= 1.2x |
| block-FP8 quantize, 2 threads (the daemon's CPU path) | a plain copy of the slabs | >= 40% of copy |
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run(cmd: list[str], log: Path) -> None:
    """Run one bench, its output shown as it comes and kept in ``log``."""
    print(f"$ {' '.join(cmd)}", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        if proc.wait():
            raise SystemExit(f"{cmd[1]} failed with exit code {proc.returncode} (its output: {log})")


def med(values: list[float]) -> float:
    return statistics.median(values)


def figures(quant: dict, ingest: dict) -> list[tuple[str, str, str, str, str, bool | None]]:
    """(figure, baseline, refitd, ratio, goal, met) rows from the two benches' JSON."""
    rows = []
    block = next(r for r in quant["rows"] if r["format"] == "block_fp8")
    of_copy = block.get("native_vs_copy", block["vs_copy"])
    ours = block.get("native_gbps", block["ours_gbps"])
    rows.append(
        (
            f"block-FP8 quantize, {quant['meta']['threads']} threads",
            f"copy {block['copy_gbps']:.2f} GB/s",
            f"{ours:.2f} GB/s",
            f"{of_copy * 100:.0f}% of copy",
            ">= 40% of copy",
            of_copy >= 0.40,
        )
    )
    memcpy = med(ingest["baselines"]["memcpy"]["seconds"])
    local = ingest["refitd"].get("local", {})
    if "committed_s" in local:
        c = med(local["committed_s"])
        rows.append(
            (
                "local ingest (shm), to committed",
                f"memcpy {memcpy * 1e3:.1f} ms",
                f"{c * 1e3:.1f} ms",
                f"{memcpy / c:.2f}x memcpy",
                ">= 0.8x memcpy",
                memcpy / c >= 0.8,
            )
        )
    overhead = ingest.get("overhead", {})
    biggest = max(overhead, key=int) if overhead else None
    if biggest is not None:
        ov = overhead[biggest]
        one, many = ov["one"]["local"], ov["many"]["local"]
        if "published_s" in one and "published_s" in many:
            o, m = med(one["published_s"]), med(many["published_s"])
            us = (m - o) / ov["n"] * 1e6
            rows.append(
                (
                    f"per-tensor cost, local, to published ({ov['n']} tensors)",
                    f"one tensor {o * 1e3:.1f} ms",
                    f"{m * 1e3:.1f} ms",
                    f"{us:.1f} us/tensor",
                    "<= 5 us/tensor",
                    us <= 5.0,
                )
            )
    ring = ingest.get("ring", {}).get("rows", {})
    whole, r2 = ring.get("bf16/r0", {}).get("remote_ipc", {}), ring.get("bf16/r2", {}).get("remote_ipc", {})
    if "published_s" in whole and "published_s" in r2:
        w, r = med(whole["published_s"]), med(r2["published_s"])
        rows.append(
            (
                "remote ipc rank, staging ring of 2 regions",
                f"whole step {w * 1e3:.1f} ms",
                f"{r * 1e3:.1f} ms",
                f"{r / w:.2f}x whole step",
                "<= 1.2x",
                r / w <= 1.2,
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON and logs go")
    ap.add_argument("--tag", default="cpu", help="file name tag: goals-TAG.txt, quant-TAG.json, ...")
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per ingest row")
    ap.add_argument("--threads", type=int, default=2, help="quantizer threads")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    qjson, ijson = args.out / f"quant-{args.tag}.json", args.out / f"ingest-{args.tag}.json"
    py = sys.executable
    run(
        [py, "bench/quant.py", "--threads", str(args.threads), "--json", str(qjson)],
        args.out / f"quant-{args.tag}.txt",
    )
    run(
        [py, "bench/ingest.py", "--skip-tcp", "--repeat", str(args.repeat), "--json", str(ijson)],
        args.out / f"ingest-{args.tag}.txt",
    )
    rows = figures(json.loads(qjson.read_text()), json.loads(ijson.read_text()))
    head = ("figure", "baseline (same run)", "refitd", "ratio", "goal", "met")
    table = [head] + [(a, b, c, d, e, "yes" if ok else "NO") for a, b, c, d, e, ok in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["", "issue 17: the CPU path's four figures, one run"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    load1 = os.getloadavg()
    lines.append(
        f"(wall {time.perf_counter() - t0:.0f} s; load average at start {load0[0]:.1f}, at end {load1[0]:.1f}; "
        f"{os.cpu_count()} CPUs)"
    )
    text = "\n".join(lines)
    print(text)
    (args.out / f"goals-{args.tag}.txt").write_text(text.lstrip("\n") + "\n")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
