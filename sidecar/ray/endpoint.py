"""Inside any Ray actor or task: the daemon of the node this code runs on."""

from __future__ import annotations

from typing import Any

import ray

from sidecar.ray.settings import (
    DEFAULT_GROUP,
    NAMESPACE,
    RayDaemonError,
    actor_name,
)


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
