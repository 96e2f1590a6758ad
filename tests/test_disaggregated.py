"""Disaggregated layout: one trainer node's daemon forwards each generation to two inference nodes.

Three ``refitd serve`` processes stand for three nodes. Each inference daemon listens on its own
loopback address (127.0.0.2, 127.0.0.3: Linux routes all of 127/8 to lo) with CURVE and an
allow-list holding the trainer daemon's key; its engines (reference engines, in threads of this
process) attach through its local ipc:// endpoint. The trainer pushes to its own daemon over ipc://.
The bytes move as a NIXL WRITE where NIXL works here (``forward_mover = "auto"``), as ZeroMQ frames
otherwise; the byte-exact test runs both movers.

Where the test may create network namespaces (root, `ip`), one test also runs the trainer node and
an inference node each in its own namespace, joined by a veth pair with 10.x addresses inside them;
the others stay on loopback addresses, which exercise the same TCP and NIXL paths more cheaply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.net import free_port
from support.waiting import wait_until

from adapters.base import RefitReader
from adapters.engine import EngineWorker
from adapters.reference import ReferenceEngine, sample_inputs
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.config.settings import EXIT_CONFIG
from sidecar.errors import ErrorKind, RefitError
from sidecar.forward.movers import descriptors
from sidecar.forward.types import Job
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert
from transport.curve import client_curve, write_keypair
from transport.layout import ALIGN
from transport.nixl import available as nixl_available

pytestmark = pytest.mark.timeout(240)
log = logging.getLogger(__name__)

MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
FORMATS = ["block_fp8", "mxfp8", "fp8_per_tensor", "bf16"]
HOSTS = ["127.0.0.2", "127.0.0.3"]
FORWARD_TIMEOUT_S = 3.0
READER_TIMEOUT_S = 6.0
READY_PROBE_S = 2.0  # how long one STATUS to a starting daemon waits before its process is looked at
NIXL_OK, NIXL_WHY = nixl_available()
AUTO_MOVER = "nixl" if NIXL_OK else "zmq"  # what forward_mover = "auto" picks between two daemons here
MOVERS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not NIXL_OK, reason=f"NIXL unavailable: {NIXL_WHY}")),
    "zmq",
]


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=300 + step, **MODEL)


def expected(step: int, fmt: str) -> dict[str, torch.Tensor]:
    return convert(weights(step), RefitSpec(model_type="qwen3_5_moe", fmt=fmt))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _isolation() -> str:
    """Why each node is a loopback address rather than a network namespace (logged once)."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    probe = subprocess.run(
        ["ip", "netns", "add", f"refitd-probe-{os.getpid()}"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip() or probe.returncode}"
    subprocess.run(["ip", "netns", "delete", f"refitd-probe-{os.getpid()}"], capture_output=True)
    return (
        "namespaces work here: test_an_inference_node_in_its_own_network_namespace_gets_the_bytes uses them"
    )


class Node:
    """One ``refitd serve`` process: a trainer node or an inference node."""

    def __init__(self, name: str, root: Path, args: list[str], netns: str | None = None):
        self.name, self.run_dir, self.args = name, root / name, args
        self.wrap = ["ip", "netns", "exec", netns] if netns else []  # `ip netns exec` execs: same pid
        self.log_path = root / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.local = f"ipc://{self.run_dir / 'control.sock'}"

    def start(self) -> Node:
        cmd = [
            *self.wrap,
            sys.executable,
            "-m",
            "sidecar.cli.main",
            "serve",
            "--runtime-dir",
            str(self.run_dir),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "a"))  # noqa: SIM115
        return self

    def wait_ready(self, timeout: float = 60.0) -> Node:
        """Blocks on the daemon's answer to STATUS: the reader connects before the daemon binds its
        socket (it is still importing torch) and ZeroMQ delivers the queued request once it does.
        Each wait is at most READY_PROBE_S, so a daemon that exited is seen within that."""
        deadline = time.monotonic() + timeout
        with RefitReader(self.local, name="test-probe") as reader:
            while (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(RefitError):
                    reader.status(timeout=min(left, READY_PROBE_S))
                    return self
                if self.proc.poll() is not None:
                    raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.logs()}")
        raise AssertionError(f"{self.name} did not answer within {timeout} s:\n{self.logs()}")

    def status(self) -> dict:
        with RefitReader(self.local, name="test-status") as reader:
            return reader.status(timeout=10)

    def logs(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    def __init__(
        self,
        root: Path,
        fmt: str,
        mover: str = "auto",
        hosts: list[str] = HOSTS,
        netns: dict[str, str] | None = None,  # node name -> the namespace it runs in
        inference_args: tuple[str, ...] = (),  # more flags for the inference nodes (later flags win)
    ):
        self.root, self.fmt = root, fmt
        netns = netns or {}
        keys = root / "keys"
        keys.mkdir()
        self.trainer_key, _ = write_keypair(keys, "trainer")
        self.inference_key, self.inference_pub = write_keypair(keys, "inference")
        self.stranger_key, _ = write_keypair(keys, "stranger")
        cfg = root / "config.json"
        cfg.write_text(json.dumps(CONFIG))
        self.endpoints = [
            f"tcp://{h}:{free_port(h) if f'inference{i}' not in netns else 5555}" for i, h in enumerate(hosts)
        ]
        common = [
            "--format",
            fmt,
            "--forward-timeout",
            str(FORWARD_TIMEOUT_S),
            "--reader-timeout",
            str(READER_TIMEOUT_S),
            "--forward-mover",
            mover,
        ]
        common += ["--heartbeat-interval", "0.2", "--layout", "disaggregated", "--log-level", "info"]
        self.inference = [
            Node(
                f"inference{i}",
                root,
                [
                    *common,
                    *("--role", "inference", "--model-type", "qwen3_5_moe", "--publish-bytes", "4MiB"),
                    *("--listen", ep, "--curve-secret-key", str(self.inference_key)),
                    *("--curve-allowed-keys", str(keys / "trainer.key.pub")),
                    *inference_args,
                ],
                netns.get(f"inference{i}"),
            )
            for i, ep in enumerate(self.endpoints)
        ]
        self.trainer = Node(
            "trainer",
            root,
            [
                *common,
                *("--role", "trainer", "--hf-config", str(cfg), "--peers", ",".join(self.endpoints)),
                *("--curve-secret-key", str(self.trainer_key), "--curve-server-key", str(self.inference_pub)),
            ],
            netns.get("trainer"),
        )

    def start(self) -> Cluster:
        for node in [*self.inference, self.trainer]:
            node.start()
        for node in [*self.inference, self.trainer]:
            node.wait_ready()
        return self

    def stop(self) -> None:
        for node in [self.trainer, *self.inference]:
            node.stop()


@pytest.fixture
def cluster(tmp_path):
    log.info("nodes are loopback addresses %s, not network namespaces: %s", HOSTS, _isolation())
    made = []

    def make(fmt: str, mover: str = "auto") -> Cluster:
        c = Cluster(tmp_path, fmt, mover).start()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


class Engine:
    """A reference engine on one inference node that checks every generation it loads, byte for byte."""

    def __init__(self, endpoint: str, name: str, fmt: str):
        self.fmt = fmt
        self.engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt)
        self.mismatches: dict[int, list[str]] = {}
        self.worker = EngineWorker(
            endpoint, name=name, manifest=self.engine.manifest(), load=self._load, timeout=60
        )

    def _load(self, gen) -> None:
        want = expected(gen.step, self.fmt)
        bad = [
            n
            for n in want
            if n not in gen.tensors or not torch.equal(_bytes(gen.tensors[n]), _bytes(want[n]))
        ]
        bad += [n for n in gen.tensors if n not in want]
        self.mismatches[gen.step] = bad
        self.engine.load(gen.tensors)

    def logits(self) -> torch.Tensor:
        return self.engine.forward(sample_inputs(self.engine.vocab_size))


def reference_logits(step: int, fmt: str) -> torch.Tensor:
    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt)
    engine.load(expected(step, fmt))
    return engine.forward(sample_inputs(engine.vocab_size))


def peers_at(node: Node, step: int):
    def check():
        peers = node.status()["peers"]
        return peers if all(p["last_step"] == step for p in peers.values()) else None

    return check


@pytest.mark.parametrize("mover", MOVERS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_inference_node_publishes_the_trainer_nodes_bytes(cluster, fmt, mover):
    """The trainer pushes two steps to its own daemon, which quantizes once and forwards each sealed
    generation to both inference daemons (CURVE control channel; the bytes as a NIXL WRITE, or as
    ZeroMQ frames). Each inference node's engine loads exactly the bytes the trainer node published;
    the trainer learns which node holds which step, and over which mover it got there."""
    c = cluster(fmt, mover)
    engines = [Engine(node.local, f"engine-{i}", fmt) for i, node in enumerate(c.inference)]
    for e in engines:
        e.worker.attach(timeout=30)
    with ThreadPoolExecutor(2) as pool, RefitClient(c.trainer.local, 0, 1, timeout=60) as client:
        for step in range(2):
            loads = [pool.submit(e.worker.load_next, step, 60) for e in engines]
            result = client.push_step(step, weights(step), wait="published", timeout=60)
            assert set(result.peers) == set(c.endpoints)  # the snapshot as the step went live
            assert [f.result().step for f in loads] == [step, step]
            assert all(f.result().ok for f in loads)
            for e in engines:
                assert e.mismatches[step] == [], e.mismatches[step][:5]
            peers = wait_until(
                f"both peers to acknowledge step {step}", peers_at(c.trainer, step), timeout=30
            )
    want = reference_logits(1, fmt)
    for e in engines:
        assert torch.equal(e.logits(), want)
        e.worker.detach()
    published = sum(t.numel() * t.element_size() for t in expected(1, fmt).values())
    for ep, p in peers.items():
        assert p["mover"] == mover and p["error"] is None and p["curve"], ep
        assert p["mover_reason"] == ("NIXL on both sides" if mover == "nixl" else "forward_mover=zmq"), p
        if (
            mover == "nixl"
        ):  # one WRITE of the used range: the payload plus the alignment gaps between tensors
            assert published <= p["bytes"] < published + ALIGN * len(expected(1, fmt)), (
                p["bytes"],
                published,
            )
        else:
            assert p["bytes"] == published
        assert p["bytes_bf16"] == result.bytes_in
        if fmt != "bf16":
            assert p["bytes"] < p["bytes_bf16"]  # FP8 on the wire, not BF16
        assert p["loaded"] is not None
    for node in c.inference:
        s = node.status()
        assert s["role"] == "inference" and s["last_step"] == 1 and s["history"][-1]["forwarded_from"]
        assert s["history"][-1]["mover"] == mover


@pytest.mark.skipif(not NIXL_OK, reason=f"NIXL unavailable: {NIXL_WHY}")
def test_a_peer_without_nixl_gets_zeromq_frames_and_the_trainer_says_why(tmp_path):
    """The trainer daemon offers NIXL, the inference daemons refuse it (forward_mover = "zmq" there,
    as a node without NIXL would): the bytes fall back to ZeroMQ frames, and each peer's status
    says which mover and why."""
    fmt = "mxfp8"
    c = Cluster(tmp_path, fmt, inference_args=("--forward-mover", "zmq")).start()
    try:
        with RefitClient(c.trainer.local, 0, 1, timeout=60) as client:
            client.push_step(0, weights(0), wait="published", timeout=60)
            peers = wait_until("both peers to acknowledge step 0", peers_at(c.trainer, 0), timeout=30)
        for p in peers.values():
            assert p["mover"] == "zmq" and p["mover_reason"] == "inference daemon: forward_mover=zmq", p
        for node in c.inference:
            assert node.status()["history"][-1]["mover"] == "zmq"
        assert "over zmq (inference daemon: forward_mover=zmq)" in c.trainer.logs()
    finally:
        c.stop()


def test_one_descriptor_when_the_carvings_match_else_one_per_tensor():
    job = Job(
        0, 0, (("a", "uint8", (10,), 10), ("b", "uint8", (300,), 300)), 310, 620, "x", (1000, 4096), (0, 256)
    )
    assert descriptors(job, 5000) == ([(1000, 556)], [(5000, 556)])
    moved = Job(0, 0, job.rows, 310, 620, "x", (1000, 4096), (512, 0))  # carved otherwise on this side
    assert descriptors(moved, 5000) == ([(1512, 10), (1000, 300)], [(5000, 10), (5256, 300)])


@pytest.fixture
def namespaces():
    """Two network namespaces the test makes, joined by a veth pair with 10.x addresses inside them
    (nothing is added to the default namespace); deleted afterwards. Skips, saying why, where they
    cannot be made (not root, no `ip`, no CAP_NET_ADMIN, a kernel without veth)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: no `ip` command")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN); nodes stay on loopback")
    tag = secrets.token_hex(3)
    trainer_ns, inference_ns = f"refitd-test-{tag}-t", f"refitd-test-{tag}-i"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
    made: list[str] = []
    steps = [
        ["ip", "netns", "add", trainer_ns],
        ["ip", "netns", "add", inference_ns],
        [
            "ip",
            "-n",
            trainer_ns,
            "link",
            "add",
            f"rt{tag}",
            "type",
            "veth",
            "peer",
            "name",
            f"ri{tag}",
            "netns",
            inference_ns,
        ],
        ["ip", "-n", trainer_ns, "addr", "add", f"{subnet}.1/30", "dev", f"rt{tag}"],
        ["ip", "-n", inference_ns, "addr", "add", f"{subnet}.2/30", "dev", f"ri{tag}"],
        *(["ip", "-n", ns, "link", "set", dev, "up"] for ns in (trainer_ns, inference_ns) for dev in ("lo",)),
        ["ip", "-n", trainer_ns, "link", "set", f"rt{tag}", "up"],
        ["ip", "-n", inference_ns, "link", "set", f"ri{tag}", "up"],
    ]
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            if cmd[1:3] == ["netns", "add"] and done.returncode == 0:
                made.append(cmd[3])
            if done.returncode != 0:
                pytest.skip(f"network namespaces: `{' '.join(cmd)}` failed: {done.stderr.strip()}")
        yield {"trainer": trainer_ns, "inference0": inference_ns}, f"{subnet}.2"
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)


def test_an_inference_node_in_its_own_network_namespace_gets_the_bytes(tmp_path, namespaces):
    """The trainer node and an inference node each in their own network namespace, joined by a veth
    pair (10.x addresses): the generation crosses it (NIXL where available, else ZeroMQ frames) and
    the inference node's engine loads exactly the trainer node's bytes."""
    netns, address = namespaces
    fmt = "block_fp8"
    c = Cluster(tmp_path, fmt, hosts=[address], netns=netns).start()
    try:
        engine = Engine(c.inference[0].local, "engine-0", fmt)  # ipc:// paths work across namespaces
        engine.worker.attach(timeout=30)
        with RefitClient(c.trainer.local, 0, 1, timeout=60) as client:
            client.push_step(0, weights(0), wait="published", timeout=60)
            assert engine.worker.load_next(0, 60).ok and engine.mismatches[0] == []
            peers = wait_until(
                "the namespaced peer to acknowledge step 0", peers_at(c.trainer, 0), timeout=30
            )
        engine.worker.detach()
        (p,) = peers.values()
        assert p["mover"] == AUTO_MOVER and p["error"] is None, p
        assert c.inference[0].status()["history"][-1]["mover"] == AUTO_MOVER
    finally:
        c.stop()


def test_a_killed_inference_node_does_not_hold_up_the_others_and_catches_up(cluster):
    """Node 1 is frozen (SIGSTOP) so that step 1's transfer to it hangs, then SIGKILLed mid-transfer.
    Node 0 still gets step 1, and the trainer pushes step 2 without waiting for node 1. Restarted on
    the same address, node 1 is sent the newest generation (step 2) and its engine loads it."""
    fmt = "block_fp8"
    c = cluster(fmt)
    alive, doomed = c.inference
    engine0 = Engine(alive.local, "engine-0", fmt)
    engine0.worker.attach(timeout=30)
    with ThreadPoolExecutor(1) as pool, RefitClient(c.trainer.local, 0, 1, timeout=60) as client:
        loading = pool.submit(engine0.worker.load_next, 0, 60)
        client.push_step(0, weights(0), timeout=60)
        assert loading.result().ok
        wait_until("both peers at step 0", peers_at(c.trainer, 0), timeout=30)

        doomed.proc.send_signal(signal.SIGSTOP)
        loading = pool.submit(engine0.worker.load_next, 1, 60)
        client.push_step(1, weights(1), timeout=60)
        assert loading.result().step == 1 and engine0.mismatches[1] == []
        peers = wait_until(
            "the transfer of step 1 to the frozen node",
            lambda: (p := c.trainer.status()["peers"])[doomed_ep(c)]["in_flight"] == 1 and p,
            timeout=30,
        )
        assert peers[c.endpoints[0]]["last_step"] == 1
        doomed.proc.kill()  # SIGKILL, mid-transfer
        doomed.proc.wait(timeout=30)

        loading = pool.submit(engine0.worker.load_next, 2, 60)
        # never waits on the dead node: it comes back only after this push, which would time out
        result = client.push_step(2, weights(2), timeout=60)
        assert loading.result().step == 2 and engine0.mismatches[2] == []
        assert result.peers[doomed_ep(c)]["last_step"] == 0  # what the trainer knew at publish time

        doomed.start().wait_ready()
        engine1 = Engine(doomed.local, "engine-1", fmt)
        engine1.worker.attach(timeout=30)
        caught_up = engine1.worker.load_next(2, 60)
        assert caught_up.ok and caught_up.step == 2 and engine1.mismatches[2] == []
        wait_until("both peers at step 2", peers_at(c.trainer, 2), timeout=30)
        assert torch.equal(engine1.logits(), reference_logits(2, fmt))
        engine1.worker.detach()
    engine0.worker.detach()


def doomed_ep(c: Cluster) -> str:
    return c.endpoints[1]


def test_an_unknown_curve_key_is_refused_and_the_client_says_why(cluster):
    """A reader presenting a key that is not in the inference daemon's allow-list gets no answer,
    and its timeout names CURVE as the likely cause; the allowed key is answered."""
    c = cluster("block_fp8")
    endpoint = c.endpoints[0]
    stranger = client_curve(c.inference_pub, c.stranger_key)
    with RefitReader(endpoint, name="stranger", curve=stranger) as reader, pytest.raises(RefitError) as err:
        reader.status(timeout=2.0)
    assert err.value.kind is ErrorKind.TIMEOUT and "CURVE" in str(err.value)
    assert "curve_allowed_keys" in str(err.value)
    with RefitReader(endpoint, name="friend", curve=client_curve(c.inference_pub, c.trainer_key)) as reader:
        assert reader.status(timeout=10)["role"] == "inference"
    assert "refused a CURVE client" in c.inference[0].logs()


def test_listening_beyond_loopback_without_keys_is_refused(tmp_path):
    """``--listen tcp://0.0.0.0:PORT`` without CURVE keys: exit 78 and the way to make keys."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(tmp_path / "run")),
            *("--model-type", "qwen3_5_moe", "--publish-bytes", "1MiB", "--staging-bytes", "1MiB"),
            *("--listen", f"tcp://0.0.0.0:{free_port('127.0.0.1')}"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert "refitd keygen" in out.stderr and "CURVE" in out.stderr


def test_keygen_writes_a_private_secret_and_a_public_key(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "keygen", "node7", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    secret, public = tmp_path / "node7.key", tmp_path / "node7.key.pub"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert "secret-key" in secret.read_text() and "secret-key" not in public.read_text()
    assert "--curve-secret-key" in out.stdout
    import zmq.auth

    assert zmq.auth.load_certificate(secret)[0] == zmq.auth.load_certificate(public)[0]
    again = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "keygen", "node7", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1 and "--force" in again.stderr


def test_demo_disaggregated_verifies_every_node_and_reports_the_wire():
    """``refitd demo --layout disaggregated``: both inference nodes verified, FP8 on the wire."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "sidecar.cli", "demo", "--layout", "disaggregated"),
            *("--steps", "2", "--layers", "2", "--format", "mxfp8", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] and summary["steps"] == 2 and len(summary["nodes"]) == 2
    for row in summary["per_step"]:
        assert row["published_exact"] and row["engine_exact"] and row["movers"] == [AUTO_MOVER] * 2
        assert 0 < row["wire_fp8"] < row["wire_bf16"]


def test_demo_disaggregated_forwards_a_variant_the_engines_hold():
    """``refitd demo --layout disaggregated`` with the engines holding INT4 with float32 scales (the demo's
    K of 96 and 160 take group 32 only): planned in them on the trainer node, forwarded, published and
    loaded byte for byte on both nodes; a parameter of another format is refused before anything starts."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "sidecar.cli", "demo", "--layout", "disaggregated"),
            *("--steps", "2", "--layers", "2", "--format", "int4_w4a16", "--json"),
            *("--int4-group", "32", "--int4-scale-dtype", "float32"),
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] and summary["steps"] == 2 and len(summary["nodes"]) == 2
    assert summary["format_params"] == "group 32, float32 scales"
    for row in summary["per_step"]:
        assert row["published_exact"] and row["engine_exact"] and 0 < row["kl"][0] < 0.05
    refused = subprocess.run(
        [
            *(sys.executable, "-m", "sidecar.cli", "demo", "--layout", "disaggregated"),
            *("--format", "nvfp4", "--int4-group", "64"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "int4_group = 64 applies to another format" in refused.stderr
