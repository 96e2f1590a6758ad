"""Under Ray: one ``refitd serve`` per Ray node, for as long as the Ray job (or longer, detached).

NeMo-RL, verl, OpenRLHF and slime place their trainers and engines with Ray. :class:`RayDaemons`
starts one supervisor actor per alive node, pinned there (``NodeAffinitySchedulingStrategy``,
``soft=False``), named ``refitd:<group>:<node_id>`` in the ``refitd`` namespace. The actor runs the
real daemon (``python -m sidecar.cli serve --config FILE``) through a small keeper process
(:mod:`sidecar.ray_keeper`) and restarts it when it dies; any actor or task finds the daemon of its own node with :func:`refitd_endpoint`::

    from sidecar.ray import RayDaemons, ray_config, refitd_endpoint

    config = ray_config(["--hf-config", "/models/m/config.json", "--world-size", "8"])
    with RayDaemons(config) as daemons:      # one daemon per node, every one ready
        daemons.watch(interval_s=10)         # nodes that join later get one too
        ...                                  # inside an actor: RefitClient(refitd_endpoint(), ...)

Settings are the ``refitd serve`` config object (:func:`ray_config`: ``--config`` / ``REFITD_CONFIG``
file, ``REFITD_*`` variables, flags), read once on the driver and written to every node as a TOML
file, so a Ray job and a Slurm job read the same settings. Per node, Ray owns three of them:
``runtime_dir`` becomes ``<runtime_dir>/ray-<group>-<node_id[:12]>`` (several emulated nodes on one
host, or two jobs on one node, never share one), ``listen`` its ``ipc://…/control.sock``, and in the
disaggregated layout ``role`` and ``peers``: nodes offering the Ray resource (or label)
``refitd_inference`` run ``role = "inference"`` daemons listening on ``tcp://<node ip>:<port>``, every
other node a ``role = "trainer"`` daemon forwarding to all of them. CURVE keys come from the config
as usual (one keypair for every node works: give ``curve_secret_key``, ``curve_allowed_keys`` and
``curve_server_key``).

Lifetime: job-scoped by default (Ray kills the actors when the driver's job ends; each daemon gets
SIGTERM through ``PR_SET_PDEATHSIG`` when its actor dies, and unlinks its segments: the keeper
between them takes the SIGKILL Ray gives a dead worker's children); ``detached=True``
keeps them until :meth:`RayDaemons.close` or :func:`stop_detached`. A daemon that exits is
restarted in the same runtime directory (same endpoint; the new daemon unlinks the segments its
predecessor left), unless it exited with a configuration error (78) or restarted more than
``max_restarts`` times within ``restart_window_s``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - exercised where ray is absent
    raise ImportError(
        f"sidecar.ray needs Ray ({exc}): install refitd's ray extra, `pip install 'refitd[ray]'`"
    ) from exc

from sidecar.config import (
    CONFIG_ENV,
    ENV_PREFIX,
    EXIT_CONFIG,
    DaemonConfig,
    NodeLayout,
    NodeRole,
    default_listen,
    load_config,
    prepare_runtime_dir,
)
from sidecar.ray_keeper import die_with_parent

log = logging.getLogger("refitd.ray")

#: Ray namespace of the supervisor actors: named actors are found across jobs only within one.
NAMESPACE = "refitd"
DEFAULT_GROUP = "default"
#: A node offering this Ray custom resource (``ray start --resources '{"refitd_inference": 1}'``)
#: or carrying this label (``ray start --labels refitd_inference=1``) is an inference node.
INFERENCE_RESOURCE = "refitd_inference"
#: How often a starting daemon is asked ``refitd status``, and how long each ask may take.
PROBE_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 1.0
#: Restart backoff: doubles from the first value up to the second.
RESTART_BACKOFF_S = (0.5, 10.0)
STDERR_TAIL_LINES = 40
#: The bounds of :meth:`RayDaemons.watch`'s interval: often enough to matter, rarely enough to be cheap.
WATCH_INTERVAL_BOUNDS_S = (0.5, 3600.0)


class RayDaemonError(RuntimeError):
    """A daemon under Ray could not be placed, did not become ready, or is not there to be found.
    The message names the node(s) and what to do. (Plain ``RuntimeError``: it crosses Ray intact.)"""


class DaemonState(str, enum.Enum):
    STARTING = "starting"  # the child runs, ``refitd status`` has not answered yet
    READY = "ready"  # answered; trainers and engines may connect
    RESTARTING = "restarting"  # the child exited; another starts after the backoff
    FAILED = "failed"  # will not be restarted (configuration error, too many restarts)
    STOPPED = "stopped"  # stopped on request


# --------------------------------------------------------------------------------------------------
# configuration: the ``refitd serve`` object, made per node


def ray_config(
    argv: Sequence[str] = (), *, env: Mapping[str, str] | None = None, file: Path | None = None
) -> DaemonConfig:
    """The ``refitd serve`` settings for every node, read here on the driver: ``argv`` are
    ``refitd serve`` flags, ``env`` (default ``os.environ``) the ``REFITD_*`` variables and
    ``REFITD_CONFIG``, ``file`` the config file when neither ``--config`` nor ``REFITD_CONFIG``
    names one. Raises :class:`sidecar.config.ConfigError` listing every problem."""
    return load_config(list(argv), env=env, file=file)


def actor_name(group: str, node_id: str) -> str:
    return f"refitd:{group}:{node_id}"


def node_runtime_dir(config: DaemonConfig, group: str, node_id: str) -> Path:
    """This node's runtime directory: one per group and node, inside the configured one."""
    return Path(config.runtime_dir) / f"ray-{group}-{node_id[:12]}"


def node_config(
    config: DaemonConfig,
    *,
    group: str,
    node_id: str,
    layout: NodeLayout,
    role: NodeRole | None = None,
    listen: str | None = None,
    peers: Sequence[str] = (),
) -> DaemonConfig:
    """``config`` as one node's daemon runs it: its own runtime directory and control socket, and
    in the disaggregated layout its role, ``tcp://`` listen address (inference) or peers (trainer).
    Validated again: a bad combination raises ``ConfigError`` naming it."""
    runtime = node_runtime_dir(config, group, node_id)
    return config.replace(
        runtime_dir=runtime,
        listen=listen or default_listen(runtime),
        layout=layout,
        role=role,
        peers=tuple(peers),
    )


def to_toml(config: DaemonConfig) -> str:
    """``config`` as a TOML file ``refitd serve --config`` reads back into an equal object: every
    setting given, paths absolute, unset (None) ones left out."""
    lines = ["# written by sidecar.ray for one node's refitd; every setting is given here"]
    for key, value in config.to_dict().items():
        if value is None:
            continue
        if isinstance(value, str) and key in _PATH_KEYS:
            value = os.path.abspath(value)
        lines.append(f"{key} = {json.dumps(value)}")  # JSON strings, numbers and arrays are TOML
    return "\n".join(lines) + "\n"


_PATH_KEYS = frozenset(
    {
        "runtime_dir",
        "hf_config",
        "timeline_dir",
        "curve_secret_key",
        "curve_public_key",
        "curve_allowed_keys",
        "curve_server_key",
    }
)


def absolute_paths(config: DaemonConfig) -> DaemonConfig:
    """``config`` with every path setting made absolute against this process's working directory
    (the driver's): a relative path would otherwise be read against each actor's own."""
    changes = {
        key: Path(os.path.abspath(value))
        for key in _PATH_KEYS
        if (value := getattr(config, key)) is not None and not Path(value).is_absolute()
    }
    return config.replace(**changes) if changes else config


def daemon_env(env: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: the actor's, less every ``REFITD_*`` variable (the config file
    written from the driver's settings is the one source) and systemd's notify/watchdog variables."""
    drop = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", CONFIG_ENV}
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX) and k not in drop}


# --------------------------------------------------------------------------------------------------
# the per-node supervisor (a Ray actor)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(runtime_dir: Path) -> list[str]:
    """Unlink the ``/dev/shm`` segments a dead daemon listed in ``<runtime_dir>/segments.json``
    (the daemon writes it at start); a live owner's are left alone. Returns the names removed."""
    path = Path(runtime_dir) / "segments.json"
    try:
        record = json.loads(path.read_text())
        pid, names = int(record.get("pid", 0)), [str(n) for n in record.get("segments", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    if _pid_alive(pid):
        return []
    removed = []
    for name in names:
        segment = Path("/dev/shm", name)
        if segment.exists():
            segment.unlink(missing_ok=True)
            removed.append(name)
    return removed


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
        from sidecar.logs import setup_logging

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
        prepare_runtime_dir(self.base)  # the parent: 0700, ours
        swept = sweep_runtime_base(self.base.runtime_dir)
        if swept:
            log.warning("removed %d shared-memory segments left by dead daemons: %s", len(swept), swept)
        self._thread = threading.Thread(
            target=self._supervise, name=f"refitd-supervisor-{group}", daemon=True
        )
        self._thread.start()

    def _port(self) -> int:
        from sidecar.config import split_host_port, tcp_host

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
        prepare_runtime_dir(self.config)
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
        from sidecar.errors import RefitError
        from sidecar.serve_cli import query_status

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


# --------------------------------------------------------------------------------------------------
# the driver side


def is_inference_node(node: Mapping[str, Any], marker: str = INFERENCE_RESOURCE) -> bool:
    """A ``ray.nodes()`` entry offering the Ray resource ``marker``, or carrying it as a label."""
    return float(node.get("Resources", {}).get(marker, 0)) > 0 or marker in node.get("Labels", {})


def placement_group_nodes(groups: Sequence[Any]) -> set[str]:
    """The node ids holding the bundles of these (created) placement groups: the nodes an RL
    framework gave its inference workers (NeMo-RL's generation ``RayVirtualCluster``, verl's
    rollout ``RayResourcePool``). Waits up to 60 s for each group to be placed."""
    nodes: set[str] = set()
    for pg in groups:
        if not pg.wait(timeout_seconds=60):
            raise RayDaemonError(f"placement group {pg.id.hex()} was not placed within 60 s: nothing to map")
        nodes.update(ray.util.placement_group_table(pg)["bundles_to_node_id"].values())
    return nodes


class RayDaemons:
    """One refitd per alive Ray node, from ``config`` (:func:`ray_config`); call from a driver
    connected to Ray (``ray.init``). ``layout``: ``colocated`` (every node serves its own trainers
    and engines) or ``disaggregated`` (nodes marked ``inference_marker`` are inference nodes, the
    rest trainer nodes forwarding to them; or, with ``inference_groups``, the nodes holding those
    placement groups' bundles). ``group`` names the set (several may coexist);
    ``detached`` keeps the daemons after this job ends (:func:`stop_detached` ends them).

    ``start()`` (or ``with``) places the daemons and waits until every one answers; ``reconcile()``
    gives nodes that joined since a daemon (``watch()`` does it in the background); ``close()``
    stops them all. ``endpoints()``: node id -> the node daemon's :meth:`NodeDaemon.info`.
    """

    def __init__(
        self,
        config: DaemonConfig | None = None,
        *,
        layout: NodeLayout | str = NodeLayout.COLOCATED,
        group: str = DEFAULT_GROUP,
        detached: bool = False,
        inference_marker: str = INFERENCE_RESOURCE,
        inference_groups: Sequence[Any] = (),
        ready_timeout_s: float = 120.0,
        max_restarts: int = 5,
        restart_window_s: float = 300.0,
    ) -> None:
        if not ray.is_initialized():
            raise RayDaemonError("RayDaemons needs a Ray connection: call ray.init(...) first")
        if not group or any(c in group for c in ":/ "):
            raise ValueError(f"group {group!r}: give a non-empty name without ':', '/' or spaces")
        if not (ready_timeout_s > 0):
            raise ValueError(f"ready_timeout_s = {ready_timeout_s}: give a positive number of seconds")
        self.config = absolute_paths(config if config is not None else ray_config())
        self.layout = NodeLayout(layout)
        if self.config.role is not None or self.config.peers:
            raise ValueError(
                "under Ray the role and peers of each node come from Ray placement: leave role and peers "
                f"unset and pass layout='disaggregated' (inference nodes offer {inference_marker!r})"
            )
        self.group, self.detached, self.marker = group, detached, inference_marker
        self.inference_groups = list(inference_groups)
        self.ready_timeout_s = ready_timeout_s
        self.restart = {"max_restarts": max_restarts, "restart_window_s": restart_window_s}
        self.actors: dict[str, Any] = {}
        self.roles: dict[str, NodeRole | None] = {}
        self.inference_tcp: dict[str, str] = {}
        self.peers: list[str] = []  # what the trainer daemons forward to now
        self.timings: dict[str, float] = {}
        self._watch: threading.Thread | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> RayDaemons:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> RayDaemons:
        """Place a daemon on every alive node and wait until each is ready (``timings`` says how
        long placement and readiness took)."""
        t0 = time.monotonic()
        self.reconcile(wait=False)
        self.timings["place_s"] = time.monotonic() - t0
        self.wait_ready()
        self.timings["ready_s"] = time.monotonic() - t0
        return self

    def _alive_nodes(self) -> list[dict[str, Any]]:
        return [n for n in ray.nodes() if n.get("Alive")]

    def _spawn(self, node_id: str, role: NodeRole | None, peers: Sequence[str]) -> Any:
        options: dict[str, Any] = dict(
            name=actor_name(self.group, node_id),
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=16,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        if self.detached:
            options.update(lifetime="detached", get_if_exists=True)
        actor = (
            ray.remote(NodeDaemon)
            .options(**options)
            .remote(
                self.config.to_dict(),
                group=self.group,
                node_id=node_id,
                layout=self.layout.value,
                role=role.value if role else None,
                peers=list(peers),
                **self.restart,
            )
        )
        self.actors[node_id], self.roles[node_id] = actor, role
        return actor

    def reconcile(self, *, wait: bool = True) -> list[str]:
        """Match the daemons to the alive nodes: start one on each node that has none, forget those
        whose node is gone; in the disaggregated layout, restart the trainer daemons with the new
        peers when inference nodes came or went. Returns the node ids that got a daemon."""
        with self._lock:
            nodes = self._alive_nodes()
            alive = {n["NodeID"] for n in nodes}
            for gone in [n for n in self.actors if n not in alive]:
                log.warning("Ray node %s is gone; forgetting its refitd", gone)
                self.actors.pop(gone)
                self.roles.pop(gone, None)
                self.inference_tcp.pop(gone, None)
            new = [n for n in nodes if n["NodeID"] not in self.actors]
            if self.layout is NodeLayout.COLOCATED:
                for n in new:
                    self._spawn(n["NodeID"], None, ())
            else:
                self._reconcile_disaggregated(nodes, new)
            started = [n["NodeID"] for n in new]
        if wait and started:
            self.wait_ready(started)
        if started:
            log.info("refitd placed on %d new node(s): %s", len(started), ", ".join(started))
        return started

    def _reconcile_disaggregated(self, nodes: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
        if self.inference_groups:
            held = placement_group_nodes(self.inference_groups)
            inference = [n["NodeID"] for n in nodes if n["NodeID"] in held]
        else:
            inference = [n["NodeID"] for n in nodes if is_inference_node(n, self.marker)]
        if not inference:
            raise RayDaemonError(
                f"layout 'disaggregated' but no alive Ray node offers {self.marker!r} or holds the inference "
                f"placement groups: start the inference nodes with `ray start --resources "
                f"'{{\"{self.marker}\": 1}}'` (or that label), or pass inference_groups"
            )
        for n in new:
            if n["NodeID"] in inference:
                self._spawn(n["NodeID"], NodeRole.INFERENCE, ())
        fresh = [n["NodeID"] for n in new if n["NodeID"] in inference]
        infos = self._ready(fresh) if fresh else {}
        for node_id, info in infos.items():
            self.inference_tcp[node_id] = info["tcp"]
        peers = [self.inference_tcp[n] for n in sorted(self.inference_tcp)]
        if peers != self.peers:
            trainers = [n for n, role in self.roles.items() if role is NodeRole.TRAINER]
            if trainers:
                log.warning("inference nodes changed: restarting the trainer daemons on %s", trainers)
                ray.get([self.actors[n].reconfigure.remote(peers) for n in trainers], timeout=120)
            self.peers = peers
        for n in new:
            if n["NodeID"] not in inference:
                self._spawn(n["NodeID"], NodeRole.TRAINER, peers)

    def _ready(self, node_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        timeout = self.ready_timeout_s
        refs = {n: self.actors[n].wait_ready.remote(timeout) for n in node_ids}
        out, problems = {}, []
        for node_id, ref in refs.items():
            try:
                out[node_id] = ray.get(ref, timeout=timeout + 30)
            except Exception as exc:  # a RayDaemonError from the actor, or the actor's death
                cause = getattr(exc, "cause", None) or exc
                problems.append(f"node {node_id}: {cause}")
        if problems:
            raise RayDaemonError(
                f"{len(problems)} of {len(refs)} refitd daemon(s) not ready:\n" + "\n".join(problems)
            )
        return out

    def wait_ready(self, node_ids: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """Wait until the daemons of ``node_ids`` (default: all) answer; node id -> info. Raises
        :class:`RayDaemonError` naming every node that failed or timed out."""
        return self._ready(list(self.actors) if node_ids is None else list(node_ids))

    def endpoints(self) -> dict[str, dict[str, Any]]:
        """Node id -> its daemon's :meth:`NodeDaemon.info` (without waiting for readiness)."""
        with self._lock:
            actors = dict(self.actors)
        infos = ray.get([a.info.remote() for a in actors.values()], timeout=60)
        return dict(zip(actors, infos))

    def watch(self, interval_s: float = 10.0) -> None:
        """Reconcile every ``interval_s`` seconds in a background thread, until :meth:`close`."""
        low, high = WATCH_INTERVAL_BOUNDS_S
        if not (low <= interval_s <= high):
            raise ValueError(f"interval_s = {interval_s}: give between {low:g} and {high:g} seconds")
        if self._watch is not None:
            return

        def loop() -> None:
            while not self._closing.wait(interval_s):
                try:
                    self.reconcile()
                except Exception:  # logged and retried next interval: a node may be mid-join
                    log.exception("refitd reconcile failed; retrying in %g s", interval_s)

        self._watch = threading.Thread(target=loop, name="refitd-ray-watch", daemon=True)
        self._watch.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL after ``timeout``) and end the actors. Idempotent."""
        self._closing.set()
        if self._watch is not None:
            self._watch.join(timeout=timeout)
        with self._lock:
            actors, self.actors = dict(self.actors), {}
            self.roles.clear()
            self.inference_tcp.clear()
            self.peers = []
        _stop_actors(actors, timeout)


def _stop_actors(actors: Mapping[str, Any], timeout: float) -> None:
    refs = {n: a.stop.remote(timeout) for n, a in actors.items()}
    for node_id, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout + 30)
        except Exception as exc:  # its node may be gone already: nothing left to stop there
            log.warning("stopping refitd on node %s: %s", node_id, exc)
    for actor in actors.values():
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


def stop_detached(group: str = DEFAULT_GROUP, timeout: float = 30.0) -> list[str]:
    """Stop the detached daemons of ``group`` (from any job); the node ids whose daemon was stopped."""
    prefix = f"refitd:{group}:"
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry.get("name", "").startswith(prefix):
            found[entry["name"][len(prefix) :]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
    _stop_actors(found, timeout)
    return sorted(found)


# --------------------------------------------------------------------------------------------------
# inside actors and tasks


def refitd_info(group: str = DEFAULT_GROUP, *, timeout: float = 60.0) -> dict[str, Any]:
    """The info of the daemon on the node this code runs on, once it is ready (see
    :meth:`NodeDaemon.info`). Call it from any Ray actor or task, or the driver."""
    node_id = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(actor_name(group, node_id), namespace=NAMESPACE)
    except ValueError:
        raise RayDaemonError(
            f"no refitd daemon (group {group!r}) on Ray node {node_id}: start them with "
            "RayDaemons(config).start() before the workers, and call reconcile() (or watch()) after "
            "nodes join"
        ) from None
    return ray.get(actor.wait_ready.remote(timeout), timeout=timeout + 30)


def refitd_endpoint(group: str = DEFAULT_GROUP, *, timeout: float = 60.0) -> str:
    """The control endpoint (``ipc://…``) of the daemon on this node, once it is ready: hand it to
    ``RefitClient`` / ``RefitReader`` / ``EngineWorker``. Ask again after a daemon restart."""
    return str(refitd_info(group, timeout=timeout)["endpoint"])
