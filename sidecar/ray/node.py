"""The per-node supervisor: a Ray actor that runs one ``refitd serve`` (behind
:mod:`sidecar.ray_keeper`), says when it is ready, restarts it when it dies, and stops it."""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from sidecar.config.settings import (
    EXIT_CONFIG,
    DaemonConfig,
    NodeLayout,
    NodeRole,
    default_listen,
    prepare_runtime_dir,
)
from sidecar.daemon.segments import remove_stale_segments
from sidecar.ray.settings import (
    RayDaemonError,
    daemon_env,
    node_config,
    to_toml,
)
from sidecar.ray_keeper import die_with_parent

log = logging.getLogger("refitd.ray")

#: How often a starting daemon is asked ``refitd status``, and how long each ask may take.
PROBE_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 1.0
#: Restart backoff: doubles from the first value up to the second.
RESTART_BACKOFF_S = (0.5, 10.0)
STDERR_TAIL_LINES = 40


class DaemonState(str, enum.Enum):
    STARTING = "starting"  # the child runs, ``refitd status`` has not answered yet
    READY = "ready"  # answered; trainers and engines may connect
    RESTARTING = "restarting"  # the child exited; another starts after the backoff
    FAILED = "failed"  # will not be restarted (configuration error, too many restarts)
    STOPPED = "stopped"  # stopped on request


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sweep_runtime_base(base: Path) -> list[str]:
    """Unlink the segments of every dead daemon under ``base`` (``ray-*/segments.json``). A daemon
    whose actor's process was killed outright (a node's raylet dying: Ray SIGKILLs the children
    of a worker that exits, ``RAY_kill_child_processes_on_worker_exit``) cannot clean up after
    itself; the next supervisor started on that machine does. Returns the names removed."""
    removed: list[str] = []
    with contextlib.suppress(OSError):
        for child in Path(base).glob("ray-*"):
            removed += remove_stale_segments(child)
    return removed


class NodeDaemon:
    """Runs and supervises one ``refitd serve`` on this Ray node (use through :class:`RayDaemons`).

    A thread owns the child: it starts it (behind a :mod:`sidecar.ray_keeper`), probes ``refitd
    status`` until it answers, waits for it to exit and, unless asked to stop, restarts it after a
    backoff. The thread starts each keeper itself, so the keeper's ``PR_SET_PDEATHSIG`` fires when
    this actor's process dies, and the daemon's when the keeper does."""

    def __init__(
        self,
        base: dict[str, Any],
        *,
        group: str,
        node_id: str,
        layout: str,
        role: str | None,
        peers: Sequence[str] = (),
        max_restarts: int = 5,
        restart_window_s: float = 300.0,
    ) -> None:
        from sidecar.ops.logs import setup_logging

        self.base = DaemonConfig(**base)
        setup_logging(self.base.log_format.value, self.base.log_level.level)
        self.group, self.node_id = group, node_id
        self.layout = NodeLayout(layout)
        self.role = NodeRole(role) if role else None
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.ip = ray.util.get_node_ip_address()
        self.tcp: str | None = None
        if self.role is NodeRole.INFERENCE:
            self.tcp = f"tcp://{self.ip}:{self._port()}"
        self._lock = threading.Condition()
        self._state = DaemonState.STARTING
        self._error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._instance: str | None = None
        self._pid: int | None = None  # the daemon's own pid (its status says), not the keeper's
        self._restarts: list[float] = []  # when, within the last restart_window_s
        self._restart_total = 0
        self._exits: list[int] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._stop = threading.Event()
        self._restart_now = threading.Event()
        self.config = self._make_config(peers)
        prepare_runtime_dir(self.base.runtime_dir)  # the parent: 0700, ours
        swept = sweep_runtime_base(self.base.runtime_dir)
        if swept:
            log.warning("removed %d shared-memory segments left by dead daemons: %s", len(swept), swept)
        self._thread = threading.Thread(
            target=self._supervise, name=f"refitd-supervisor-{group}", daemon=True
        )
        self._thread.start()

    def _port(self) -> int:
        from sidecar.config.settings import split_host_port, tcp_host

        if self.base.listen and tcp_host(self.base.listen) is not None:
            return split_host_port(self.base.listen.partition("://")[2])[1]  # a fixed port, every node
        return _free_port(self.ip)

    def _make_config(self, peers: Sequence[str]) -> DaemonConfig:
        return node_config(
            self.base,
            group=self.group,
            node_id=self.node_id,
            layout=self.layout,
            role=self.role,
            listen=self.tcp,
            peers=peers,
        )

    # -- what the driver and clients ask -----------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Where and how this node's daemon is: ``endpoint`` (ipc://, for this node's processes),
        ``tcp`` (inference nodes: for trainer daemons), ``pid``, ``state``, ``restarts``, ``exits``."""
        with self._lock:
            proc = self._proc
            return {
                "node_id": self.node_id,
                "ip": self.ip,
                "group": self.group,
                "role": self.role.value if self.role else None,
                "endpoint": default_listen(self.config.runtime_dir),
                "tcp": self.tcp,
                "peers": list(self.config.peers),
                "runtime_dir": str(self.config.runtime_dir),
                "pid": self._pid if proc is not None and proc.poll() is None else None,
                "instance": self._instance,
                "state": self._state.value,
                "restarts": self._restart_total,
                "exits": list(self._exits),
                "error": self._error,
            }

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the daemon answers ``refitd status`` (its own readiness signal); its
        :meth:`info`. Raises :class:`RayDaemonError` if it failed for good or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._state is not DaemonState.READY:
                if self._state in (DaemonState.FAILED, DaemonState.STOPPED):
                    raise RayDaemonError(self._why())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RayDaemonError(
                        f"refitd on node {self.node_id} ({self.ip}) was not ready within {timeout:g} s "
                        f"(state {self._state.value}); {self._why()}"
                    )
                self._lock.wait(min(left, 1.0))
        return self.info()

    def reconfigure(self, peers: Sequence[str]) -> dict[str, Any]:
        """Restart the daemon with new peers (a trainer node when inference nodes came or went):
        peers need a restart (they are not reloadable). Returns :meth:`info` at once."""
        with self._lock:
            self.config = self._make_config(peers)
            self._state = DaemonState.STARTING
            self._lock.notify_all()
        self._restart_now.set()
        self._terminate(self._proc, self._pid)
        return self.info()

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """SIGTERM the daemon (it fails the step in flight and unlinks its segments), SIGKILL it
        after ``timeout``; remove its runtime directory. Idempotent. Returns :meth:`info`."""
        self._stop.set()
        self._terminate(self._proc, self._pid, timeout)
        self._thread.join(timeout=timeout)
        remove_stale_segments(self.config.runtime_dir)
        shutil.rmtree(self.config.runtime_dir, ignore_errors=True)
        with self._lock:
            self._state = DaemonState.STOPPED if self._state is not DaemonState.FAILED else self._state
            self._lock.notify_all()
        return self.info()

    def __ray_shutdown__(self) -> None:  # Ray calls it when the actor is ended gracefully
        self.stop()

    # -- the supervisor thread -----------------------------------------------------------------

    def _why(self) -> str:
        tail = "\n".join(list(self._tail)[-10:])
        error = self._error or "no error recorded"
        return f"{error}" + (f"; its last output:\n{tail}" if tail else "")

    def _spawn(self) -> subprocess.Popen:
        prepare_runtime_dir(self.config.runtime_dir)
        config_file = Path(self.config.runtime_dir) / "refitd.toml"
        config_file.write_text(to_toml(self.config))
        cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config_file)]
        keeper = [sys.executable, "-m", "sidecar.ray_keeper", str(os.getpid()), "--"]
        proc = subprocess.Popen(
            [*keeper, *cmd],
            env=daemon_env(os.environ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._pump, args=(proc,), name="refitd-stderr", daemon=True).start()
        log.info("started refitd (keeper pid %s) on node %s: %s", proc.pid, self.node_id, " ".join(cmd))
        return proc

    def _pump(self, proc: subprocess.Popen) -> None:
        """The daemon's stderr: into Ray's worker log, and the last lines kept for error messages."""
        stream = proc.stderr
        if stream is None:  # pragma: no cover - always a pipe
            return
        for line in stream:
            line = line.rstrip("\n")
            self._tail.append(line)
            print(line, file=sys.stderr, flush=True)

    def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while not self._stop.is_set():
            self._restart_now.clear()
            try:
                proc = self._spawn()
            except Exception as exc:  # a runtime dir or a config that cannot be written
                self._fail(f"cannot start refitd on node {self.node_id}: {exc}")
                return
            with self._lock:
                self._proc, self._instance, self._pid = proc, None, None
            if self._probe(proc):
                backoff = RESTART_BACKOFF_S[0]
            code = proc.wait()
            if self._stop.is_set():
                return
            removed = remove_stale_segments(self.config.runtime_dir)
            with self._lock:
                self._exits.append(code)
                if self._restart_now.is_set():
                    self._state = DaemonState.STARTING  # a reconfiguration: no backoff, not a failure
                    continue
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < self.restart_window_s] + [now]
            log.warning(
                "refitd on node %s exited with status %s (removed %d stale segments)",
                self.node_id,
                code,
                len(removed),
            )
            if code == EXIT_CONFIG:
                self._fail(f"refitd on node {self.node_id} refused its configuration (exit {code}): fix it")
                return
            if len(self._restarts) > self.max_restarts:
                self._fail(
                    f"refitd on node {self.node_id} exited {len(self._restarts)} times within "
                    f"{self.restart_window_s:g} s (last status {code}); not restarting it again"
                )
                return
            with self._lock:
                self._restart_total += 1
                self._state = DaemonState.RESTARTING
                self._lock.notify_all()
            log.warning("restarting refitd on node %s in %g s", self.node_id, backoff)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    def _probe(self, proc: subprocess.Popen) -> bool:
        """Ask ``refitd status`` until it answers (READY) or the child exits; True when ready."""
        from sidecar.cli.serve import query_status
        from sidecar.errors import RefitError

        endpoint = default_listen(self.config.runtime_dir)
        while proc.poll() is None and not self._stop.is_set():
            try:
                status = query_status(endpoint, timeout=PROBE_TIMEOUT_S)
            except RefitError:
                self._stop.wait(PROBE_INTERVAL_S)
                continue
            with self._lock:
                if self._proc is proc:
                    self._instance = str(status.get("instance"))
                    self._pid = int(status.get("pid", 0)) or None
                    self._state, self._error = DaemonState.READY, None
                    self._lock.notify_all()
            log.info("refitd pid %s on node %s is ready at %s", proc.pid, self.node_id, endpoint)
            return True
        return False

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        with self._lock:
            self._state, self._error = DaemonState.FAILED, message
            self._lock.notify_all()

    @staticmethod
    def _terminate(proc: subprocess.Popen | None, pid: int | None, timeout: float = 30.0) -> None:
        """SIGTERM to the keeper (it passes it on); SIGKILL to the daemon and keeper after ``timeout``."""
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("refitd pid %s ignored SIGTERM for %g s: killing it", pid or proc.pid, timeout)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=timeout)
