"""How long ``sidecar.ray.RayDaemons`` takes to place one refitd per node and have every one ready,
for N = 1, 2, 3 Ray nodes (``ray.cluster_utils.Cluster``: N raylets on this host).

Baselines, measured in the same run:
  bare actor   one no-op actor per node with the same pinning (``NodeAffinitySchedulingStrategy``,
               ``soft=False``) until each answered a call: what Ray itself costs.
  bare daemon  one ``refitd serve`` started as a plain subprocess with the same settings until it
               answers ``refitd status``: what the daemon costs, with no Ray around it.
refitd       ``RayDaemons(config).start()`` over the N nodes: ``place`` (the actors created) and
             ``ready`` (every daemon answered ``refitd status``), both from the call.

Each N is repeated ``--repeat`` times with a fresh group (fresh actors and daemons) and the median
reported. On a shared 2-core machine the daemons of one N start at once and compete for the cores,
so ``ready`` grows with N here; on real nodes each has its own.

    python bench/ray_placement.py [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.cli.serve import query_status
from sidecar.ray import RayDaemons, ray_config

NODE = dict(num_cpus=1, object_store_memory=80 << 20)


class Ping:
    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()


def bare_actors(node_ids: list[str]) -> float:
    t0 = time.monotonic()
    actors = [
        ray.remote(Ping)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
        .remote()
        for n in node_ids
    ]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    seconds = time.monotonic() - t0
    for a in actors:
        ray.kill(a)
    return seconds


def bare_daemon(root: Path, config_json: Path) -> float:
    run = root / "bare"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(run)]
    proc = subprocess.Popen([*cmd, "--hf-config", str(config_json), "--log-level", "warning"])
    try:
        while True:
            try:
                query_status(f"ipc://{run}/control.sock", timeout=1.0)
                return time.monotonic() - t0
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"refitd serve exited with {proc.returncode}") from None
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="refitd-ray-bench-") as tmp:
        root = Path(tmp)
        config_json = root / "config.json"
        config_json.write_text(json.dumps(make_hf_config("qwen3_5_moe", num_layers=2, num_experts=4)))
        config = ray_config(
            ["--hf-config", str(config_json), "--runtime-dir", str(root / "run"), "--log-level", "warning"],
            env={},
        )
        cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **NODE))
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            for n in (1, 2, 3):
                while len([x for x in ray.nodes() if x["Alive"]]) < n:
                    cluster.add_node(**NODE)
                cluster.wait_for_nodes()
                nodes = [x["NodeID"] for x in ray.nodes() if x["Alive"]]
                samples: dict[str, list[float]] = {"actor": [], "daemon": [], "place": [], "ready": []}
                for r in range(args.repeat):
                    samples["actor"].append(bare_actors(nodes))
                    samples["daemon"].append(bare_daemon(root, config_json))
                    with RayDaemons(config, group=f"bench-{n}-{r}") as daemons:
                        samples["place"].append(daemons.timings["place_s"])
                        samples["ready"].append(daemons.timings["ready_s"])
                med = {k: statistics.median(v) for k, v in samples.items()}
                rows.append({"nodes": n, **{f"{k}_s": round(v, 3) for k, v in med.items()}})
                print(
                    f"N={n}: refitd place {med['place']:.2f} s, ready {med['ready']:.2f} s | bare actor "
                    f"{med['actor']:.2f} s, bare daemon {med['daemon']:.2f} s | ready / (actor + daemon) "
                    f"{med['ready'] / (med['actor'] + med['daemon']):.2f}x",
                    flush=True,
                )
        finally:
            ray.shutdown()
            cluster.shutdown()
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "repeat": args.repeat}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
