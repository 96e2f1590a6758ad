"""Layouts and forwarding: the trainer's ranks, a node's share of the engine, disaggregated nodes.

``world_size`` trainer ranks push each step. A node's share of a multi-node inference engine
(sidecar.plan.build.EngineLayout): the engine runs expert-parallel over ``engine_ep`` ranks (and
``engine_tp``-way tensor parallel within a node) on ``nodes`` nodes, and this daemon plans,
allocates and publishes only what the engine's GPUs on node ``node_rank`` hold. ``nodes = 1`` (the
default) publishes the whole model; a launcher sets ``node_rank`` per node
(``REFITD_NODE_RANK=$SLURM_NODEID`` under Slurm). Disaggregated layout (DESIGN decision 8):
``layout = "disaggregated"`` and a ``role``. A ``trainer`` daemon forwards every generation it
publishes to the inference daemons in ``peers`` (their ``tcp://HOST:PORT`` control endpoints, CURVE
public key ``curve_server_key``); an ``inference`` daemon publishes what it is forwarded (size its
arenas with ``publish_bytes``) and takes FORWARD_* only from ``curve_trainer_keys``.
``forward_mover``: ``auto`` uses NIXL where both sides have it and ZeroMQ frames otherwise, ``zmq``
never uses NIXL, ``nixl`` makes a forwarder fail rather than fall back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sidecar.config import values as v
from sidecar.config.groups.common import OPT_COUNT as _OPT_COUNT
from sidecar.config.groups.common import OPT_PATH as _OPT_PATH
from sidecar.config.values import ForwardMover, NodeLayout, NodeRole, knob


@dataclass(frozen=True, kw_only=True)
class LayoutSettings:
    """Layouts and forwarding: the trainer's ranks, a node's share of the engine, disaggregated nodes. (one group of :class:`sidecar.config.settings.DaemonConfig`)"""

    TITLE: ClassVar[str] = "layouts and forwarding"

    world_size: int = field(
        default=1, metadata=knob("--world-size", v.count, "N", "trainer ranks that push each step")
    )
    engine_ep: int = field(
        default=1,
        metadata=knob(
            "--engine-ep",
            v.count,
            "N",
            "the engine's expert-parallel size (node share)",
            note="a node's share of a multi-node engine: its expert-parallel size,",
        ),
    )
    engine_tp: int = field(
        default=1,
        metadata=knob(
            "--engine-tp",
            v.count,
            "N",
            "the engine's tensor-parallel size (node share)",
            note="its tensor-parallel size (within a node),",
        ),
    )
    nodes: int = field(
        default=1,
        metadata=knob(
            "--nodes",
            v.count,
            "N",
            "nodes the engine spans; >1 publishes this node's share only",
            note="the nodes it spans (1: publish the whole model),",
        ),
    )
    node_rank: int | None = field(
        default=None,
        metadata=knob(
            "--node-rank",
            _OPT_COUNT,
            "N",
            "this node's index among --nodes (e.g. $SLURM_NODEID)",
            example="0",
            note="and this node's index (Slurm: REFITD_NODE_RANK=$SLURM_NODEID)",
        ),
    )
    layout: NodeLayout = field(
        default=NodeLayout.COLOCATED,
        metadata=knob(
            "--layout",
            v.choice(NodeLayout),
            "LAYOUT",
            "colocated, or disaggregated (needs --role)",
            note="colocated, or disaggregated (then give role)",
        ),
    )
    role: NodeRole | None = field(
        default=None,
        metadata=knob(
            "--role",
            v.optional(v.choice(NodeRole)),
            "ROLE",
            "disaggregated: trainer or inference",
            example='"trainer"',
            note="disaggregated: trainer or inference",
        ),
    )
    peers: tuple[str, ...] = field(
        default=(),
        metadata=knob(
            "--peers",
            v.peer_endpoints,
            "URL[,URL]",
            "trainer role: inference daemons' tcp:// endpoints",
            example='["tcp://10.0.0.6:5555"]',
            commented=True,
            note="trainer role: the inference daemons' endpoints",
        ),
    )
    forward_mover: ForwardMover = field(
        default=ForwardMover.AUTO,
        metadata=knob(
            "--forward-mover",
            v.choice(ForwardMover),
            "MOVER",
            "forwarded bytes: auto (NIXL, else zmq), nixl or zmq",
            note="auto (NIXL where both sides have it, else ZeroMQ frames), nixl, zmq",
        ),
    )
    curve_server_key: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-server-key",
            _OPT_PATH,
            "PATH",
            "the peers' public key (trainer role)",
            is_path=True,
            example='"/etc/refitd/inference.key.pub"',
            note="trainer role: the inference daemons' public key",
        ),
    )
    #: inference role: the trainer daemons' public keys (a file or a folder of ``*.pub``), the only
    #: clients whose FORWARD_* messages it takes; default: every key of ``curve_allowed_keys``
    curve_trainer_keys: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-trainer-keys",
            _OPT_PATH,
            "PATH",
            "inference role: the trainer daemons' public keys, file or dir (default: curve_allowed_keys)",
            is_path=True,
            example='"/etc/refitd/trainers"',
            note="inference role: who may forward; default: curve_allowed_keys",
        ),
    )

    @property
    def share(self) -> tuple[Any, int] | None:
        """``(EngineLayout, node_rank)`` when this daemon publishes one node's share of a multi-node
        engine (``nodes > 1``), for ``RefitPlan.build(share=...)``; None: the whole model."""
        if self.nodes == 1:
            return None
        from sidecar.plan.build import EngineLayout

        return EngineLayout(ep=self.engine_ep, tp=self.engine_tp, nodes=self.nodes), int(self.node_rank or 0)
