"""The staging ring, trainer side: each of a rank's layer groups is written once the daemon grants
it a region (SLOT), in whatever order the grants come; the daemon quantizes a group, then reuses its
region for a later one.

``RingWriter`` reads the grants the session (``sidecar.client.session``) collects into its
per-step ``StepGrants`` and writes through the two data paths: the staging writer
(``sidecar.client.local``, same node) and the remote sender (``sidecar.client.remote``: NIXL or
frames). All on the client's worker thread.
"""

from __future__ import annotations

from typing import Any

from sidecar.client.pieces import Piece
from sidecar.client.placement import placed_row, ring_arenas
from transport.wire import ProtocolError


class RingWriter:
    """Writes one step's groups as their regions are granted."""

    def __init__(self, session, local, remote):
        self.session, self.local, self.remote = session, local, remote

    def open_staging(self, ready: dict) -> None:
        """Map the staging arena READY names (a local rank), and, where the ring spreads over
        several GPUs, every GPU's (``stagings``: the arena SLOT's ``arena`` indexes)."""
        self.local.open(ready["staging"])
        arenas = ring_arenas(ready)
        if arenas > 1:
            self.local.open_lanes(ready.get("stagings"), arenas)

    def granted_region(self, group: int, placed: int, arenas: int) -> tuple[int, int]:
        """(offset, staging arena) of the region SLOT granted ``group``: ProtocolError when SLOT
        names an arena the ring does not have, or another than READY placed the group in (its
        writes would land in a region nobody reads as that group's). The step then fails on every
        rank (the client ABORTs it) and the last published generation stays live."""
        grants = self.session.step
        arena = grants.slot_arenas.get(group, 0)
        if arena != placed or not 0 <= arena < arenas:
            raise ProtocolError(
                f"SLOT grants group {group} a region in staging arena {arena}, but READY placed it in "
                f"arena {placed} of {arenas}: the daemon and the client disagree; run the same refitd "
                "version on both"
            )
        return grants.slots[group], arena

    def write(
        self, step: int, pieces, ids, ready: dict, deadline: float, srcs=None, *, reg: Any = None
    ) -> tuple[str, str]:
        """Write this rank's groups. Same node: straight into each granted region; else ZeroMQ
        frames, except the pieces READY says the daemon READs over NIXL (``reg``: this step's
        registration), each group's as it is granted: this rank waits for their PULLEDs, and sends
        frames for any whose READ failed. Returns (mover, why)."""
        session, remote = self.session, self.remote
        placement = ready.get("placement")
        if not isinstance(placement, list) or len(placement) != len(pieces):
            raise ProtocolError(
                f"READY places {len(placement or ())} pieces, this rank declared {len(pieces)}"
            )
        local = "staging" in ready
        if local:
            self.open_staging(ready)
        pull = set(ready.get("pull") or ()) if reg is not None and not local else set()
        groups: dict[int, list[tuple[Piece, int, int, Any]]] = {}
        placed: dict[int, int] = {}  # group -> the staging arena READY places it in
        by_id: dict[int, tuple[Piece, Any]] = {}  # pulled pieces: sent as frames only if their READ fails
        arenas = ring_arenas(ready)
        for i, (piece, pid, row) in enumerate(zip(pieces, ids, placement)):
            src = srcs[i] if srcs is not None else None  # remote: the host copy made for the step
            group, rel, arena = placed_row(row, arenas)
            placed[group] = arena
            if pid in pull:
                by_id[pid] = (piece, src)
            else:
                groups.setdefault(group, []).append((piece, pid, rel, src))
        waiting, why = set(by_id), str(ready.get("mover_reason") or "")
        remote.pulled, remote.pulling = [], bool(waiting)
        framed = sum(len(rows) for rows in groups.values())
        while groups or waiting:
            failed, failed_why = remote.take_pulled(waiting)
            if failed:  # their group is granted (its READ was posted): frames go at once
                why, framed = failed_why, framed + len(failed)
                ps, hs = [by_id[p][0] for p in failed], [by_id[p][1] for p in failed]
                remote.stream(step, ps, failed, deadline, session.frame_limit(), hs)
            granted = [g for g in groups if g in session.step.slots]
            if not granted:
                if groups or waiting:
                    what = "a staging region (SLOT)" if groups else "the daemon to pull its shards (PULLED)"
                    session.keepalive(step, deadline, f"waiting for {what}")
                    session.poll(step, 0.001 if remote.pulling else session.heartbeat())
                continue
            for g in granted:
                offset, arena = self.granted_region(g, placed[g], arenas)
                rows = groups.pop(g)
                del session.step.slots[g]
                if local:
                    self.local.write_group(step, rows, offset, deadline, arena)
                else:
                    host = [r[3] for r in rows] if srcs is not None else None
                    rps, rids = [r[0] for r in rows], [r[1] for r in rows]
                    remote.stream(step, rps, rids, deadline, session.frame_limit(), host)
        remote.pulling = False
        if local:
            return "staging", ""
        if not by_id or framed == len(pieces):
            return "zmq", why
        return ("nixl+zmq" if framed else "nixl"), why
