"""The trainer's client library: ``RefitClient.push_step()``, local and remote ranks.

``client`` (the session with the daemon), ``local`` (same-node ranks write into its staging arena),
``remote`` (NIXL pulls or ZeroMQ frames), ``pieces`` (what a rank hands over, and the shared helpers).

from sidecar.client import RefitClient, Shard
"""

from sidecar.client.client import DaemonRestarted, RefitClient, RefitError
from sidecar.client.pieces import Shard, StepResult

__all__ = ["DaemonRestarted", "RefitClient", "RefitError", "Shard", "StepResult"]
