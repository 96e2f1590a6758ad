"""Under Ray: one ``refitd serve`` per Ray node, for as long as the Ray job (or longer, detached).

NeMo-RL, verl, OpenRLHF and slime place their trainers and engines with Ray. :class:`RayDaemons`
starts one supervisor actor per alive node, pinned there (``NodeAffinitySchedulingStrategy``,
``soft=False``), named ``refitd:<group>:<node_id>`` in the ``refitd`` namespace. The actor runs the
real daemon (``python -m sidecar.cli serve --config FILE``) through a small keeper process
(:mod:`sidecar.ray_keeper`) and restarts it when it dies; any actor or task finds the daemon of
its own node with :func:`refitd_endpoint`::

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

Modules: :mod:`~sidecar.ray.settings` (the per-node config), :mod:`~sidecar.ray.node` (the
supervisor actor), :mod:`~sidecar.ray.cluster` (:class:`RayDaemons`), :mod:`~sidecar.ray.endpoint`
(:func:`refitd_endpoint`); :mod:`sidecar.ray_keeper` stays outside the package so that it starts
without importing Ray.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised where ray is absent
    raise ImportError(
        f"sidecar.ray needs Ray ({exc}): install refitd's ray extra, `pip install 'refitd[ray]'`"
    ) from exc

from sidecar.ray.cluster import (
    WATCH_INTERVAL_BOUNDS_S,
    RayDaemons,
    is_inference_node,
    placement_group_nodes,
    stop_detached,
)
from sidecar.ray.endpoint import refitd_endpoint, refitd_info
from sidecar.ray.node import DaemonState, NodeDaemon, remove_stale_segments, sweep_runtime_base
from sidecar.ray.settings import (
    DEFAULT_GROUP,
    INFERENCE_RESOURCE,
    NAMESPACE,
    RayDaemonError,
    absolute_paths,
    actor_name,
    daemon_env,
    node_config,
    node_runtime_dir,
    ray_config,
    to_toml,
)

__all__ = [
    "DEFAULT_GROUP",
    "INFERENCE_RESOURCE",
    "NAMESPACE",
    "WATCH_INTERVAL_BOUNDS_S",
    "DaemonState",
    "NodeDaemon",
    "RayDaemonError",
    "RayDaemons",
    "absolute_paths",
    "actor_name",
    "daemon_env",
    "is_inference_node",
    "node_config",
    "node_runtime_dir",
    "placement_group_nodes",
    "ray_config",
    "refitd_endpoint",
    "refitd_info",
    "remove_stale_segments",
    "stop_detached",
    "sweep_runtime_base",
    "to_toml",
]
