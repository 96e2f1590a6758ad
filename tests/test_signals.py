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
