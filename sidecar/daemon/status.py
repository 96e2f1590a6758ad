"""What ``refitd status`` shows: the serve loop's state as one plain dict (STATUS_REPLY).

Read on the serve loop's thread (the STATUS request is routed there like any other); every value is
plain data, safe to send and to render (sidecar.cli.status).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Protocol

from sidecar.config.settings import RELOADABLE
from sidecar.protocol.enums import PeerRole
from transport.arena import ArenaKind
from transport.gpus import arena_placements, local_gpus

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.memory.generations import Arenas
    from sidecar.daemon.pull import Pulls
    from sidecar.forward.receiver import Receiver
    from sidecar.forward.sender import Forwarding
    from sidecar.numerics.kernels import WarmUp
    from sidecar.plan.build import RefitPlan

    class Observed(LoopContext, Protocol):
        """The serve loop as status reads it: its context and the parts only status shows."""

        forwarding: Forwarding | None
        receiver: Receiver
        pulls: Pulls
        quantizer: WarmUp | None
        local_listen: str | None
        history: list[dict[str, Any]]
        message_errors: dict[str, int]


def status(daemon: Observed) -> dict[str, Any]:
    arenas, config, step, plan, peers = daemon.arenas, daemon.config, daemon.step, daemon.plan, daemon.peers
    live = arenas.live_generation() if arenas else None
    gpus = local_gpus()
    return {
        "gpus": [g.to_wire() for g in gpus],
        "gpus_reason": getattr(gpus, "reason", None),
        "arenas": arena_placements(arenas.all_arenas()) if arenas else [],
        "instance": daemon.instance,
        "pid": os.getpid(),
        "draining": daemon.draining,
        "settings": {k: v for k, v in config.to_dict().items() if k in RELOADABLE},
        "host": socket.gethostname(),
        "listen": config.listen,
        "local_listen": daemon.local_listen,
        "layout": config.layout.value,
        "role": None if config.role is None else config.role.value,
        "peers": None if daemon.forwarding is None else daemon.forwarding.snapshot(),
        "inbound": daemon.receiver.status(),
        "pull": daemon.pulls.status(),
        "format": daemon.spec.fmt.value,
        # the parameters the live generation (and the next) is published in: the plan's, which an
        # attached engine's manifest decides (SPEC §1.7, §2.3); those of other formats at their defaults
        "format_params": (daemon.spec if plan is None else plan.spec)
        .params.for_format(daemon.spec.fmt)
        .to_wire(),
        "quantizer": None if daemon.quantizer is None else daemon.quantizer.to_dict(),
        "world_size": config.world_size,
        "last_step": daemon.last_step,
        "live": None if live is None else {"generation": live.index, "step": live.step},
        "step_in_progress": None
        if step is None
        else {"step": step.step, "begun": sorted(step.declared), "committed": sorted(step.committed)},
        "generations": [
            {
                "generation": g.index,
                "step": g.step,
                "holders": len(g.holders),
                "held_by": [peers.holder_label(i) for i in g.holders],
                "segment": g.arena.name,
                "bytes": g.arena.size,
            }
            for g in (arenas.generations if arenas else [])
        ],
        "staging": None
        if arenas is None
        else {
            "segment": arenas.staging.name,
            "bytes": arenas.staging.size,
            "ring": None if arenas.ring is None else {**arenas.ring.wire(), "held": arenas.ring.held()},
        },
        "tiers": None
        if arenas is None
        else {  # docs/multi_gpu.md: what the device holds (within the budget), where generations live
            "generations": arenas.gen_kind.value,
            "device_bytes": arenas.device_bytes(),
            "device_budget": None if arenas.kind is ArenaKind.SHM else config.device_budget,
            "publish_ring": None if arenas.publish_arena is None else arenas.publish_arena.size,
            "pinned_bytes": sum(p.nbytes for p in arenas.pins),
            "rings": _rings(arenas),
        },
        "trainers": sorted(p.rank for p in peers.of_role(PeerRole.TRAINER)),
        "readers": [p.name for p in peers.of_role(PeerRole.READER)],
        "engines": [
            {
                "name": e.name,
                "engine": e.manifest.engine.value,
                "version": e.manifest.engine_version,
                "moe_backend": e.manifest.moe_backend,
                "expert_format": e.manifest.expert_format.value,
                "format_params": e.manifest.format_params.to_wire(),
            }
            for e in daemon.engines.values()
        ],
        "plan": None
        if plan is None
        else {
            "inputs": len(plan.inputs),
            "outputs": len(plan.outputs),
            "bytes_in": plan.bytes_in,
            "bytes_out": plan.bytes_out,
            "share": _share_status(plan),
        },
        "history": daemon.history,
        "message_errors": dict(daemon.message_errors),
        "blocked": None if step is None or step.target is not None else step.blocked,
        "revoked_holds": arenas.revoked_holds if arenas else 0,
    }


def _rings(arenas: Arenas) -> list[dict[str, Any]]:
    """Each GPU's rings (docs/multi_gpu.md, "Per-GPU work"): its staging and publish arenas, the
    device bytes it holds (within ``device_budget`` each) and the ring groups holding a region
    there now; [] on host arenas."""
    if arenas.kind is ArenaKind.SHM:
        return []
    ring, per_gpu = arenas.ring, arenas.device_bytes_per_gpu()
    publish = arenas.publish_arenas or [None] * arenas.lanes
    return [
        {
            "gpu": getattr(staging, "gpu_uuid", None),
            "device": getattr(staging, "device", None),
            "staging_bytes": staging.size,
            "publish_bytes": None if pub is None else pub.size,
            "device_bytes": per_gpu[lane],
            "groups": None if ring is None else ring.lane_groups(lane),
            "held": [] if ring is None else ring.held(lane),
        }
        for lane, (staging, pub) in enumerate(zip(arenas.stagings, publish))
    ]


def _share_status(plan: RefitPlan) -> dict[str, Any] | None:
    """The node share a plan publishes (status): the engine layout, this node, inputs dropped."""
    if plan.share is None:
        return None
    layout, node = plan.share
    return {
        "engine_ep": layout.ep,
        "engine_tp": layout.tp,
        "nodes": layout.nodes,
        "node_rank": node,
        "dropped_inputs": len(plan.dropped),
    }
