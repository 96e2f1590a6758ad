"""The trainer's client library: ``RefitClient.push_step()``, local and remote ranks.

from sidecar.client import RefitClient, Shard
"""

from sidecar.client.client import DaemonRestarted, RefitClient, RefitError, Shard, StepResult

__all__ = ["DaemonRestarted", "RefitClient", "RefitError", "Shard", "StepResult"]
