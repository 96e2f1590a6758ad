"""Signals of a real ``refitd serve``: SIGHUP reloads what can change safely, SIGTERM drains as configured."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict, shard_for_rank
from sidecar.client.client import RefitClient
from sidecar.errors import ErrorKind, RefitError

pytestmark = pytest.mark.timeout(180)
MODEL = dict(num_layers=2, num_experts=4, unaligned=True)


def start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_hf_config("qwen3_5_moe", **MODEL)))
    log = tmp_path / "daemon.log"
    cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(tmp_path / "run")]
    cmd += ["--hf-config", str(config), "--heartbeat-interval", "0.2", *extra]
    proc = subprocess.Popen(cmd, stderr=log.open("w"))
    endpoint = f"ipc://{tmp_path / 'run' / 'control.sock'}"
    wait_for(endpoint, proc, lambda s: True)
    return proc, endpoint, log


def wait_for(endpoint: str, proc: subprocess.Popen, predicate, timeout: float = 60.0) -> dict:
    """Poll the daemon's status until ``predicate`` holds (bounded: each poll waits for an answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
        with RefitReader(endpoint, name="test-status") as reader:
            try:
                status = reader.status(timeout=1.0)
            except RefitError:
                continue
        if predicate(status):
            return status
    raise AssertionError("the daemon never reached the expected state")


def test_sighup_reloads_timeouts_and_names_what_needs_a_restart(tmp_path):
    """The file changes a timeout, the log level and the format; SIGHUP applies the first two only."""
    conf = tmp_path / "refitd.toml"
    conf.write_text("step_timeout_s = 300\nformat = 'block_fp8'\n")
    proc, endpoint, log = start(tmp_path, "--config", str(conf))
    try:
        conf.write_text("step_timeout_s = 42\nlog_level = 'debug'\nformat = 'mxfp8'\n")
        proc.send_signal(signal.SIGHUP)
        status = wait_for(endpoint, proc, lambda s: s["settings"]["step_timeout_s"] == 42)
        assert status["settings"]["log_level"] == "debug" and status["format"] == "block_fp8"
        conf.write_text("step_timeout_s = 'soon'\n")  # a bad reload keeps the running configuration
        proc.send_signal(signal.SIGHUP)
        wait_for(endpoint, proc, lambda s: s["settings"]["step_timeout_s"] == 42)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "format changed but needs a restart" in text
    assert "new configuration is invalid" in text


def test_sigterm_with_drain_finish_lets_the_step_in_flight_publish(tmp_path):
    """Rank 0 began step 0 when SIGTERM arrives: the daemon drains, refuses rank 1's new step 5, rank 1 completes
    step 0, it publishes on both ranks, and the daemon exits 0 with every segment unlinked."""
    proc, endpoint, _ = start(tmp_path, "--world-size", "2", "--drain", "finish", "--shutdown-timeout", "60")
    state = make_state_dict("qwen3_5_moe", seed=3, **MODEL)
    results: dict[int, object] = {}
    segments = json.loads((tmp_path / "run" / "segments.json").read_text())["segments"]

    def push(rank: int) -> None:
        with RefitClient(endpoint, rank, 2, timeout=90) as client:
            try:
                results[rank] = client.push_step(0, shard_for_rank(state, rank, 2))
            except RefitError as exc:
                results[rank] = exc

    first = threading.Thread(target=push, args=(0,))
    first.start()
    wait_for(endpoint, proc, lambda s: (s["step_in_progress"] or {}).get("begun") == [0])
    proc.send_signal(signal.SIGTERM)
    wait_for(endpoint, proc, lambda s: s["draining"])
    with RefitClient(endpoint, 1, 2, timeout=30) as other, pytest.raises(RefitError) as err:
        other.push_step(5, {"x": state[next(iter(state))]})
    assert err.value.kind is ErrorKind.SHUTDOWN
    push(1)
    first.join(timeout=90)
    assert proc.wait(timeout=60) == 0
    assert all(
        getattr(results[r], "step", None) == 0 and not isinstance(results[r], RefitError) for r in (0, 1)
    ), results
    assert not any(Path("/dev/shm", n).exists() for n in segments)


class _Requests:
    """The daemon's side of :class:`Signals`, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def request_stop(self) -> None:
        self.calls.append("stop")

    def request_reload(self, load) -> None:
        self.calls.append(f"reload:{load()}")


def test_signal_handlers_only_set_flags_and_the_loop_acts_on_them_once():
    """A handler runs wherever the loop happens to be, so it only sets a flag; the loop's poll turns
    each flag into one request. Two stop signals within DUPLICATE_SIGNAL_S are one (Slurm sends two);
    a later one escalates to force_exit, which reaches the daemon as a second stop request."""
    from sidecar.cli.serve import DUPLICATE_SIGNAL_S, Signals

    now = [100.0]
    signals = Signals(lambda: "new-config", clock=lambda: now[0])
    daemon = _Requests()
    signals.on_stop(signal.SIGTERM)
    assert (signals.should_exit, signals.force_exit) == (True, False) and daemon.calls == []
    signals.poll(daemon)
    signals.poll(daemon)
    assert daemon.calls == ["stop"]
    now[0] += DUPLICATE_SIGNAL_S / 2
    signals.on_stop(signal.SIGINT)  # the duplicate Slurm delivers with the first
    signals.poll(daemon)
    assert not signals.force_exit and daemon.calls == ["stop"]
    signals.on_reload(signal.SIGHUP)
    now[0] += DUPLICATE_SIGNAL_S
    signals.on_stop(signal.SIGTERM)
    assert signals.force_exit and daemon.calls == ["stop"]
    signals.poll(daemon)
    signals.poll(daemon)
    assert daemon.calls == ["stop", "reload:new-config", "stop"] and not signals.reload


_DUPLICATE_AFTER_THE_BLOCK = """
import os, select, signal
from sidecar.cli.serve import Signals

ran_r, ran_w = os.pipe()  # written by the SIGHUP sentinel's handler
signals = Signals()
with signals.installed(until_exit=sys.argv[1] == "keep"):
    signals.on_stop(signal.SIGTERM)  # the first: the daemon stops, the block ends
handler = signal.getsignal(signal.SIGTERM)
signal.signal(signal.SIGHUP, lambda *_: os.write(ran_w, b"h"))
os.kill(os.getpid(), signal.SIGTERM)  # Slurm's duplicate, a few milliseconds later
os.kill(os.getpid(), signal.SIGHUP)  # a sentinel: when select returns, both handlers have run
select.select([ran_r], [], [], 10)
print(handler == signal.SIG_IGN, signals.should_exit, signals.force_exit)
"""


@pytest.mark.parametrize("keep", ["keep", "restore"])
def test_the_duplicate_stop_signal_after_a_clean_stop_changes_nothing(keep):
    """``refitd serve`` ignores the stop signals once it stopped (``installed(until_exit=True)``):
    Slurm's second SIGTERM, arriving after an idle daemon already stopped cleanly (or while the
    interpreter shuts down), changes nothing and the exit status stays 0. Restoring the default
    handler (what a plain ``installed()`` does, for code that lives on) lets that signal kill the
    process: 143."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + _DUPLICATE_AFTER_THE_BLOCK, keep],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if keep == "keep":
        assert (out.returncode, out.stdout.split()) == (0, ["True", "True", "False"]), out.stderr
    else:
        assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr)


def test_a_second_stop_request_forces_the_daemon(tmp_path):
    """The production path to ``_force``: Signals' second request is the daemon's second
    ``request_stop``, which ends the drain at once."""
    from sidecar.cli.serve import DUPLICATE_SIGNAL_S, Signals
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.loop import Daemon

    now = [0.0]
    signals = Signals(clock=lambda: now[0])
    daemon = Daemon.__new__(Daemon)  # only the stop flags: no sockets, no arenas
    daemon._stop = daemon._force = False
    daemon.config = DaemonConfig(runtime_dir=tmp_path)
    signals.on_stop(signal.SIGTERM)
    signals.poll(daemon)
    assert daemon._stop and not daemon._force
    now[0] += DUPLICATE_SIGNAL_S * 2
    signals.on_stop(signal.SIGTERM)
    signals.poll(daemon)
    assert daemon._force


def test_a_second_sigterm_stops_a_draining_daemon_at_once(tmp_path):
    """drain=finish with a 60 s budget and a step that will never complete: the first SIGTERM starts
    the drain, a second one (after DUPLICATE_SIGNAL_S) ends it; the step fails with SHUTDOWN, every
    segment is unlinked and the exit status is 1 (not a clean drain)."""
    from sidecar.cli.serve import DUPLICATE_SIGNAL_S

    proc, endpoint, _ = start(tmp_path, "--world-size", "2", "--drain", "finish", "--shutdown-timeout", "60")
    state = make_state_dict("qwen3_5_moe", seed=3, **MODEL)
    segments = json.loads((tmp_path / "run" / "segments.json").read_text())["segments"]
    results: dict[int, object] = {}

    def push() -> None:
        with RefitClient(endpoint, 0, 2, timeout=90) as client:
            try:
                results[0] = client.push_step(0, shard_for_rank(state, 0, 2))
            except RefitError as exc:
                results[0] = exc

    first = threading.Thread(target=push)
    first.start()
    try:
        wait_for(endpoint, proc, lambda s: (s["step_in_progress"] or {}).get("begun") == [0])
        proc.send_signal(signal.SIGTERM)
        wait_for(endpoint, proc, lambda s: s["draining"])
        time.sleep(DUPLICATE_SIGNAL_S + 0.2)  # not waiting for an event: a sooner signal is the same request
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 1  # well inside the 60 s drain it would otherwise wait
    finally:
        if proc.poll() is None:
            proc.kill()
        first.join(timeout=90)
    assert isinstance(results[0], RefitError) and results[0].kind is ErrorKind.SHUTDOWN, results
    assert not any(Path("/dev/shm", n).exists() for n in segments)
