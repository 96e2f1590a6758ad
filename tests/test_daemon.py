"""The daemon as it runs: ``refitd serve`` in a subprocess, four trainer ranks and an engine reader
in child processes of their own, all talking over the daemon's ``ipc://`` control socket.

Ranks 0 and 1 are local (they write into the staging arena); ranks 2 and 3 are remote (they stream
frames of at most 64 KiB under credits). Each step's weights come from a fresh seed, and the reader
compares every published tensor byte for byte with ``sidecar.plan.run.convert`` of the full state dict.

The fault tests break one step in one way and check the four promises of docs/design.md decisions 5 and
6: the error is clear (kind and a message naming the culprit), it reaches every rank, the last good
generation stays intact, and the daemon goes on serving. After every test no shared-memory segment
of any daemon the test started is left in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from support import procs
from support.waiting import wait_until

from adapters.base import RefitReader
from sidecar.errors import RefitError

SPAWN = mp.get_context("spawn")
REPO = Path(__file__).resolve().parent.parent
LOCAL = {0: True, 1: True, 2: False, 3: False}
RANK_TIMEOUT_S = 2.0
READER_TIMEOUT_S = 2.0
PUSH_TIMEOUT_S = 30.0
REPLY_MARGIN_S = 15.0  # how much longer than a push's own timeout the test waits for its reply
START_TIMEOUT_S = 60.0
LAYER0 = "model.language_model.layers.0"
LAYER1 = "model.language_model.layers.1"

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory")


# --------------------------------------------------------------------------------------------------
# child processes


class Child:
    """A spawned child obeying ``procs`` commands over a pipe; every wait on it has a deadline."""

    def __init__(self, name: str, target, *args: Any):
        self.name, self.seq = name, 0
        self.conn, theirs = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(theirs, *args), name=name, daemon=True)
        self.proc.start()
        theirs.close()

    def send(self, cmd: str, **kw: Any) -> None:
        self.seq += 1
        self.conn.send((cmd, kw, self.seq))

    def signal(self) -> None:
        """Let a child waiting inside its current command (``hold_begin``) go on."""
        self.conn.send(("go", {}, None))

    def reply(self, timeout: float) -> dict[str, Any]:
        """The next reply to the latest command; replies to commands given up on are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{self.name} gave no reply within {timeout:.0f} s")
            try:
                out = self.conn.recv()
            except EOFError:
                raise AssertionError(f"{self.name} died (exit code {self.proc.exitcode})") from None
            if out.get("seq") == self.seq:
                return out

    def call(self, cmd: str, *, wait_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        out = self.reply(wait_s)
        assert out.get("kind") != "exception", f"{self.name} {cmd}: {out['message']}"
        return out

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.send("exit")  # no reply
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class Pool:
    """Four trainer ranks and a reader, kept across tests (each imports torch once); a child that
    died or hung in a test is replaced before the next one."""

    def __init__(self) -> None:
        self.ranks: list[Child | None] = [None] * procs.WORLD
        self.reader: Child | None = None
        self.ensure()

    def ensure(self) -> None:
        for r in range(procs.WORLD):
            if self.ranks[r] is None or not self.ranks[r].proc.is_alive():
                self.ranks[r] = Child(f"rank {r}", procs.rank_main, r, procs.WORLD)
        if self.reader is None or not self.reader.proc.is_alive():
            self.reader = Child("reader", procs.reader_main)

    def reset(self) -> None:
        """Close every client and the reader; a child that does not answer in time is killed."""
        for child in [*self.ranks, self.reader]:
            if child is None or not child.proc.is_alive():
                continue
            try:
                child.call("close", wait_s=PUSH_TIMEOUT_S + REPLY_MARGIN_S)
            except (TimeoutError, AssertionError, OSError):
                child.proc.kill()
                child.proc.join(5)

    def shutdown(self) -> None:
        for child in [*self.ranks, self.reader]:
            if child is not None:
                child.stop()


# --------------------------------------------------------------------------------------------------
# the daemon


class DaemonProc:
    """``refitd serve`` in a subprocess, on ``runtime_dir``; ready once it answers STATUS."""

    def __init__(self, runtime_dir: Path, config: Path, fmt: str, log: Path, *extra: str):
        self.runtime_dir, self.endpoint = runtime_dir, f"ipc://{runtime_dir / 'control.sock'}"
        self.log_path = log
        argv = [
            sys.executable, "-m", "sidecar.cli", "serve",
            "--runtime-dir", str(runtime_dir),
            "--hf-config", str(config),
            "--world-size", str(procs.WORLD),
            "--format", fmt,
            "--rank-timeout", str(RANK_TIMEOUT_S),
            "--heartbeat-interval", "0.2",
            "--reader-timeout", str(READER_TIMEOUT_S),
            "--step-timeout", "30",
            "--max-frame-bytes", "64KiB",
            "--credit-frames", "2",
            *extra,
        ]  # fmt: skip
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        self.instance = ""
        self.segments: list[str] = []
        self.terminated = False  # SIGTERM sent by the test

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with RefitReader(self.endpoint, name="readiness") as probe:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"refitd serve exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    status = probe.status(timeout=0.5)
                    break
                except RefitError:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"refitd serve not ready after {timeout} s:\n{self.log()}"
                        ) from None
        self.instance = status["instance"]
        recorded = json.loads((self.runtime_dir / "segments.json").read_text())
        assert recorded["pid"] == self.proc.pid
        self.segments = recorded["segments"]
        assert len(self.segments) == 4 and all((Path("/dev/shm") / n).exists() for n in self.segments)
        return status

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        with RefitReader(self.endpoint, name="test-status") as probe:
            return probe.status(timeout=timeout)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"refitd serve ignored SIGTERM for {timeout} s:\n{self.log()}") from None

    def leftover_segments(self) -> list[str]:
        named = [n for n in self.segments if (Path("/dev/shm") / n).exists()]
        prefix = f"refitd-{os.getuid()}-{self.instance[:8]}-" if self.instance else None
        stray = [p.name for p in Path("/dev/shm").glob(f"{prefix}*")] if prefix else []
        return sorted(set(named) | set(stray))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


class Cluster:
    """One test's view: the pool's children, the daemons it started, and step helpers."""

    def __init__(self, pool: Pool, workdir: Path, logdir: Path):
        self.pool, self.workdir, self.logdir = pool, workdir, logdir
        self.config = workdir / "config.json"
        self.config.write_text(json.dumps(procs.hf_config()))
        self.runtime_dir = workdir / "run"
        self.daemons: list[DaemonProc] = []
        self.fmt = "block_fp8"

    @property
    def ranks(self) -> list[Child]:
        return self.pool.ranks

    @property
    def reader(self) -> Child:
        return self.pool.reader

    def start_daemon(self, fmt: str = "block_fp8", *extra: str) -> DaemonProc:
        self.fmt = fmt
        log = self.logdir / f"daemon-{len(self.daemons)}.log"
        daemon = DaemonProc(self.runtime_dir, self.config, fmt, log, *extra)
        self.daemons.append(daemon)
        daemon.wait_ready()
        return daemon

    def connect(
        self, daemon: DaemonProc, ranks: list[int] | None = None, reader: bool = True, mover: str = "auto"
    ) -> None:
        """``mover="zmq"``: remote ranks stream frames even where NIXL works (no rank pulled)."""
        for r in range(procs.WORLD) if ranks is None else ranks:
            self.ranks[r].call(
                "connect", endpoint=daemon.endpoint, local=LOCAL[r], timeout=PUSH_TIMEOUT_S, mover=mover
            )
        if reader:
            self.reader.call("open", endpoint=daemon.endpoint, name="test-reader")

    def push(
        self, step: int, seed: int, *, fault: dict | None = None, ranks: list[int] | None = None
    ) -> dict[int, dict[str, Any]]:
        """Every rank (or ``ranks``) pushes ``step`` at once; their replies by rank."""
        ranks = list(range(procs.WORLD)) if ranks is None else ranks
        self.send_push(step, seed, fault=fault, ranks=ranks)
        return self.collect(ranks)

    def send_push(self, step: int, seed: int, *, fault: dict | None = None, ranks: list[int]) -> None:
        for r in ranks:
            self.ranks[r].send("push", step=step, seed=seed, fault=fault, timeout=PUSH_TIMEOUT_S)

    def collect(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        out = {r: self.ranks[r].reply(PUSH_TIMEOUT_S + REPLY_MARGIN_S) for r in ranks}
        for r, reply in out.items():
            assert reply.get("kind") != "exception", f"rank {r}: {reply['message']}"
        return out

    def publish(self, step: int, seed: int) -> None:
        """A good step: every rank succeeds and the reader sees exactly convert(seed)."""
        self.reader.send("wait", min_step=step, seed=seed, fmt=self.fmt, timeout=PUSH_TIMEOUT_S)
        replies = self.push(step, seed)
        for r, reply in replies.items():
            assert reply["ok"], f"rank {r} failed step {step}: {reply}"
            assert reply["step"] == step
        assert len({reply["generation"] for reply in replies.values()}) == 1
        seen = self.reader.reply(PUSH_TIMEOUT_S + REPLY_MARGIN_S)
        assert seen["ok"], seen
        assert (seen["step"], seen["problems"]) == (step, []), seen["problems"][:40]

    def hold(self, step: int, seed: int) -> int:
        """The reader takes the live generation of ``step`` and keeps it; returns its index."""
        seen = self.reader.call("wait", min_step=step, seed=seed, fmt=self.fmt, timeout=10, release=False)
        assert (seen["step"], seen["problems"]) == (step, []), seen["problems"][:40]
        return seen["generation"]

    def assert_intact(self, daemon: DaemonProc, step: int, seed: int) -> None:
        """The held generation of ``step`` still holds its bytes, the daemon still serves it as live,
        and a fresh wait hands it out again unchanged."""
        held = self.reader.call("check", seed=seed, fmt=self.fmt)
        assert (held["step"], held["problems"]) == (step, [])
        status = daemon.status()
        assert status["last_step"] == step and status["live"]["step"] == step
        assert status["step_in_progress"] is None
        again = self.reader.call("wait", min_step=None, seed=seed, fmt=self.fmt, timeout=10)
        assert (again["step"], again["problems"]) == (step, [])

    def teardown(self) -> None:
        self.pool.reset()
        problems = []
        for daemon in self.daemons:
            exited_already = daemon.proc.poll() is not None
            code = daemon.terminate()
            if code != 0 or (exited_already and not daemon.terminated):
                how = "unasked" if exited_already and not daemon.terminated else "on SIGTERM"
                problems.append(f"daemon {daemon.instance} exited {code} {how}:\n{daemon.log()}")
            left = daemon.leftover_segments()
            if left:
                problems.append(f"daemon {daemon.instance} left segments {left}")
                for name in left:
                    (Path("/dev/shm") / name).unlink(missing_ok=True)
        assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def pool():
    p = Pool()
    yield p
    p.shutdown()


@pytest.fixture
def cluster(pool, tmp_path):
    pool.ensure()
    # a short path of our own: ipc:// socket paths must stay under ~100 bytes
    workdir = Path(tempfile.mkdtemp(prefix="refitd-test-"))
    c = Cluster(pool, workdir, tmp_path)  # daemon logs stay in tmp_path
    try:
        yield c
    finally:
        try:
            c.teardown()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def assert_all_failed(replies: dict[int, dict], kind: str, step: int, *fragments: str) -> dict:
    """Every rank raised the same RefitError (kind, step, message) naming ``fragments``."""
    for r, reply in replies.items():
        assert not reply["ok"], f"rank {r} did not fail: {reply}"
        assert (reply["kind"], reply["step"]) == (kind, step), f"rank {r}: {reply}"
        for fragment in fragments:
            assert fragment in reply["message"], f"rank {r}: {fragment!r} not in {reply['message']!r}"
    assert len({reply["message"] for reply in replies.values()}) == 1, replies
    return next(iter(replies.values()))


# --------------------------------------------------------------------------------------------------
# the happy path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "fp8_per_tensor"])
def test_four_ranks_publish_three_steps_byte_exact(cluster, fmt):
    """Four ranks, two local and two remote, push three steps of a Qwen3.5-MoE state dict split
    tensor-parallel and expert-parallel, with new weights each step. For every step the reader,
    already waiting in its own process, is handed a generation whose every tensor equals
    ``convert()`` of the whole state dict byte for byte; the two generations alternate."""
    daemon = cluster.start_daemon(fmt)
    cluster.connect(daemon)
    generations = []
    for step in range(3):
        cluster.publish(step, seed=100 + step)
        generations.append(daemon.status()["live"]["generation"])
    assert generations == [0, 1, 0]
    status = daemon.status()
    assert status["last_step"] == 2 and status["trainers"] == [0, 1, 2, 3]
    assert [h["step"] for h in status["history"]] == [0, 1, 2]
    assert all(h["bytes_in"] == status["plan"]["bytes_in"] for h in status["history"])


# --------------------------------------------------------------------------------------------------
# faults


@pytest.mark.timeout(120)
def test_rank_killed_mid_step_fails_the_step_on_every_other_rank(cluster):
    """Step 1 publishes and the reader holds it. In step 2 rank 3 (remote) is SIGKILLed right after
    READY, before it sends a byte. The three others, which sent everything and committed, all get
    RANK_DIED naming rank 3 within the rank timeout (plus a margin for a loaded machine); step 1
    stays live and intact. A replacement rank 3 connects and step 3 publishes."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=11)
    cluster.hold(1, seed=11)

    cluster.send_push(2, seed=12, fault={"kind": "die_after_ready", "rank": 3}, ranks=[0, 1, 2, 3])
    dying = cluster.ranks[3].reply(PUSH_TIMEOUT_S)
    assert dying["kind"] == "dying"
    cluster.ranks[3].proc.join(10)
    assert cluster.ranks[3].proc.exitcode == -signal.SIGKILL
    replies = cluster.collect([0, 1, 2])
    assert_all_failed(replies, "rank_died", 2, "rank 3")
    assert all(reply["rank"] == 3 for reply in replies.values())
    for r, reply in replies.items():
        assert reply["at"] - dying["at"] < RANK_TIMEOUT_S + 3.0, f"rank {r} learnt it too late"
    cluster.assert_intact(daemon, 1, seed=11)

    cluster.pool.ensure()  # a new rank 3 process takes the dead one's place
    cluster.connect(daemon, ranks=[3], reader=False)
    cluster.publish(3, seed=13)


@pytest.mark.timeout(120)
def test_four_ranks_through_a_staging_ring_and_a_rank_killed_mid_stream(cluster):
    """The daemon stages through two layer-sized regions (``--staging-regions 2``), a fraction of a
    step. Four ranks publish byte-exact through it; then rank 3 is SIGKILLed after READY while the
    others wait for regions its groups hold up: every other rank gets RANK_DIED naming rank 3, the
    published step stays intact, and a replacement rank 3 publishes the next step."""
    daemon = cluster.start_daemon("block_fp8", "--staging-regions", "2")
    status = daemon.status()
    assert status["staging"]["ring"]["regions"] == 2
    assert status["staging"]["bytes"] < status["plan"]["bytes_in"]
    cluster.connect(daemon)
    cluster.publish(1, seed=21)
    cluster.hold(1, seed=21)
    cluster.send_push(2, seed=22, fault={"kind": "die_after_ready", "rank": 3}, ranks=[0, 1, 2, 3])
    assert cluster.ranks[3].reply(PUSH_TIMEOUT_S)["kind"] == "dying"
    cluster.ranks[3].proc.join(10)
    replies = cluster.collect([0, 1, 2])
    assert_all_failed(replies, "rank_died", 2, "rank 3")
    cluster.assert_intact(daemon, 1, seed=21)
    assert daemon.status()["staging"]["ring"]["held"] == []
    cluster.pool.ensure()
    cluster.connect(daemon, ranks=[3], reader=False)
    cluster.publish(3, seed=23)


@pytest.mark.timeout(90)
def test_missing_shard_is_a_coverage_gap_on_every_rank(cluster):
    """In step 2 rank 1 leaves out its experts [2, 4) of layer 1's down_proj slab. Every rank gets
    COVERAGE naming the slab and the uncovered range; step 1 stays live; step 2, pushed again
    complete, publishes."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=21)
    cluster.hold(1, seed=21)

    slab = f"{LAYER1}.mlp.experts.down_proj"
    replies = cluster.push(2, seed=22, fault={"kind": "omit", "rank": 1, "tensor": slab})
    err = assert_all_failed(replies, "coverage", 2, slab)
    assert "no rank sent rows [2, 4)" in err["message"], err["message"]
    cluster.assert_intact(daemon, 1, seed=21)
    cluster.publish(2, seed=22)


@pytest.mark.timeout(90)
def test_overlapping_shards_are_refused_naming_both_ranks(cluster):
    """In step 2 rank 1 sends experts [2, 5) of layer 0's gate_up_proj slab, one more than its
    share, overlapping rank 2's [4, 6). Every rank gets COVERAGE naming the slab and both ranks;
    step 1 stays live; step 3 publishes."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=31)
    cluster.hold(1, seed=31)

    slab = f"{LAYER0}.mlp.experts.gate_up_proj"
    replies = cluster.push(2, seed=32, fault={"kind": "overlap", "rank": 1, "tensor": slab})
    err = assert_all_failed(replies, "coverage", 2, slab)
    assert re.search(r"ranks (1 and 2|2 and 1) both sent rows \[4, 5\)", err["message"]), err["message"]
    cluster.assert_intact(daemon, 1, seed=31)
    cluster.publish(3, seed=33)


@pytest.mark.timeout(90)
def test_nan_in_one_expert_is_refused_naming_the_checkpoint_tensor(cluster):
    """In step 2 expert 5 of layer 0's gate_up_proj slab (sent by rank 2) holds a NaN. Every rank
    gets NON_FINITE naming the checkpoint tensor ``…experts.5.gate_proj.weight``; nothing of step 2
    is published; step 3 publishes."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=41)
    cluster.hold(1, seed=41)

    slab = f"{LAYER0}.mlp.experts.gate_up_proj"
    replies = cluster.push(2, seed=42, fault={"kind": "nan", "rank": 2, "tensor": slab, "expert": 5})
    assert_all_failed(replies, "non_finite", 2, f"{LAYER0}.mlp.experts.5.gate_proj.weight", "NaN")
    cluster.assert_intact(daemon, 1, seed=41)
    cluster.publish(3, seed=43)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): state ``T`` in ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _freeze_rank_0(cluster: Cluster, step: int, seed: int) -> Child:
    """Rank 0 (local) stops itself with SIGSTOP after READY, its staging mapped and its copies
    planned; the daemon declares it dead (no PING for rank_timeout_s) and fails ``step`` on the
    other ranks; a new rank 0 process connects in its place. Returns the frozen child."""
    cluster.send_push(step, seed=seed, fault={"kind": "stop_after_ready", "rank": 0}, ranks=[0, 1, 2, 3])
    stopping = cluster.ranks[0].reply(PUSH_TIMEOUT_S)
    assert stopping["kind"] == "stopping", stopping
    frozen = cluster.ranks[0]
    wait_until("rank 0 to be stopped", lambda: _stopped(frozen.proc.pid))
    assert_all_failed(cluster.collect([1, 2, 3]), "rank_died", step, "rank 0")
    cluster.pool.ranks[0] = Child("rank 0 (replacement)", procs.rank_main, 0, procs.WORLD)
    cluster.connect(cluster.daemons[-1], ranks=[0], reader=False)
    return frozen


def _resume(frozen: Child) -> None:
    """SIGCONT the frozen rank and wait until its push gave up: every copy it had planned was
    written (through whatever it still maps) before it read the daemon's answer."""
    os.kill(frozen.proc.pid, signal.SIGCONT)
    late = frozen.reply(PUSH_TIMEOUT_S + REPLY_MARGIN_S)
    assert not late["ok"], late
    frozen.stop()


@pytest.mark.timeout(120)
def test_no_trainer_process_maps_a_generation_and_generations_are_read_only_on_disk(cluster):
    """Issue 21, case 2: a rank keeps no writable mapping of a published generation, so a write
    through a mapping kept after RESULT has nowhere to go: after two steps (one into each
    generation) no trainer process maps either generation at all, local ranks map only staging,
    and the reader maps the generations read-only. Defence in depth: the generation segments (and
    the epoch page) are 0400 on disk, so opening one by name for writing is refused."""
    daemon = cluster.start_daemon("bf16")  # every input a passthrough
    cluster.connect(daemon, mover="zmq")
    cluster.publish(1, seed=81)
    cluster.publish(2, seed=82)
    gens = [n for n in daemon.segments if "-gen" in n]
    assert len(gens) == 2
    for r in range(procs.WORLD):
        maps = cluster.ranks[r].call("maps")["maps"]
        mapped = [(name, perms) for name, perms in maps if name.split()[0] in gens]
        assert not mapped, f"rank {r} maps a generation: {mapped}"
        if LOCAL[r]:
            assert any("-staging-" in name and perms.startswith("rw") for name, perms in maps), maps
    for name in [*gens, next(n for n in daemon.segments if "-epochs-" in n)]:
        path = Path("/dev/shm") / name
        assert path.stat().st_mode & 0o777 == 0o400, f"{name}: {oct(path.stat().st_mode)}"
        if os.geteuid() != 0:  # root opens anything: the mode is what stops every other process
            with pytest.raises(PermissionError):
                os.open(path, os.O_RDWR)
    cluster.publish(3, seed=83)


@pytest.mark.timeout(150)
def test_a_frozen_rank_that_resumes_cannot_change_a_published_generation(cluster):
    """Issue 21, case 1: rank 0 freezes after READY of step 2 (SIGSTOP) and is declared dead; a
    replacement rank 0 and the others publish step 3, into the very generation step 2 was going
    to; the reader holds it. Then the frozen rank resumes (SIGCONT) and writes all its step-2
    copies through whatever it still maps. The live generation still is exactly convert() of
    step 3, the bytes the reader holds did not change, and a fresh read hands out the same."""
    daemon = cluster.start_daemon("bf16")  # every input a passthrough: all published as sent
    cluster.connect(daemon, mover="zmq")  # remote ranks' frames (a NIXL READ goes to staging)
    cluster.publish(1, seed=61)
    frozen = _freeze_rank_0(cluster, 2, seed=62)
    cluster.publish(3, seed=63)
    cluster.hold(3, seed=63)
    _resume(frozen)
    cluster.assert_intact(daemon, 3, seed=63)
    status = daemon.status()
    assert status["last_step"] == 3
    staging = status["staging"]["segment"]  # retired after step 2: a new one, recorded for crash clean-up
    assert staging not in daemon.segments
    assert staging in json.loads((daemon.runtime_dir / "segments.json").read_text())["segments"]
    cluster.publish(4, seed=64)


@pytest.mark.timeout(150)
def test_a_frozen_rank_that_resumes_cannot_change_a_later_steps_inputs(cluster):
    """Issue 21, case 1 (staging): as above, but the frozen rank resumes while step 3 is in flight:
    the replacement rank 0 and the remote ranks have written and committed, and rank 1 holds back
    its part (the expert slabs span every rank, so no slab of step 3 was quantized yet). The frozen
    rank's late step-2 copies must not become inputs of step 3: it publishes exactly convert() of
    its own weights."""
    daemon = cluster.start_daemon("block_fp8")
    cluster.connect(daemon, mover="zmq")
    cluster.publish(1, seed=71)
    frozen = _freeze_rank_0(cluster, 2, seed=72)
    cluster.reader.send("wait", min_step=3, seed=73, fmt=cluster.fmt, timeout=PUSH_TIMEOUT_S)
    cluster.send_push(3, seed=73, fault={"kind": "hold_write", "rank": 1}, ranks=[0, 1, 2, 3])
    assert cluster.ranks[1].reply(PUSH_TIMEOUT_S)["kind"] == "holding"

    def committed() -> bool:
        step = daemon.status()["step_in_progress"]
        return step is not None and step["committed"] == [0, 2, 3]

    wait_until("ranks 0, 2 and 3 to commit step 3", committed)
    _resume(frozen)  # its copies land now, before rank 1 writes
    cluster.ranks[1].signal()
    for r, reply in cluster.collect([0, 1, 2, 3]).items():
        assert reply["ok"] and reply["step"] == 3, f"rank {r}: {reply}"
    seen = cluster.reader.reply(PUSH_TIMEOUT_S + REPLY_MARGIN_S)
    assert (seen["step"], seen["problems"]) == (3, []), seen["problems"][:20]


@pytest.mark.timeout(90)
def test_begin_crossing_a_failure_does_not_wedge_the_next_step(cluster):
    """Rank 3 has its WELCOME for step 2 and is about to send BEGIN when step 2 fails: rank 2
    declares its slice of the embedding as float32 while ranks 0 and 1 say bfloat16. The daemon
    tells every connected rank, rank 3 included, but rank 3's BEGIN is already on its way: it
    crosses the ERROR. Rank 3 still raises the same INVALID error, and the daemon must not take the
    stale BEGIN for a new attempt at step 2 that would hold up step 3 until the step timeout."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=91)
    cluster.hold(1, seed=91)

    embed = "model.language_model.embed_tokens.weight"
    cluster.send_push(2, seed=92, fault={"kind": "hold_begin", "rank": 3}, ranks=[3])
    assert cluster.ranks[3].reply(PUSH_TIMEOUT_S)["kind"] == "holding"
    replies = cluster.push(2, seed=92, fault={"kind": "dtype", "rank": 2, "tensor": embed}, ranks=[0, 1, 2])
    cluster.ranks[3].signal()
    replies[3] = cluster.ranks[3].reply(PUSH_TIMEOUT_S + REPLY_MARGIN_S)
    assert_all_failed(replies, "invalid", 2, embed, "float32", "bfloat16")
    cluster.assert_intact(daemon, 1, seed=91)

    # the stale BEGIN started nothing: once the daemon took it in, no step is in progress (a step 2
    # of rank 3 alone would hold step 3 until the step timeout)
    crossed = "ignored rank 3's BEGIN of step 2, which failed before it arrived"
    wait_until(
        "the daemon to take in rank 3's BEGIN that crossed the failure",
        lambda: crossed in daemon.log_path.read_text(),
        timeout=PUSH_TIMEOUT_S,
    )
    assert daemon.status()["step_in_progress"] is None
    cluster.publish(3, seed=93)


@pytest.mark.timeout(90)
def test_step_regression_is_refused_on_every_rank(cluster):
    """Steps 1 and 2 publish; then every rank pushes step 1 again. Each gets STEP_ORDER for step 1
    saying step 2 is already published; step 2 stays live; step 3 publishes."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=51)
    cluster.publish(2, seed=52)
    cluster.hold(2, seed=52)

    replies = cluster.push(1, seed=51)
    for r, reply in replies.items():
        assert not reply["ok"], reply
        assert (reply["kind"], reply["step"], reply["rank"]) == ("step_order", 1, r), reply
        assert "step 2 is already published" in reply["message"]
    cluster.assert_intact(daemon, 2, seed=52)
    cluster.publish(3, seed=53)


@pytest.mark.timeout(90)
def test_reader_that_never_releases_is_timed_out(cluster):
    """The reader takes step 1's generation and never releases it. Step 2 goes to the other
    generation at once; step 3 needs the held one, so the daemon waits reader_timeout_s, drops the
    hold and publishes; step 4 follows. The reader, still holding step 1, can wait again and is
    handed step 4, byte-exact."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=61)
    held = cluster.hold(1, seed=61)

    replies = cluster.push(2, seed=62)
    assert all(reply["ok"] for reply in replies.values()), replies
    assert daemon.status()["generations"][held]["holders"] == 1

    t0 = time.monotonic()
    replies = cluster.push(3, seed=63)
    waited = time.monotonic() - t0
    assert all(reply["ok"] and reply["generation"] == held for reply in replies.values()), replies
    assert waited >= READER_TIMEOUT_S - 0.1, f"the hold was dropped after {waited:.2f} s only"
    assert daemon.status()["generations"][held]["holders"] == 0

    replies = cluster.push(4, seed=64)
    assert all(reply["ok"] for reply in replies.values()), replies
    seen = cluster.reader.call(
        "wait", min_step=4, seed=64, fmt=cluster.fmt, timeout=10, release=False, release_held=False
    )
    assert (seen["step"], seen["problems"]) == (4, [])


@pytest.mark.timeout(120)
def test_daemon_restart_between_steps(cluster):
    """Step 1 publishes and the reader holds it. The daemon gets SIGTERM, exits 0 and unlinks its
    segments; a new daemon starts on the same runtime dir. The four clients, kept open, and the
    reader reconnect on their next push or wait, and step 2 publishes byte-exact."""
    first = cluster.start_daemon()
    cluster.connect(first)
    cluster.publish(1, seed=71)
    cluster.hold(1, seed=71)

    assert first.terminate() == 0
    assert first.leftover_segments() == []
    assert not (cluster.runtime_dir / "segments.json").exists()

    second = cluster.start_daemon()
    assert second.instance != first.instance and second.status()["last_step"] is None
    cluster.publish(2, seed=72)
    assert second.status()["last_step"] == 2


@pytest.mark.timeout(90)
def test_sigterm_during_a_step_answers_the_ranks_and_frees_memory(cluster):
    """Step 1 publishes. Ranks 0-2 begin step 2 and wait for rank 3, which never comes; the daemon
    gets SIGTERM. It exits 0, the three ranks get a clear SHUTDOWN (or UNAVAILABLE) error for step 2,
    and no segment is left."""
    daemon = cluster.start_daemon()
    cluster.connect(daemon)
    cluster.publish(1, seed=81)

    cluster.send_push(2, seed=82, ranks=[0, 1, 2])
    deadline = time.monotonic() + 20
    while (daemon.status()["step_in_progress"] or {}).get("begun") != [0, 1, 2]:
        assert time.monotonic() < deadline, "ranks 0-2 never began step 2"
    assert daemon.terminate() == 0
    replies = cluster.collect([0, 1, 2])
    for r, reply in replies.items():
        assert not reply["ok"] and reply["kind"] == "shutdown", f"rank {r}: {reply}"
        assert reply["step"] == 2
    assert daemon.leftover_segments() == []


def test_serve_with_a_malformed_config_exits_78(tmp_path):
    """``refitd serve`` given a config file with a bad value and an unknown key exits 78
    (EX_CONFIG: restarting won't help) and says what to fix, without allocating anything."""
    bad = tmp_path / "refitd.toml"
    bad.write_text('world_size = 0\nrank_timeout_s = "soon"\nno_such_setting = 1\n')
    argv = ["serve", "--config", str(bad), "--runtime-dir", str(tmp_path / "run")]
    run = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert run.returncode == 78, run.stderr
    assert "world_size" in run.stderr and "no_such_setting" in run.stderr
    assert not (tmp_path / "run" / "segments.json").exists()


# --------------------------------------------------------------------------------------------------
# regressions found by the tests above


def test_views_first_made_by_the_worker_stay_writable_by_the_serve_loop():
    """A local rank's tensor can complete, and its unit run, before the first remote frame reaches
    the serve loop: the quantization worker is then the first to carve the staging arena into
    (cached) views. The serve loop must still be able to copy a frame into those same views; under
    ``torch.inference_mode`` they were inference tensors and the copy crashed the daemon."""
    import queue

    import torch
    import zmq

    from sidecar.daemon.memory.generations import layouts
    from sidecar.daemon.worker import QuantWorker
    from sidecar.plan.build import RefitSpec, plan_from_hf_config
    from transport.shm import ShmArena, segment_name

    plan = plan_from_hf_config(procs.hf_config(), RefitSpec(model_type=procs.MODEL, fmt="block_fp8"))
    unit = next(u for u in plan.units if u.fmt is None)
    staging_layout, outputs_layout = layouts(plan)
    ctx = zmq.Context()
    wake = ctx.socket(zmq.PULL)
    wake.bind("inproc://views-test")
    staging = ShmArena.create(segment_name(f"refitd-{os.getuid()}-viewtest", "staging"), staging_layout)
    target = ShmArena.create(segment_name(f"refitd-{os.getuid()}-viewtest", "gen0"), outputs_layout)
    worker = QuantWorker(ctx, "inproc://views-test")
    try:
        worker.submit(
            0,
            unit,
            {n: staging.tensor(n) for n in unit.inputs},
            {o.name: target.tensor(o.name) for o in unit.outputs},
        )
        try:
            done = worker.results.get(timeout=30)
        except queue.Empty:
            raise AssertionError("the worker never reported its unit") from None
        assert done.error is None, done.error
        name = unit.inputs[0]
        dest = staging.tensor(name)  # the cached view the worker made
        dest.copy_(torch.ones_like(dest))
        assert bool((staging.tensor(name) == 1).all())
    finally:
        worker.close()
        for arena in (staging, target):
            arena.close()
            arena.unlink()
        wake.close(linger=0)
        ctx.term()
