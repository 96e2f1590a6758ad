"""refitd under systemd: sd_notify, the SystemdNotifier observer, the unit file and its env file.

The end-to-end tests play systemd's part: a datagram socket bound in the test's temp dir is handed
to a real ``refitd serve`` as ``$NOTIFY_SOCKET``, and the test reads what the daemon tells it, with a
deadline on every wait (no sleeps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.config.settings import ENV_PREFIX, NON_SETTING_ENV, DaemonConfig
from sidecar.config.sources import load_config
from sidecar.errors import ErrorKind, RefitError
from sidecar.ops.systemd import SystemdNotifier, describe, sd_notify, watchdog_interval

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "refitd.service"
ENV_FILE = REPO / "systemd" / "refitd.env"
MODEL, MODEL_ARGS = "qwen3_5_moe", {"num_layers": 2, "num_experts": 8}
START_TIMEOUT_S = 120.0  # torch import and arena allocation on a slow CI box
APT_LINE = "apt-get update && apt-get install -y --no-install-recommends systemd"


# --------------------------------------------------------------------------------------------------
# a fake systemd notify socket


class NotifySocket:
    """The receiving end of ``$NOTIFY_SOCKET``; every datagram is kept, in order."""

    def __init__(self, address: str, bind_to: str | bytes):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.messages: list[str] = []

    def recv_until(
        self, match: Callable[[str], bool], timeout: float, what: str, log: Callable[[], str] = str
    ) -> str:
        """The first message (after those already seen) for which ``match`` holds, within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout} s; got {self.messages!r}\n{log()}")
            self.sock.settimeout(left)
            try:
                message = self.sock.recv(65536).decode()
            except TimeoutError:
                continue
            self.messages.append(message)
            if match(message):
                return message

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify"
    sock = NotifySocket(str(path), str(path))
    yield sock
    sock.close()


def fields(message: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in message.splitlines() if "=" in line)


# --------------------------------------------------------------------------------------------------
# sd_notify


def test_sd_notify_does_nothing_outside_systemd():
    """No ``$NOTIFY_SOCKET`` (or an empty one): nothing is sent, the call says so and never raises."""
    assert sd_notify("READY=1", env={}) is False
    assert sd_notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False


def test_sd_notify_sends_one_datagram_to_a_path(notify_socket):
    """Several lines go out as one datagram, byte for byte."""
    assert sd_notify("READY=1\nSTATUS=serving", env={"NOTIFY_SOCKET": notify_socket.address}) is True
    notify_socket.sock.settimeout(5)
    assert notify_socket.sock.recv(4096) == b"READY=1\nSTATUS=serving"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the abstract namespace is Linux-only")
def test_sd_notify_reaches_an_abstract_socket():
    """``@name`` is the abstract namespace (a leading NUL byte), as systemd spells it."""
    name = f"refitd-test-{secrets.token_hex(6)}"
    sock = NotifySocket(f"@{name}", b"\0" + name.encode())
    try:
        assert sd_notify("WATCHDOG=1", env={"NOTIFY_SOCKET": f"@{name}"}) is True
        sock.sock.settimeout(5)
        assert sock.sock.recv(4096) == b"WATCHDOG=1"
    finally:
        sock.close()


def test_sd_notify_survives_a_missing_or_odd_socket(tmp_path):
    """A socket that is gone, or a value that is neither a path nor ``@name``, gives False."""
    assert sd_notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False
    assert sd_notify("READY=1", env={"NOTIFY_SOCKET": "relative/notify"}) is False


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process_only():
    """Half of ``$WATCHDOG_USEC``; none when unset, invalid, zero, or meant for another pid."""
    assert watchdog_interval({}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}, pid=7) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "7"}, pid=7) == 0.1
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "x"}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}, pid=7) is None


# --------------------------------------------------------------------------------------------------
# the observer, on a stand-in daemon


def fake_daemon(world_size: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        last_step=None, step=None, engines={}, config=SimpleNamespace(world_size=world_size)
    )


def drain(sock: NotifySocket) -> list[str]:
    sock.sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.sock.recv(65536).decode())
        except BlockingIOError:
            sock.sock.setblocking(True)
            return out


def test_notifier_reports_ready_status_watchdog_and_stopping(notify_socket):
    """The observer's whole life on a stand-in daemon, with the clock given by the test: READY with a
    first STATUS; a WATCHDOG ping on the first tick and then every half period; a STATUS each time
    the line changes (a step begins, a rank commits, the step is published or fails); STOPPING once,
    and silence after it."""
    env = {"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "42"}
    notifier, daemon = SystemdNotifier(env, pid=42), fake_daemon()
    assert notifier.enabled and notifier.watchdog_s == 0.5

    notifier.on_ready(daemon)
    assert drain(notify_socket) == ["READY=1\nSTATUS=serving; no step published yet"]

    notifier.on_tick(daemon, 100.0)
    notifier.on_tick(daemon, 100.25)
    assert drain(notify_socket) == ["WATCHDOG=1"]
    notifier.on_tick(daemon, 100.5)
    assert drain(notify_socket) == ["WATCHDOG=1"]

    daemon.last_step = 12
    daemon.step = SimpleNamespace(step=13, committed={0})
    notifier.on_tick(daemon, 100.6)
    notifier.on_tick(daemon, 100.7)  # unchanged: no second STATUS
    assert drain(notify_socket) == [
        "STATUS=serving; last published step 12; step 13 in progress (1/4 ranks committed)"
    ]

    notifier.on_step_published(daemon, {"step": 13}, daemon.step)
    daemon.last_step = 13  # the hook runs before the daemon clears its step: it must not show
    notifier.on_tick(daemon, 100.8)
    daemon.step = None
    notifier.on_tick(daemon, 100.9)
    assert drain(notify_socket) == ["STATUS=serving; last published step 13"]

    daemon.step = SimpleNamespace(step=14, committed=set())
    notifier.on_step_failed(daemon, RefitError("rank 2 is silent", kind=ErrorKind.TIMEOUT, step=14))
    daemon.step = None
    notifier.on_tick(daemon, 100.95)
    assert drain(notify_socket) == ["STATUS=serving; last published step 13; step 14 failed (timeout)"]

    notifier.on_stopping(daemon)
    notifier.on_stopping(daemon)
    notifier.on_tick(daemon, 200.0)
    assert drain(notify_socket) == [
        "STOPPING=1\nSTATUS=stopping; last published step 13; step 14 failed (timeout)"
    ]


def test_notifier_without_watchdog_never_pings(notify_socket):
    """No ``$WATCHDOG_USEC`` (or one meant for another pid): READY and STATUS only."""
    for env in ({}, {"WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"}):
        notifier = SystemdNotifier({"NOTIFY_SOCKET": notify_socket.address, **env}, pid=42)
        assert notifier.watchdog_s is None
        notifier.on_ready(fake_daemon())
        for t in range(5):
            notifier.on_tick(fake_daemon(), float(t))
        assert [m.split("\n")[0] for m in drain(notify_socket)] == ["READY=1"]


def test_notifier_stops_feeding_the_watchdog_after_a_sticky_cuda_error(notify_socket):
    """Issue 34: a daemon whose GPU context is poisoned (``fatal`` set) sends no WATCHDOG=1, so a
    daemon wedged on the way out is restarted by systemd rather than kept alive."""
    env = {"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "42"}
    notifier, daemon = SystemdNotifier(env, pid=42), fake_daemon()
    daemon.fatal = None
    notifier.on_ready(daemon)
    notifier.on_tick(daemon, 100.0)
    assert drain(notify_socket)[-1] == "WATCHDOG=1"
    daemon.fatal = "sticky CUDA error: CudaError: cudaErrorIllegalAddress"
    for t in (101.0, 102.0, 103.0):
        notifier.on_tick(daemon, t)
    assert "WATCHDOG=1" not in drain(notify_socket)


def test_describe_counts_engines():
    daemon = fake_daemon()
    daemon.engines = {b"a": 1, b"b": 2}
    assert describe(daemon) == "serving; no step published yet; 2 engine workers attached"


def test_serve_watches_with_systemd_only_under_systemd(tmp_path, monkeypatch):
    """``refitd serve``'s observers include the notifier only when ``$NOTIFY_SOCKET`` is set."""
    from sidecar.cli.serve import make_observers

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(make_hf_config(MODEL, **MODEL_ARGS)))
    config = load_config(["--hf-config", str(config_json), "--runtime-dir", str(tmp_path / "run")], env={})
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not any(isinstance(o, SystemdNotifier) for o in make_observers(config))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    assert any(isinstance(o, SystemdNotifier) for o in make_observers(config))


# --------------------------------------------------------------------------------------------------
# a real `refitd serve`, told it runs under systemd


def serve_env(notify: str, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(ENV_PREFIX) and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    env.update(NOTIFY_SOCKET=notify, PYTHONUNBUFFERED="1", **extra)
    return env


def test_serve_notifies_ready_watchdog_status_and_stopping(tmp_path, notify_socket):
    """A real ``refitd serve`` with a 0.2 s watchdog: READY=1 (with a STATUS) once it listens,
    WATCHDOG=1 pings, a STATUS naming the step once a trainer rank published step 1, then after
    SIGTERM a STOPPING=1, a clean exit 0, and no ping after STOPPING."""
    from sidecar.cli.demo.synthetic import make_state_dict
    from sidecar.client.client import RefitClient

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(make_hf_config(MODEL, **MODEL_ARGS)))
    runtime = tmp_path / "run"
    log_path = tmp_path / "serve.log"
    argv = [
        sys.executable, "-m", "sidecar.cli", "serve",
        "--hf-config", str(config_json),
        "--runtime-dir", str(runtime),
        "--world-size", "1",
        "--heartbeat-interval", "0.2",
    ]  # fmt: skip
    env = serve_env(notify_socket.address, WATCHDOG_USEC="200000")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    def log() -> str:
        return log_path.read_text(errors="replace")[-6000:]

    try:
        ready = notify_socket.recv_until(
            lambda m: "READY=1" in m.splitlines(), START_TIMEOUT_S, "READY=1", log
        )
        assert fields(ready)["STATUS"] == "serving; no step published yet"
        assert (runtime / "control.sock").exists()  # READY means trainers can connect now
        for _ in range(2):
            notify_socket.recv_until(lambda m: m == "WATCHDOG=1", 10, "WATCHDOG=1", log)

        endpoint = f"ipc://{runtime / 'control.sock'}"
        with RefitClient(endpoint, rank=0, world_size=1, timeout=60) as client:
            client.push_step(1, make_state_dict(MODEL, seed=1, **MODEL_ARGS))
        notify_socket.recv_until(
            lambda m: fields(m).get("STATUS") == "serving; last published step 1", 10, "STATUS of step 1", log
        )

        proc.send_signal(signal.SIGTERM)
        stopping = notify_socket.recv_until(lambda m: "STOPPING=1" in m.splitlines(), 30, "STOPPING=1", log)
        assert fields(stopping)["STATUS"].startswith("stopping; ")
        assert proc.wait(30) == 0, log()
        after = notify_socket.messages[notify_socket.messages.index(stopping) + 1 :]
        assert drain(notify_socket) == [] and after == [], after
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_outside_systemd_sends_nothing(tmp_path, notify_socket):
    """Without ``$NOTIFY_SOCKET`` the daemon serves and stops as before and the socket hears nothing
    (the socket exists, so a stray send would arrive)."""
    from adapters.base import RefitReader

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(make_hf_config(MODEL, **MODEL_ARGS)))
    runtime, log_path = tmp_path / "run", tmp_path / "serve.log"
    env = serve_env("", WATCHDOG_USEC="200000")
    del env["NOTIFY_SOCKET"]
    argv = [
        sys.executable,
        "-m",
        "sidecar.cli.main",
        "serve",
        "--hf-config",
        str(config_json),
        "--runtime-dir",
        str(runtime),
    ]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        with RefitReader(f"ipc://{runtime / 'control.sock'}", name="readiness") as probe:
            while True:  # each try waits at most 0.5 s for an answer
                assert proc.poll() is None, log_path.read_text(errors="replace")
                try:
                    probe.status(timeout=0.5)
                    break
                except RefitError:
                    assert time.monotonic() < deadline, log_path.read_text(errors="replace")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text(errors="replace")
        assert drain(notify_socket) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------------------------------
# the unit file and the env file


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (comments skipped), every value of a repeated key."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_declares_notify_watchdog_restart_policy_and_runtime_dir():
    """What the daemon relies on: ``Type=notify`` from the main pid, a watchdog, no restart on a
    config error (78), a 0700 runtime dir that survives a crash (so segments.json can clean up)."""
    s = unit_settings(UNIT.read_text())
    expect = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/usr/local/bin/refitd serve",
        "EnvironmentFile": "-/etc/refitd/refitd.env",
        "RuntimeDirectory": "refitd",
        "RuntimeDirectoryMode": "0700",
        "RuntimeDirectoryPreserve": "yes",
        "Restart": "on-failure",
        "RestartPreventExitStatus": "78",
        "KillSignal": "SIGTERM",
        "LimitMEMLOCK": "infinity",
    }
    for key, value in expect.items():
        assert s.get(key) == [value], (key, s.get(key))
    assert "WatchdogSec" in s and "TimeoutStopSec" in s


def test_unit_gives_every_jit_cache_a_writable_directory():
    """``ProtectHome=read-only`` makes the home caches read-only: Triton's kernels, the CUDA PTX
    cache and the native CPU quantizers (sidecar.numerics.native, built at start-up) each get a
    directory under the unit's ``CacheDirectory=`` (%C/refitd), or the CPU path would fall back to
    the slower torch quantizers."""
    s = unit_settings(UNIT.read_text())
    assert s.get("ProtectHome") == ["read-only"] and s.get("CacheDirectory") == ["refitd"]
    env = dict(item.split("=", 1) for line in s.get("Environment", []) for item in line.split())
    for var in ("TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "REFITD_NATIVE_DIR"):
        assert env.get(var, "").startswith("%C/refitd/"), (var, env.get(var))


@pytest.mark.parametrize(
    "option",
    [
        "PrivateDevices",  # hides /dev/nvidia*, and gives a private /dev/shm
        "ProtectClock",  # implies DeviceAllow=, a device allow-list without the GPUs
        "DeviceAllow",
        "DevicePolicy",
        "PrivateTmp",
        "PrivateIPC",
        "PrivateNetwork",
        "PrivateUsers",
        "RemoveIPC",  # deletes the account's /dev/shm segments on stop
        "DynamicUser",  # implies RemoveIPC
        "MemoryDenyWriteExecute",  # torch/Triton JIT
        "ProcSubset",
        "TemporaryFileSystem",
        "InaccessiblePaths",
    ],
)
def test_unit_keeps_gpus_shm_and_sockets_reachable(option):
    """None of the options that would hide GPU device nodes, /dev/shm or the sockets is set."""
    assert option not in unit_settings(UNIT.read_text())


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip(f"systemd-analyze is not installed; on Debian/Ubuntu: {APT_LINE}")
    return path


def verify(unit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [systemd_analyze(), "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )


def test_unit_passes_systemd_analyze_verify(tmp_path):
    """``systemd-analyze verify`` accepts the unit with no warning at all (an unknown key or a bad
    value is only a warning to it). verify also insists that ExecStart's binary exists, so the copy
    checked points it at this checkout's ``refitd``; the file as shipped may differ only in that."""
    refitd = Path(sys.executable).with_name("refitd")
    binary = str(refitd) if os.access(refitd, os.X_OK) else sys.executable
    text = UNIT.read_text()
    copy = tmp_path / "refitd.service"
    copy.write_text(text.replace("ExecStart=/usr/local/bin/refitd ", f"ExecStart={binary} "))
    assert copy.read_text() != text
    run = verify(copy)
    assert run.returncode == 0 and not (run.stdout + run.stderr).strip(), run.stdout + run.stderr

    shipped = verify(UNIT)
    complaints = [line for line in (shipped.stdout + shipped.stderr).splitlines() if line.strip()]
    if os.access("/usr/local/bin/refitd", os.X_OK):
        assert shipped.returncode == 0 and not complaints, complaints
    else:
        assert all("/usr/local/bin/refitd is not executable" in line for line in complaints), complaints


def env_file_settings() -> tuple[dict[str, str], dict[str, str]]:
    """(active, commented-out) ``REFITD_*=value`` lines of the example env file."""
    active, commented = {}, {}
    for line in ENV_FILE.read_text().splitlines():
        m = re.fullmatch(r"(#?)(REFITD_[A-Z0-9_]+)=(.*)", line.strip())
        if m:
            (commented if m.group(1) else active)[m.group(2)] = m.group(3)
    return active, commented


def test_env_file_names_only_real_settings(tmp_path):
    """Every variable in the example env file, commented or not, is one refitd knows (an unknown
    REFITD_* variable is a config error, exit 78); its active lines make a valid config once
    REFITD_HF_CONFIG points at a real config.json."""
    active, commented = env_file_settings()
    known = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(DaemonConfig)} | set(NON_SETTING_ENV)
    assert active and not (set(active) | set(commented)) - known, (set(active) | set(commented)) - known
    assert "REFITD_RUNTIME_DIR" not in active  # systemd's $RUNTIME_DIRECTORY must win

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(make_hf_config(MODEL, **MODEL_ARGS)))
    env = {**active, "REFITD_HF_CONFIG": str(config_json), "RUNTIME_DIRECTORY": str(tmp_path / "run")}
    config = load_config([], env=env)
    assert config.runtime_dir == tmp_path / "run"
