"""``systemd/refitd-slurm.sh`` under a real Slurm: one daemon per node of a 3-node allocation.

The cluster is Debian's slurmctld, slurmd and munge, brought up by ``tests/slurm_cluster.sh up 3``:
three ``slurmd -N n1..n3`` on this one host pretend to be three nodes, so the launcher must give
each daemon its own runtime directory and endpoint (``<base>/refitd-<jobid>-<node>``). The script
installs the packages with apt when they are missing; where it cannot (not root, no apt, no
network) or the daemons will not start, every test here is skipped with the reason. A cluster this
module started is stopped at the end by pidfile (slurmd, slurmctld, munged); one that was already
up is left running.

Each test submits a batch job with ``sbatch`` that ``exec``\\ s the launcher, waits for it to end
(an ``srun`` job that depends on it exits then; every wait has a deadline), and then reads what
the job left in a shared temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "tests" / "slurm_cluster.sh"
LAUNCHER = REPO / "systemd" / "refitd-slurm.sh"
NODES = ("n1", "n2", "n3")
MODEL = "qwen3_5_moe"
UP_TIMEOUT_S = 600  # a cold apt install downloads ~10 MB
JOB_TIMEOUT_S = 240
READY_TIMEOUT_S = 150  # three daemons importing torch at once on a 2-core machine take ~10-20 s
# `slurm_cluster.sh up`: 3 = cannot install, 4 = installed but would not start; both mean "skip".
CLUSTER_UNAVAILABLE = {3: "cannot install Slurm", 4: "Slurm would not start"}
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Slurm test cluster: Linux only"),
    pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory"),
    pytest.mark.timeout(UP_TIMEOUT_S + 2 * JOB_TIMEOUT_S),
]


def refitd_executable() -> str:
    here = Path(sys.executable).parent / "refitd"
    return str(here) if here.exists() else (shutil.which("refitd") or "refitd")


# --------------------------------------------------------------------------------------------------
# the cluster


@dataclass(frozen=True)
class Slurm:
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 30) -> str:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise AssertionError(f"{shlex.join(argv)} exited with {out.returncode}:\n{out.stderr}")
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, BatchHost, ...)."""
        line = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    def ended(self, job_id: str) -> subprocess.Popen[str]:
        """A process that exits once ``job_id`` has ended and freed its nodes: an ``srun`` whose
        job depends on it (``afterany``) and wants every node to itself, so slurmctld starts it
        only then. Its stdout (never written) reaches EOF at that moment: a pipe to select on."""
        return subprocess.Popen(
            ["srun", "--quiet", f"--dependency=afterany:{job_id}", f"-N{len(NODES)}", "--exclusive",
             f"--job-name=ended-{job_id}", "true"],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def wait(self, job_id: str, ended: subprocess.Popen[str], timeout: float) -> dict[str, str]:
        """``scontrol show job`` once ``ended`` (:meth:`ended`) exits; the job is cancelled, and
        the test fails, after ``timeout`` seconds."""
        try:
            _, err = ended.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            info = self.job(job_id)
            self.run("scancel", job_id)
            ended.terminate()  # srun cancels its pending job on SIGTERM
            ended.communicate(timeout=30)
            raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout} s") from None
        info = self.job(job_id)
        if ended.returncode != 0 or info["JobState"] not in DONE_STATES:
            raise AssertionError(f"job {job_id} is {info['JobState']}; the srun waiting for it exited "
                                 f"{ended.returncode}:\n{err}")  # fmt: skip
        return info


def _cluster(command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER), command, *([str(len(NODES))] if command == "up" else [])],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("needs root to install and run a throw-away Slurm cluster")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    already_up = _cluster("status", 30).returncode == 0
    started = time.monotonic()
    ours = not already_up
    try:
        if ours:
            try:
                up = _cluster("up", UP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.skip(f"tests/slurm_cluster.sh up took more than {UP_TIMEOUT_S} s")
            if up.returncode in CLUSTER_UNAVAILABLE:
                pytest.skip(f"{CLUSTER_UNAVAILABLE[up.returncode]}: {up.stderr.strip()[-1500:]}")
            assert up.returncode == 0, f"tests/slurm_cluster.sh up failed:\n{up.stderr}"
            print(f"Slurm test cluster up in {time.monotonic() - started:.1f} s")
        conf = _cluster("up", 60).stdout.strip().removeprefix("export SLURM_CONF=")
        yield Slurm({**os.environ, "SLURM_CONF": conf})
    finally:
        if ours:
            down = _cluster("down", 120)
            assert down.returncode == 0, f"tests/slurm_cluster.sh down failed:\n{down.stderr}"


# --------------------------------------------------------------------------------------------------
# a job that runs the launcher


class Job:
    """A batch job ``exec``-ing the launcher around ``command`` (bash), with its files in ``out``."""

    def __init__(self, slurm: Slurm, out: Path, command: str, *serve_flags: str):
        self.slurm, self.out, self.run_base = slurm, out, out / "run"
        self.run_base.mkdir()
        config = out / "config.json"
        if not config.exists():
            from sidecar.cli.demo.synthetic import make_hf_config

            config.write_text(json.dumps(make_hf_config(MODEL, num_layers=2, num_experts=8)))
        (out / "command.sh").write_text("set -euo pipefail\n" + command)
        launcher = [
            str(LAUNCHER), "--refitd", refitd_executable(), "--runtime-base", str(self.run_base),
            "--ready-timeout", str(READY_TIMEOUT_S), "--stop-timeout", "60",
            "--endpoints-file", str(out / "endpoints.env"),
            "--hf-config", str(config), "--world-size", "1", *serve_flags,
            "--", "bash", str(out / "command.sh"),
        ]  # fmt: skip
        (out / "job.sh").write_text(f"#!/bin/bash\nexec {shlex.join(launcher)}\n")
        self.id = slurm.run(
            "sbatch", "--parsable", f"-N{len(NODES)}", "--ntasks-per-node=1", "-D", str(out),
            "-o", str(out / "job.out"), "-e", str(out / "job.err"), str(out / "job.sh"),
        ).strip()  # fmt: skip
        self.ended = slurm.ended(self.id)

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
        return self.slurm.wait(self.id, self.ended, timeout)

    def log(self) -> str:
        return "\n".join(
            (self.out / n).read_text(errors="replace")[-8000:]
            for n in ("job.out", "job.err")
            if (self.out / n).exists()
        )

    def endpoint(self, node: str) -> str:
        return f"ipc://{self.run_base}/refitd-{self.id}-{node}/control.sock"


def status_on_every_node(out: Path) -> str:
    """Bash: on each node, with the launcher's --on-node, save that node's daemon status."""
    on_node = f'{shlex.quote(refitd_executable())} status --listen "$REFITD_ENDPOINT" --json > {shlex.quote(str(out))}/status-$SLURMD_NODENAME.json'
    return (
        f"srun --overlap -N{len(NODES)} --ntasks-per-node=1 {shlex.quote(str(LAUNCHER))} --on-node "
        f"-- bash -c {shlex.quote(on_node)}\n"
    )


def save_segments(job_out: Path, run_base: Path) -> str:
    """Bash: copy each daemon's record of its shared-memory segments (segments.json) to job_out."""
    return "".join(
        f"cp {run_base}/refitd-$SLURM_JOB_ID-{n}/segments.json {job_out}/segments-{n}.json\n" for n in NODES
    )


def assert_daemons_exited_cleanly(job: Job, log: str) -> None:
    """Every daemon exited 0, and left no segment in /dev/shm and no runtime dir."""
    for node in NODES:
        assert f"refitd on {node} exited 0" in log, log
    assert re.search(r"daemon step \S+ \(srun\) exited with 0", log), log
    segments = [
        name for n in NODES for name in json.loads((job.out / f"segments-{n}.json").read_text())["segments"]
    ]
    assert len(segments) == len(set(segments)) >= len(NODES), segments
    assert [s for s in segments if (Path("/dev/shm") / s).exists()] == [], "shared memory left behind"
    assert list(job.run_base.iterdir()) == [], "runtime dirs left behind"


# --------------------------------------------------------------------------------------------------
# tests


def test_one_daemon_per_node_for_the_length_of_the_command(slurm, tmp_path):
    """A 3-node batch job runs the launcher around a command. Every node gets a daemon in its own
    runtime dir; the launcher prints and writes one REFITD_ENDPOINT_<node> line per node and hands
    the command REFITD_ENDPOINT (the batch node's daemon), REFITD_ENDPOINTS and REFITD_ENDPOINTS_FILE;
    an srun step wrapped in --on-node gets its own node's endpoint, whose daemon answers STATUS.
    When the command ends, every daemon exits 0 and leaves no shared memory and no runtime dir."""
    command = (
        f"env | grep '^REFITD_' | sort > {tmp_path}/command.env\n"
        + status_on_every_node(tmp_path)
        + save_segments(tmp_path, tmp_path / "run")
    )
    job = Job(slurm, tmp_path, command)
    info = job.wait()
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert f"all {len(NODES)} daemons ready" in log, log

    expected = {f"REFITD_ENDPOINT_{n}": job.endpoint(n) for n in NODES}
    printed = dict(re.findall(r"^(REFITD_ENDPOINT_\w+)=(\S+)$", log, re.M))
    assert printed == expected, log
    written = dict(line.split("=", 1) for line in (tmp_path / "endpoints.env").read_text().split())
    assert written == expected

    seen = dict(line.split("=", 1) for line in (tmp_path / "command.env").read_text().splitlines())
    batch_node = info["BatchHost"]
    assert seen["REFITD_ENDPOINT"] == job.endpoint(batch_node)
    assert seen["REFITD_ENDPOINTS"] == ",".join(f"{n}={job.endpoint(n)}" for n in NODES)
    assert seen["REFITD_ENDPOINTS_FILE"] == str(tmp_path / "endpoints.env")

    statuses = {n: json.loads((tmp_path / f"status-{n}.json").read_text()) for n in NODES}
    for node, status in statuses.items():
        assert status["listen"] == job.endpoint(node)
        assert status["world_size"] == 1
    assert len({s["instance"] for s in statuses.values()}) == len(NODES)
    assert_daemons_exited_cleanly(job, log)


def test_a_daemon_that_cannot_start_fails_the_job_before_the_command(slurm, tmp_path):
    """``--world-size 0`` is a configuration error: every daemon exits 78 at once, and the launcher
    exits 69 naming each node and its status, without running the command or waiting out the
    ready deadline."""
    job = Job(slurm, tmp_path, f"touch {tmp_path}/command-ran\n", "--world-size", "0")
    info = job.wait(timeout=READY_TIMEOUT_S)  # exits at once: it never waits out the ready deadline
    log = job.log()
    assert info["ExitCode"] == "69:0", log
    assert "refitd exited during start-up" in log, log
    assert any(f"{n} 78" in log for n in NODES), log
    assert not (tmp_path / "command-ran").exists()
    assert list(job.run_base.iterdir()) == []


def test_scancel_batch_signal_term_stops_the_daemons_cleanly(slurm, tmp_path):
    """``scancel --batch --signal=TERM`` reaches the launcher (the batch shell) while its command
    sleeps: it stops the command, then the daemons (SIGTERM, not srun's SIGKILL), and exits 143;
    every daemon exits 0 and leaves nothing behind."""
    started = tmp_path / "started"
    os.mkfifo(started)  # the command writes a line into it; select wakes on that line or the job's end
    fifo = os.open(started, os.O_RDONLY | os.O_NONBLOCK)
    try:
        command = save_segments(tmp_path, tmp_path / "run") + f"echo started > {started}\nexec sleep 300\n"
        job = Job(slurm, tmp_path, command)
        ready, _, _ = select.select([fifo, job.ended.stdout], [], [], JOB_TIMEOUT_S)
        assert fifo in ready or job.ended.stdout in ready, (
            f"command not started after {JOB_TIMEOUT_S} s:\n{job.log()}"
        )
        if fifo not in ready:
            state = slurm.job(job.id)["JobState"]
            raise AssertionError(f"job ended ({state}) before its command started:\n{job.log()}")
    finally:
        os.close(fifo)
    slurm.run("scancel", "--batch", "--signal=TERM", job.id)
    info = job.wait()
    log = job.log()
    assert info["ExitCode"] == "143:0", log
    assert "got SIGTERM" in log and "command exited with 143" in log, log
    assert_daemons_exited_cleanly(job, log)
