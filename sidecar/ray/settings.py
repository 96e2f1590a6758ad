"""The ``refitd serve`` settings of every node under Ray: read once on the driver (file, ``REFITD_*``
variables, flags), then made per node (its runtime dir and socket; its role and peers in the
disaggregated layout) and written to it as a TOML file the daemon reads back into an equal object."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from sidecar.config.settings import CONFIG_ENV, ENV_PREFIX, DaemonConfig, NodeLayout, NodeRole, default_listen
from sidecar.config.sources import load_config

#: Ray namespace of the supervisor actors: named actors are found across jobs only within one.
NAMESPACE = "refitd"
DEFAULT_GROUP = "default"
#: A node offering this Ray custom resource (``ray start --resources '{"refitd_inference": 1}'``)
#: or carrying this label (``ray start --labels refitd_inference=1``) is an inference node.
INFERENCE_RESOURCE = "refitd_inference"


class RayDaemonError(RuntimeError):
    """A daemon under Ray could not be placed, did not become ready, or is not there to be found.
    The message names the node(s) and what to do. (Plain ``RuntimeError``: it crosses Ray intact.)"""


def ray_config(
    argv: Sequence[str] = (), *, env: Mapping[str, str] | None = None, file: Path | None = None
) -> DaemonConfig:
    """The ``refitd serve`` settings for every node, read here on the driver: ``argv`` are
    ``refitd serve`` flags, ``env`` (default ``os.environ``) the ``REFITD_*`` variables and
    ``REFITD_CONFIG``, ``file`` the config file when neither ``--config`` nor ``REFITD_CONFIG``
    names one. Raises :class:`sidecar.config.settings.ConfigError` listing every problem."""
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
