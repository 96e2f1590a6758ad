"""The driver side: :class:`RayDaemons` places one supervisor per alive Ray node, waits for every
daemon, keeps the set matched to the nodes (``reconcile``, ``watch``) and stops them."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sidecar.config.settings import (
    DaemonConfig,
    NodeLayout,
    NodeRole,
)
from sidecar.ray.node import NodeDaemon
from sidecar.ray.settings import (
    DEFAULT_GROUP,
    INFERENCE_RESOURCE,
    NAMESPACE,
    RayDaemonError,
    absolute_paths,
    actor_name,
    ray_config,
)

log = logging.getLogger("refitd.ray")

#: The bounds of :meth:`RayDaemons.watch`'s interval: often enough to matter, rarely enough to be cheap.
WATCH_INTERVAL_BOUNDS_S = (0.5, 3600.0)


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
