"""Clients across a daemon restart, and clients a CURVE server refuses.

A real ``refitd serve`` is SIGKILLed in the middle of a step and a new one starts on the same runtime
dir. The trainer rank waiting in that step fails once, at once, with ``DaemonRestarted`` naming both
instances and the lost step; the same client objects then push the next step, which publishes
byte-exact. A reader and an engine worker waiting across the restart attach again (the worker with
its manifest) and get the new daemon's generation; the reader keeps no mapping of the dead daemon's
segments once it let go of what it held.

A client whose CURVE key the server refuses never gets a connection: ``push_step(timeout=...)``
still returns (with a TIMEOUT that says to check the keys) and ``close()`` does not block.
"""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import zmq
from support.daemons import RunningDaemon
from support.net import free_port

from adapters.base import RefitReader
from adapters.engine import EngineWorker
from adapters.reference import ReferenceEngine
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import DaemonRestarted, RefitClient, Shard
from sidecar.daemon.step import begin_rows
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert
from transport.curve import client_curve, write_keypair
from transport.wire import Kind, Limits, Message, decode, encode

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parent.parent
MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
FMT = "block_fp8"
WORLD = 2
PUSH_TIMEOUT_S = 90.0
START_TIMEOUT_S = 90.0


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=500 + step, **MODEL)


def expected(step: int) -> dict[str, torch.Tensor]:
    return convert(weights(step), RefitSpec(model_type="qwen3_5_moe", fmt=FMT))


def rank_part(sd: dict[str, torch.Tensor], rank: int) -> list[tuple[str, object]]:
    """Expert slabs split by expert between the two ranks; every other tensor sent whole by one."""
    out = []
    for i, (name, t) in enumerate(sd.items()):
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            e0, e1 = t.shape[0] * rank // WORLD, t.shape[0] * (rank + 1) // WORLD
            out.append((name, Shard(t[e0:e1], tuple(t.shape), (e0, 0, 0))))
        elif i % WORLD == rank:
            out.append((name, t))
    return out


def mismatches(tensors, want: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(want) ^ set(tensors))
    for name, w in want.items():
        got = tensors.get(name)
        if got is not None and not torch.equal(
            got.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)
        ):
            bad.append(name)
    return bad


class Serve:
    """``refitd serve`` in a subprocess on ``runtime_dir``; ready once it answers STATUS."""

    def __init__(self, tmp_path: Path, log: Path):
        config = tmp_path / "config.json"
        config.write_text(json.dumps(CONFIG))
        self.runtime_dir = tmp_path / "run"
        self.endpoint = f"ipc://{self.runtime_dir / 'control.sock'}"
        argv = [
            sys.executable, "-m", "sidecar.cli", "serve",
            "--runtime-dir", str(self.runtime_dir),
            "--hf-config", str(config),
            "--world-size", str(WORLD),
            "--format", FMT,
            "--heartbeat-interval", "0.2",
            "--rank-timeout", "60",  # a restart is noticed by the new instance, not by silence
            "--reader-timeout", "30",
            "--step-timeout", "120",
        ]  # fmt: skip
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + START_TIMEOUT_S
        with RefitReader(self.endpoint, name="readiness") as probe:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"refitd serve exited {self.proc.returncode}:\n{log.read_text()}")
                try:
                    self.instance = probe.status(timeout=0.5)["instance"]
                    break
                except RefitError:
                    assert time.monotonic() < deadline, f"refitd serve not ready:\n{log.read_text()}"
        self.segments = json.loads((self.runtime_dir / "segments.json").read_text())["segments"]

    def status(self) -> dict:
        with RefitReader(self.endpoint, name="test-status") as probe:
            return probe.status(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def mapped(names: list[str]) -> list[str]:
    """Which of the shared-memory segments ``names`` this process still maps."""
    maps = Path("/proc/self/maps").read_text()
    return [n for n in names if f"/dev/shm/{n}" in maps]


def push_all(clients: list[RefitClient], step: int):
    sd = weights(step)
    futures = [c.push_step_async(step, rank_part(sd, c.rank), timeout=PUSH_TIMEOUT_S) for c in clients]
    return [f.result(timeout=PUSH_TIMEOUT_S + 30) for f in futures]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory")
def test_a_daemon_sigkilled_mid_step_fails_the_step_once_and_every_client_carries_on(tmp_path):
    """Step 1 publishes; the reader holds it. Rank 0 begins step 2 (rank 1 never does), while the
    reader and an engine worker wait for step 3. The daemon is SIGKILLed and a new one starts on the
    same runtime dir: rank 0's step 2 fails with DaemonRestarted (old -> new instance, "push again"),
    not a hang to the step timeout. The same client objects push step 3 to the new daemon; it
    publishes byte-exact; the reader and the engine worker (re-attached with its manifest) get it.
    Once the reader let go of step 1, it maps nothing of the dead daemon."""
    first = Serve(tmp_path, tmp_path / "daemon-0.log")
    second = None
    engine = ReferenceEngine.from_config(CONFIG, expert_format=FMT)
    loaded: dict[int, list[str]] = {}

    def load(gen):
        loaded[gen.step] = mismatches(gen.tensors, expected(gen.step))
        engine.load(gen.tensors)

    clients = [
        RefitClient(first.endpoint, r, WORLD, local=r == 0, timeout=PUSH_TIMEOUT_S) for r in range(WORLD)
    ]
    reader = RefitReader(first.endpoint, name="test-reader", timeout=PUSH_TIMEOUT_S)
    worker = EngineWorker(first.endpoint, name="engine-0", manifest=engine.manifest(), load=load, timeout=120)
    pool = ThreadPoolExecutor(2)
    try:
        worker.attach(timeout=30)
        load1 = pool.submit(worker.load_next, 1, PUSH_TIMEOUT_S)
        results = push_all(clients, 1)
        assert {r.step for r in results} == {1}
        assert load1.result(PUSH_TIMEOUT_S).ok and loaded[1] == []
        held = reader.wait(min_step=1, timeout=30)
        assert held.step == 1 and held.instance == first.instance
        assert mismatches(held.tensors, expected(1)) == []

        doomed = clients[0].push_step_async(2, rank_part(weights(2), 0), timeout=PUSH_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while (first.status()["step_in_progress"] or {}).get("begun") != [0]:
            assert time.monotonic() < deadline, "rank 0 never began step 2"
        got3 = pool.submit(reader.wait, 3, PUSH_TIMEOUT_S)
        load3 = pool.submit(worker.load_next, 3, PUSH_TIMEOUT_S)

        first.proc.kill()  # SIGKILL, mid-step
        assert first.proc.wait(30) == -signal.SIGKILL
        second = Serve(tmp_path, tmp_path / "daemon-1.log")
        assert second.instance != first.instance

        with pytest.raises(DaemonRestarted) as lost:
            doomed.result(timeout=60)  # not the step timeout: the first reply of the new instance says it
        err = lost.value
        assert err.kind is ErrorKind.RESTARTED and err.step == 2 and err.rank == 0
        assert (err.old, err.new) == (first.instance, second.instance)
        assert f"daemon restarted (instance {first.instance} -> {second.instance}); step 2 was lost" in str(
            err
        )

        results = push_all(clients, 3)  # the same client objects
        assert {r.step for r in results} == {3} and len({r.generation for r in results}) == 1
        gen3 = got3.result(PUSH_TIMEOUT_S)
        assert gen3.step == 3 and gen3.instance == second.instance
        assert mismatches(gen3.tensors, expected(3)) == []
        result3 = load3.result(PUSH_TIMEOUT_S)
        assert result3.ok and result3.step == 3 and loaded[3] == []
        assert [e["name"] for e in second.status()["engines"]] == [
            "engine-0"
        ]  # re-attached, manifest and all

        reader.release(held)  # the dead daemon's generation: nobody to tell, its mapping goes
        del held
        gc.collect()
        assert mapped(first.segments) == [], "the reader still maps the dead daemon's segments"
        reader.release(gen3)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        worker.detach()
        reader.close()
        for c in clients:
            c.close()
        for d in (first, second):
            if d is not None:
                d.stop()


# --------------------------------------------------------------------------------------------------
# a refused CURVE key


@pytest.fixture
def curve_daemon(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    secret, public = write_keypair(keys, "node")
    _, trainer_pub = write_keypair(keys, "trainer")
    stranger, _ = write_keypair(keys, "stranger")
    d = RunningDaemon(
        tmp_path,
        hf_config=CONFIG,
        world_size=1,
        listen=f"tcp://127.0.0.1:{free_port()}",
        curve_secret_key=secret,
        curve_allowed_keys=trainer_pub,
    )
    yield d, client_curve(public, stranger)
    d.close()


def test_a_refused_curve_key_times_out_push_step_and_close_returns(curve_daemon):
    """The daemon's allow-list lacks the client's key: the handshake never completes, so no message
    can leave. push_step(timeout=2) raises TIMEOUT naming the CURVE keys as the likely cause, instead
    of blocking in a send forever; close() returns."""
    d, stranger = curve_daemon
    client = RefitClient(d.endpoint, 0, 1, curve=stranger, timeout=600)
    outcome: dict[str, object] = {}

    def push() -> None:
        try:
            client.push_step(1, weights(1), timeout=2)
        except RefitError as exc:
            outcome["error"] = exc
        finally:
            client.close()
            outcome["closed"] = True

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    thread.join(60)  # push_step's own timeout ends it (the TIMEOUT below), not this deadline
    assert not thread.is_alive(), "push_step(timeout=2) or close() hung on a refused CURVE key"
    err = outcome["error"]
    assert isinstance(err, RefitError) and err.kind is ErrorKind.TIMEOUT and err.step == 1
    assert "curve_allowed_keys" in str(err)
    assert outcome["closed"]


def test_close_during_a_push_that_cannot_connect_returns(curve_daemon):
    """close() while a push (with the default 600 s timeout) is stuck on a refused connection: close
    returns within a heartbeat or so, and the push fails with UNAVAILABLE ("closed")."""
    d, stranger = curve_daemon
    client = RefitClient(d.endpoint, 0, 1, curve=stranger, timeout=600)
    future = client.push_step_async(1, weights(1))
    with contextlib.suppress(TimeoutError):
        future.result(timeout=1)  # let it get stuck
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() blocked behind a push that cannot connect"
    with pytest.raises(RefitError) as err:
        future.result(timeout=10)
    assert err.value.kind is ErrorKind.UNAVAILABLE and "closed" in str(err.value)


# --------------------------------------------------------------------------------------------------
# a scripted daemon: the restart seen in the middle of the data


class ScriptedDaemon:
    """A ROUTER that answers a remote client as the daemon would, in a thread. Its instance changes
    to ``second`` once it has refused the first SHARD as from an unknown peer (what a restarted
    daemon says to data meant for its predecessor); the HELLO identities it saw are kept."""

    def __init__(self, tmp_path: Path, first: str, second: str):
        self.endpoint = f"ipc://{tmp_path / 'scripted.sock'}"
        self.instance, self.second = first, second
        self.hellos: list[bytes] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def send(self, identity: bytes, kind: Kind, fields: dict) -> None:
        self.sock.send_multipart([identity, *encode(Message(kind, {**fields, "instance": self.instance}))])

    def serve(self) -> None:
        refused = False
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames, Limits())
            step = msg.get("step")
            if msg.kind is Kind.HELLO:
                self.hellos.append(identity)
                welcome = dict(local=False, heartbeat_interval_s=0.2, rank_timeout_s=30, credit_frames=64)
                self.send(identity, Kind.WELCOME, welcome)
            elif msg.kind is Kind.BEGIN:
                rows = begin_rows(0, msg.get("pieces"))  # packed by the client
                self.send(identity, Kind.READY, {"step": step, "pieces": list(range(len(rows)))})
                self.send(identity, Kind.CREDIT, {"step": step, "frames": 64})
            elif msg.kind is Kind.SHARD and not refused:
                refused, self.instance = True, self.second
                self.send(identity, Kind.ERROR, {"kind": "unknown_peer", "message": "say HELLO first"})
            elif msg.kind is Kind.COMMIT:
                self.send(identity, Kind.ACK, {"step": step, "of": "commit"})
                self.send(
                    identity, Kind.RESULT, {"step": step, "generation": 0, "bytes_in": 0, "bytes_out": 0}
                )
            elif msg.kind is Kind.PING:
                self.send(identity, Kind.PONG, {})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def test_a_restart_seen_while_streaming_fails_the_step_once_on_a_fresh_connection(tmp_path):
    """A remote rank streams its shards; the daemon answers one with UNKNOWN_PEER from a new instance
    (it restarted). The push fails with DaemonRestarted naming both instances, the client drops that
    connection (its queued frames were meant for the dead daemon), and the next push says HELLO on a
    new connection and publishes."""
    daemon = ScriptedDaemon(tmp_path, "a" * 16, "b" * 16)
    client = RefitClient(daemon.endpoint, 0, 1, local=False, mover="zmq", timeout=60)
    try:
        with pytest.raises(DaemonRestarted) as lost:
            client.push_step(5, {"w": torch.ones(8, 8)}, timeout=30)
        assert (lost.value.old, lost.value.new, lost.value.step) == ("a" * 16, "b" * 16, 5)
        assert "step 5 was lost, push again" in str(lost.value)
        assert client.push_step(6, {"w": torch.ones(8, 8)}, timeout=30).step == 6
        assert len(daemon.hellos) == 2 and daemon.hellos[0] != daemon.hellos[1]  # a fresh connection
    finally:
        client.close()
        daemon.close()
