"""refitd under Ray: one daemon per node of a real multi-node Ray cluster on this machine.

``ray.cluster_utils.Cluster`` starts a head and two more raylets on this host, each a Ray node with
its own node id (the third offers the ``refitd_inference`` resource, for the disaggregated layout).
``sidecar.ray.RayDaemons`` places a supervisor actor per node, which runs a real ``refitd serve``.
Trainer and engine actors, pinned to each node, find their node's daemon with ``refitd_endpoint()``,
push steps of a tiny synthetic Qwen3.5-MoE and load them byte for byte. A daemon is SIGKILLed while
a trainer pushes and comes back at the same endpoint; a node that joins later gets a daemon from the
background reconciliation, and one that leaves takes its daemon along; a job that ends leaves no
daemon process and no /dev/shm segment behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from sidecar import ray as refitd_ray  # noqa: E402
from sidecar.cli.demo.synthetic import make_hf_config  # noqa: E402
from sidecar.config.settings import ConfigError, NodeLayout, NodeRole  # noqa: E402
from sidecar.config.sources import load_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
FMT = "block_fp8"
NODE = dict(num_cpus=1, object_store_memory=80 << 20)  # Ray's smallest object store; actors take 0 CPU
DEADLINE_S = 60.0


def weights(step: int) -> dict[str, torch.Tensor]:
    from sidecar.cli.demo.synthetic import make_state_dict

    return make_state_dict("qwen3_5_moe", seed=500 + step, **MODEL)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def until(what: str, predicate, timeout: float = DEADLINE_S):
    """``predicate()``'s first truthy value, asked until ``timeout`` (Ray's default); fails naming ``what``."""
    return wait_until(what, predicate, timeout=timeout, interval=0.1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def segments_of(instance: str) -> list[str]:
    prefix = f"refitd-{os.getuid()}-{instance[:8]}-"
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix))


# --------------------------------------------------------------------------------------------------
# actors pinned to a node (pickled by value: Ray's workers cannot import this test module)


class Trainer:
    """One trainer rank (world size 1) pushing whole steps to its node's daemon."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.pushed: list[int] = []
        self.error: str | None = None
        self.done = threading.Event()
        self.stop = threading.Event()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def daemon_node(self) -> str:
        return refitd_ray.refitd_info(self.group)["node_id"]

    def push(self, steps: list[int]) -> list[int]:
        from sidecar.client.client import RefitClient

        endpoint = refitd_ray.refitd_endpoint(self.group)
        with RefitClient(endpoint, rank=0, world_size=1, timeout=60) as client:
            for step in steps:
                client.push_step(step, weights(step))
        return steps

    def start_load(self, first: int, count: int) -> None:
        """Push steps ``first, first+1, ...`` in the background until one fails or ``count`` are done."""
        from sidecar.client.client import RefitClient

        endpoint = refitd_ray.refitd_endpoint(self.group)

        def loop() -> None:
            try:
                with RefitClient(endpoint, rank=0, world_size=1, timeout=5) as client:
                    for step in range(first, first + count):
                        if self.stop.is_set():
                            break
                        client.push_step(step, weights(step))
                        self.pushed.append(step)
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self.done.set()

        threading.Thread(target=loop, daemon=True).start()

    def stop_load(self) -> None:
        self.stop.set()

    def progress(self) -> dict:
        return {"pushed": list(self.pushed), "error": self.error, "done": self.done.is_set()}


class Engine:
    """An engine worker on one node: loads a generation from its node's daemon and checks every byte
    against the conversion of that step's weights."""

    def __init__(self, group: str) -> None:
        self.group = group

    def load(self, min_step: int) -> dict:
        from adapters.base import RefitReader
        from sidecar.plan.build import RefitSpec
        from sidecar.plan.run import convert

        info = refitd_ray.refitd_info(self.group)
        with RefitReader(info["endpoint"], name="ray-engine", timeout=60) as reader:
            gen = reader.wait(min_step=min_step, timeout=60)
            want = convert(weights(gen.step), RefitSpec(model_type="qwen3_5_moe", fmt=FMT))
            bad = [
                n
                for n, t in want.items()
                if n not in gen.tensors or not torch.equal(_bytes(gen.tensors[n]), _bytes(t))
            ]
            step, count = gen.step, len(gen.tensors)
            reader.release(gen)
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "daemon_node": info["node_id"],
            "step": step,
            "tensors": count,
            "expected": len(want),
            "mismatches": bad,
        }


def pinned(cls, node_id: str, **options):
    return (
        ray.remote(cls)
        .options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options
        )
        .remote
    )


_WORKERS: dict[tuple[str, str, str], Any] = {}


def worker(cls, node_id: str, group: str):
    """The ``cls`` actor of ``group`` on ``node_id``, started once per cluster (a worker process
    importing torch costs seconds on two cores)."""
    key = (cls.__name__, node_id, group)
    if key not in _WORKERS:
        _WORKERS[key] = pinned(cls, node_id, max_concurrency=4)(group)
    return _WORKERS[key]


# --------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three Ray nodes on this host; the third offers ``refitd_inference``."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **NODE))
    c.add_node(**NODE)
    c.add_node(resources={refitd_ray.INFERENCE_RESOURCE: 1}, **NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        _WORKERS.clear()
        ray.shutdown()
        c.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray")
    (root / "config.json").write_text(json.dumps(make_hf_config("qwen3_5_moe", **MODEL)))
    return root


def config_for(base: Path, *flags: str):
    return refitd_ray.ray_config(
        [
            "--hf-config",
            str(base / "config.json"),
            "--format",
            FMT,
            "--runtime-dir",
            str(base / "run"),
            "--reader-timeout",
            "5",
            "--log-level",
            "warning",
            *flags,
        ],
        env={},
    )


@pytest.fixture(scope="module")
def colocated(cluster, base):
    daemons = refitd_ray.RayDaemons(config_for(base), group="colo").start()
    try:
        yield daemons
    finally:
        daemons.close()


# --------------------------------------------------------------------------------------------------
# no cluster needed


def test_node_config_file_reads_back_as_the_same_settings(tmp_path):
    """The driver's settings (file, then REFITD_* variables, then flags) reach every node as one
    TOML file that ``refitd serve --config`` reads back into an equal config, with the node's own
    runtime dir and socket; the daemon's environment carries no REFITD_* variable to override it."""
    (tmp_path / "config.json").write_text(json.dumps(make_hf_config("qwen3_5_moe", **MODEL)))
    (tmp_path / "refitd.toml").write_text('world_size = 4\nformat = "mxfp8"\nhf_config = "config.json"\n')
    env = {
        "REFITD_CONFIG": str(tmp_path / "refitd.toml"),
        "REFITD_FORMAT": "bf16",
        "REFITD_STEP_TIMEOUT_S": "7",
    }
    from transport.curve import write_keypair

    key, pub = write_keypair(tmp_path, "node")  # an inference node takes forwarding only over CURVE
    curve = ["--curve-secret-key", str(key), "--curve-allowed-keys", str(pub), "--curve-server-key", str(pub)]
    config = refitd_ray.ray_config(
        ["--runtime-dir", str(tmp_path / "run"), "--ignore", "*.layers.0.mlp", *curve], env=env
    )
    assert (config.world_size, config.format.value, config.step_timeout_s) == (4, "bf16", 7.0)
    node = refitd_ray.node_config(config, group="g", node_id="ab" * 28, layout=NodeLayout.COLOCATED)
    assert node.runtime_dir == tmp_path / "run" / f"ray-g-{'ab' * 6}"
    assert node.listen == f"ipc://{node.runtime_dir}/control.sock"
    path = tmp_path / "node.toml"
    path.write_text(refitd_ray.to_toml(node))
    assert load_config(["--config", str(path)], env={}) == node
    inference = refitd_ray.node_config(
        config,
        group="g",
        node_id="cd" * 28,
        layout=NodeLayout.DISAGGREGATED,
        role=NodeRole.INFERENCE,
        listen="tcp://127.0.0.1:5555",
    )
    path.write_text(refitd_ray.to_toml(inference))
    assert load_config(["--config", str(path)], env={}) == inference
    child = refitd_ray.daemon_env(
        {**env, "PATH": "/bin", "NOTIFY_SOCKET": "/run/x", "REFITD_ENDPOINT": "ipc://x"}
    )
    assert child == {"PATH": "/bin"}
    moved = refitd_ray.absolute_paths(config.replace(timeline_dir=Path("timelines")))
    assert moved.timeline_dir == Path.cwd() / "timelines" and moved.hf_config == config.hf_config


def test_trainer_node_config_refuses_to_forward_off_machine_without_keys(tmp_path):
    """A trainer node's daemon is validated like any other: peers on another machine need CURVE."""
    config = refitd_ray.ray_config(["--runtime-dir", str(tmp_path / "run")], env={})
    with pytest.raises(ConfigError, match="need"):
        refitd_ray.node_config(
            config,
            group="g",
            node_id="ef" * 28,
            layout=NodeLayout.DISAGGREGATED,
            role=NodeRole.TRAINER,
            peers=["tcp://10.1.2.3:5555"],
        )


CHILD = """
import pathlib, signal, sys, threading
out = pathlib.Path(sys.argv[1])
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: (out.with_suffix(".term").write_text("1"), done.set()))
out.with_suffix(".up").write_text("1")
done.wait(60)
"""


def test_keeper_turns_its_own_sigkill_into_a_sigterm_for_the_daemon(tmp_path):
    """Ray SIGKILLs a dead worker's children. The keeper between the supervisor and the daemon
    takes that SIGKILL; the daemon, in a session of its own, gets SIGTERM (PR_SET_PDEATHSIG) and
    can unlink its segments. A SIGTERM to the keeper reaches the daemon too, and the keeper exits
    with the daemon's status."""
    out = tmp_path / "child"
    cmd = [
        sys.executable,
        "-m",
        "sidecar.ray_keeper",
        str(os.getpid()),
        "--",
        sys.executable,
        "-c",
        CHILD,
        str(out),
    ]
    keeper = subprocess.Popen(cmd)
    until("the child started", lambda: out.with_suffix(".up").exists(), timeout=30)
    keeper.kill()
    keeper.wait(timeout=30)
    until("the child told to stop", lambda: out.with_suffix(".term").exists(), timeout=30)
    for p in (out.with_suffix(".up"), out.with_suffix(".term")):
        p.unlink()
    keeper = subprocess.Popen(cmd)
    until("the child started again", lambda: out.with_suffix(".up").exists(), timeout=30)
    keeper.terminate()
    assert keeper.wait(timeout=30) == 0  # the child exited 0 after its SIGTERM handler
    assert out.with_suffix(".term").exists()
    assert (
        subprocess.run([sys.executable, "-m", "sidecar.ray_keeper", "x"], capture_output=True).returncode == 2
    )


def test_sweep_removes_only_dead_daemons_segments(tmp_path):
    """A daemon that was SIGKILLed leaves its segments listed in segments.json; the next supervisor
    on the machine unlinks them, and leaves a live daemon's alone."""
    names = [f"refitd-{os.getuid()}-sweeptest-{os.getpid()}-{i}" for i in range(2)]
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    for name, pid, where in ((names[0], int(dead.stdout), "ray-a-1"), (names[1], os.getpid(), "ray-a-2")):
        (tmp_path / where).mkdir()
        (tmp_path / where / "segments.json").write_text(json.dumps({"pid": pid, "segments": [name]}))
        Path("/dev/shm", name).write_bytes(b"x")
    try:
        assert refitd_ray.sweep_runtime_base(tmp_path) == [names[0]]
        assert not Path("/dev/shm", names[0]).exists() and Path("/dev/shm", names[1]).exists()
    finally:
        for name in names:
            Path("/dev/shm", name).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------
# on the cluster


def test_one_daemon_per_node_trainers_push_engines_load_byte_exact(cluster, colocated):
    """One daemon per Ray node, each in its own runtime dir; a trainer actor on every node pushes
    two steps to its own node's daemon and an engine actor on the same node loads the last one,
    byte for byte."""
    infos = colocated.endpoints()
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(infos) == nodes and len(nodes) == 3
    assert len({i["endpoint"] for i in infos.values()}) == 3
    assert all(i["state"] == "ready" and pid_alive(i["pid"]) for i in infos.values())
    trainers = {n: worker(Trainer, n, "colo") for n in nodes}
    engines = {n: worker(Engine, n, "colo") for n in nodes}
    assert ray.get([t.node.remote() for t in trainers.values()]) == list(trainers)
    ray.get([t.push.remote([0, 1]) for t in trainers.values()], timeout=120)
    loaded = ray.get([e.load.remote(1) for e in engines.values()], timeout=120)
    for node, result in zip(engines, loaded):
        assert result["node"] == result["daemon_node"] == node
        assert result["step"] == 1 and result["tensors"] == result["expected"] > 0
        assert result["mismatches"] == []


def test_daemon_killed_under_load_is_restarted_and_serves_again(cluster, colocated):
    """SIGKILL one node's daemon while its trainer pushes: the supervisor restarts it at the same
    endpoint (removing the segments the dead one left), and a fresh client's next step loads byte
    for byte. (The old client's reconnection is another change; here it may fail or carry on.)"""
    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != cluster.head_node.node_id)
    actor = colocated.actors[node]
    before = ray.get(actor.info.remote())
    trainer = worker(Trainer, node, "colo")
    trainer.start_load.remote(10, 1000)
    until("the trainer pushing", lambda: ray.get(trainer.progress.remote())["pushed"])
    os.kill(before["pid"], signal.SIGKILL)
    after = until(
        "the daemon restarted and ready",
        lambda: (i := ray.get(actor.info.remote()))["restarts"] == 1 and i["state"] == "ready" and i,
    )
    assert after["pid"] != before["pid"] and after["endpoint"] == before["endpoint"]
    assert after["exits"] == [128 + signal.SIGKILL]
    assert segments_of(before["instance"]) == []
    trainer.stop_load.remote()  # its client failed, or (with reconnection) carried on: either is fine
    until("the old trainer loop ended", lambda: ray.get(trainer.progress.remote())["done"], timeout=90)
    ray.get(trainer.push.remote([5000]), timeout=120)  # a fresh client
    result = ray.get(worker(Engine, node, "colo").load.remote(5000), timeout=120)
    assert result["step"] == 5000 and result["mismatches"] == []


def test_node_joining_later_gets_a_daemon_and_one_leaving_takes_it_along(cluster, colocated):
    """The background reconciliation places a daemon on a node that joins; when the node leaves,
    its daemon gets SIGTERM as its actor dies (Ray SIGKILLs the worker's children: the keeper
    between them takes that), unlinks its segments, and the next reconciliation forgets it."""
    colocated.watch(interval_s=0.5)
    extra = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    node = extra.node_id
    until("a daemon on the new node", lambda: node in colocated.actors)
    info = colocated.wait_ready([node])[node]
    assert info["node_id"] == node
    assert ray.get(pinned(Trainer, node)("colo").daemon_node.remote()) == node  # not cached: the node goes
    cluster.remove_node(extra)
    until("the node's daemon gone", lambda: not pid_alive(info["pid"]))
    assert segments_of(info["instance"]) == []
    until("the reconciliation forgetting the node", lambda: node not in colocated.actors)


def test_close_stops_every_daemon_and_removes_its_files(cluster, colocated):
    """close(): every daemon exits on SIGTERM, its segments and runtime directory are gone; a
    second close() does nothing. (The last test of the colocated daemons.)"""
    infos = colocated.endpoints()
    colocated.close()
    colocated.close()
    for info in infos.values():
        assert not pid_alive(info["pid"])
        assert segments_of(info["instance"]) == []
        assert not Path(info["runtime_dir"]).exists()
    assert not [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("refitd:colo:")
    ]


def test_disaggregated_trainer_nodes_forward_to_inference_nodes_found_from_ray(cluster, base):
    """The node offering ``refitd_inference`` runs an inference daemon on tcp://<its ip> with CURVE;
    the two others run trainer daemons forwarding to it. A step pushed on a trainer node is loaded
    byte for byte by an engine actor on the inference node, from that node's own endpoint. When a
    second inference node joins, reconciliation gives it a daemon and restarts the trainer daemons
    with both peers: the next step reaches both."""
    from transport.curve import write_keypair

    key, pub = write_keypair(base, "node")
    keys = ["--curve-secret-key", str(key), "--curve-allowed-keys", str(pub), "--curve-server-key", str(pub)]
    keys += ["--forward-timeout", "3"]  # below the tests' reader timeout
    with refitd_ray.RayDaemons(config_for(base, *keys), layout="disaggregated", group="disagg") as daemons:
        infos = daemons.endpoints()
        inference = [n for n, i in infos.items() if i["role"] == "inference"]
        trainers = [n for n, i in infos.items() if i["role"] == "trainer"]
        assert len(inference) == 1 and len(trainers) == 2
        tcp = infos[inference[0]]["tcp"]
        assert tcp.startswith("tcp://") and all(infos[t]["peers"] == [tcp] for t in trainers)
        ray.get(worker(Trainer, trainers[0], "disagg").push.remote([0]), timeout=120)
        result = ray.get(worker(Engine, inference[0], "disagg").load.remote(0), timeout=120)
        assert result["daemon_node"] == inference[0] and result["step"] == 0
        assert result["mismatches"] == []
        pg = ray.util.placement_group([{refitd_ray.INFERENCE_RESOURCE: 1}])
        try:  # an RL framework's inference placement group maps onto the same node
            assert refitd_ray.placement_group_nodes([pg]) == set(inference)
        finally:
            ray.util.remove_placement_group(pg)

        extra = cluster.add_node(resources={refitd_ray.INFERENCE_RESOURCE: 1}, **NODE)
        try:
            cluster.wait_for_nodes()
            assert daemons.reconcile() == [extra.node_id]
            infos = daemons.wait_ready()
            assert infos[extra.node_id]["role"] == "inference"
            both = sorted(infos[n]["tcp"] for n in (*inference, extra.node_id))
            assert all(sorted(infos[t]["peers"]) == both and infos[t]["exits"] == [0] for t in trainers)
            engines = {n: worker(Engine, n, "disagg") for n in (*inference, extra.node_id)}
            ray.get(worker(Trainer, trainers[0], "disagg").push.remote([1]), timeout=120)
            results = ray.get([e.load.remote(1) for e in engines.values()], timeout=120)
            for node, result in zip(engines, results):
                assert result["daemon_node"] == node and result["step"] == 1
                assert result["mismatches"] == []
        finally:
            daemons.close()
            cluster.remove_node(extra)
            until(
                "the extra node gone",
                lambda: extra.node_id not in {n["NodeID"] for n in ray.nodes() if n["Alive"]},
            )


def test_job_end_leaves_no_daemon_process_or_segment_and_detached_ones_stay(cluster, base, tmp_path):
    """A driver starts job-scoped daemons and detached ones, and exits without closing either: Ray
    ends the job-scoped actors with the job, and every one of their daemons exits and unlinks its
    segments; the detached daemons keep serving until ``stop_detached`` ends them, from another job."""
    script = textwrap.dedent(
        f"""
        import json, ray
        from sidecar import ray as refitd_ray
        ray.init(address={cluster.address!r}, log_to_driver=False)
        config = refitd_ray.ray_config(["--hf-config", {str(base / "config.json")!r},
                                        "--runtime-dir", {str(base / "run")!r}], env={{}})
        job = refitd_ray.RayDaemons(config, group="job")
        kept = refitd_ray.RayDaemons(config, group="kept", detached=True)
        job.reconcile(wait=False), kept.reconcile(wait=False)  # place both, then wait for all
        job.wait_ready(), kept.wait_ready()
        print(json.dumps([job.endpoints(), kept.endpoints()]), flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=os.environ
    )
    assert out.returncode == 0, out.stderr[-3000:]
    job, kept = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(job) == len(kept) == len([n for n in ray.nodes() if n["Alive"]])
    for info in job.values():
        until(f"daemon pid {info['pid']} gone with the job", lambda i=info: not pid_alive(i["pid"]))
        assert segments_of(info["instance"]) == []
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith("refitd:job:")]
    assert sorted(n for n in names if n.startswith("refitd:kept:")) == sorted(
        refitd_ray.actor_name("kept", node) for node in kept
    )
    assert all(pid_alive(info["pid"]) and segments_of(info["instance"]) for info in kept.values())
    assert refitd_ray.stop_detached("kept") == sorted(kept)
    for info in kept.values():
        assert not pid_alive(info["pid"]) and segments_of(info["instance"]) == []


def test_daemon_refusing_its_configuration_is_not_restarted_and_start_says_why(cluster, base):
    """A setting only the daemon can judge (a staging arena too small for the plan) makes every
    daemon exit with 78: start() fails naming each node and the daemon's own message, at once,
    without restarting it."""
    daemons = refitd_ray.RayDaemons(config_for(base, "--staging-bytes", "4096"), group="bad")
    try:
        with pytest.raises(refitd_ray.RayDaemonError, match="refused its configuration") as err:
            daemons.start()
        assert "3 of 3" in str(err.value) and "staging" in str(err.value)
        assert all(i["restarts"] == 0 and i["exits"] == [78] for i in daemons.endpoints().values())
    finally:
        daemons.close()


def test_refitd_endpoint_without_a_daemon_says_how_to_start_one(cluster):
    """Asking for a group nobody started fails with a message naming the group and the fix."""
    with pytest.raises(refitd_ray.RayDaemonError, match="RayDaemons"):
        refitd_ray.refitd_endpoint("nobody")
