"""Forwarding over NIXL: the forwarder WRITEs a generation straight into the inference daemon's
claimed generation; ZeroMQ carries only the control messages (sidecar.forward.sender).

Choice (``forward_mover``; ``auto`` by default): the forwarder offers ``movers: ["nixl", "zmq"]`` in
FORWARD_BEGIN when NIXL works here and its generation arena is host shared memory; the inference
daemon answers FORWARD_READY with ``mover: "nixl"`` plus its agent metadata and the region of the
claimed generation (msgpack: bytes and plain ints, nothing pickled), or ``mover: "zmq"`` and a
``mover_reason``. A forwarder whose NIXL fails for a peer (set-up: endpoint, registration, peer
metadata, a refused transfer; or a WRITE that failed or timed out) fails that attempt, then offers
only ``zmq`` to that peer for :data:`RETRY_NIXL_S` and says why in ``mover_reason``.

Layouts: the inference daemon carves its generation with ``Layout.build`` of the forwarded rows, as
the trainer daemon carved its own, so the offsets match and the used byte range moves as one
descriptor; if they ever differ, each tensor gets its own descriptor.

Threads: each forwarder thread owns one :class:`SourceSide` (its endpoint, its registrations); the
inference daemon's :class:`TargetSide` lives on its serve loop, which progresses it every tick while
a NIXL transfer is in flight (the progress thread is off: transport.nixl).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from transport import nixl
from transport.layout import Layout
from transport.shm import shm_region
from transport.wire import Message, dtype_from_name

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.forward.types import Job, Link

log = logging.getLogger("refitd.forward")

NOTIF_PREFIX = b"refitd-forward:"
RETRY_NIXL_S = 60.0  # after NIXL failed for a peer, ZeroMQ frames only for this long


def notif_tag(transfer: str) -> bytes:
    return NOTIF_PREFIX + transfer.encode()


class NixlFailed(RuntimeError):
    """NIXL failed for a peer (set-up, or the WRITE itself): this attempt fails, the next falls back."""


class NixlSetupFailed(NixlFailed):
    """NIXL could not be set up (endpoint, registration, peer metadata, a refused transfer)."""


def support(mover: str) -> tuple[bool, str]:
    """Whether this daemon may use NIXL under ``forward_mover`` (its value), and why not."""
    if mover == "zmq":
        return False, "forward_mover=zmq"
    ok, why = nixl.available()
    return ok, "" if ok else f"NIXL is unavailable: {why}"


# --------------------------------------------------------------------------------------------------
# trainer side


class SourceSide:
    """A forwarder thread's NIXL endpoint, made on first use; each source arena registered once."""

    def __init__(self, name: str):
        self.name = name
        self.broken: str | None = None  # why NIXL last failed for this peer
        self._broken_at = 0.0
        self._ep: nixl.NixlEndpoint | None = None
        self._regs: dict[tuple[int, int], nixl.Registration] = {}
        self._md: bytes | None = None  # the peer metadata last loaded, and the name it gave
        self._peer = ""

    def fail(self, why: str) -> None:
        """NIXL failed for this peer: offer ZeroMQ frames only for the next RETRY_NIXL_S."""
        self.broken, self._broken_at = why, time.monotonic()
        log.warning("NIXL to this peer failed (%s); ZeroMQ frames for the next %.0f s", why, RETRY_NIXL_S)

    def why_not(self) -> str:
        """Why NIXL is not offered now ("" when it may be)."""
        if self.broken is not None and time.monotonic() - self._broken_at < RETRY_NIXL_S:
            return f"NIXL failed for this peer {time.monotonic() - self._broken_at:.0f} s ago: {self.broken}"
        return ""

    def endpoint(self) -> nixl.NixlEndpoint:
        if self._ep is None:
            self._ep = nixl.NixlEndpoint(self.name)
        return self._ep

    def register(self, region: tuple[int, int]) -> None:
        if region not in self._regs:
            self._regs[region] = self.endpoint().register([region])

    def peer(self, md: bytes, regions: list[list[int]]) -> str:
        """The peer's agent name; its metadata is loaded again only when it changed (it registered
        another generation, or restarted), its region table every time."""
        ep = self.endpoint()
        if md != self._md:
            self._md, self._peer = None, ep.add_peer(md, regions=regions)
            self._md = md
        else:
            ep.set_peer_regions(self._peer, regions)
        return self._peer

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
            self._ep, self._regs, self._md = None, {}, None


def descriptors(job: Job, target: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Local and remote ``(addr, len)`` lists: one range when the peer's carving matches ours."""
    base = job.region[0]
    theirs = Layout.build((n, dtype_from_name(d), s) for n, d, s, _ in job.rows)
    if tuple(s.offset for s in theirs) == job.offsets:
        used = theirs.size
        return [(base, used)], [(target, used)]
    pairs = [(o, s.offset, s.nbytes) for o, s in zip(job.offsets, theirs, strict=True) if s.nbytes]
    return [(base + o, n) for o, _, n in pairs], [(target + t, n) for _, t, n in pairs]


class NixlMover:
    """The bytes as one NIXL WRITE (with a notification) into the peer's claimed generation."""

    name = "nixl"

    def __init__(self, side: SourceSide):
        self.side = side

    def send(
        self, link: Link, job: Job, views: Mapping[str, torch.Tensor], ready: Message, deadline: float
    ) -> int:
        info = ready.get("nixl") or {}
        try:
            if job.region is None:
                raise NixlSetupFailed("the generation arena is not host shared memory")
            md, regions, target = bytes(info["md"]), info["regions"], int(info["target"])
            ep = self.side.endpoint()
            self.side.register(job.region)
            peer = self.side.peer(md, regions)
            local, remote = descriptors(job, target)
            transfer = ep.write(peer, local, remote, notif_tag(link.transfer))
        except (nixl.NixlError, ValueError, TypeError, KeyError) as exc:
            raise NixlSetupFailed(f"{type(exc).__name__}: {exc}") from exc
        try:
            transfer.wait(deadline, progress=link.poll_credit)  # poll_credit: an ERROR from the peer fails it
        except nixl.NixlError as exc:
            raise NixlFailed(f"the WRITE failed: {exc}") from exc
        finally:
            transfer.release()
        return sum(n for _, n in local)


# --------------------------------------------------------------------------------------------------
# inference side


class TargetSide:
    """An inference daemon's NIXL endpoint (serve loop only): each generation registered once."""

    def __init__(self, name: str):
        self.name = name
        self.broken: str | None = None
        self._ep: nixl.NixlEndpoint | None = None
        self._regs: dict[tuple[int, int], nixl.Registration] = {}
        self.arrived: set[bytes] = set()  # notifications not yet matched to a commit

    def offer(self, arena: Any) -> dict[str, Any]:
        """READY's ``nixl`` field for ``arena``: metadata (taken after registering) and its region."""
        region = shm_region(arena)
        if region is None:
            raise NixlSetupFailed("this daemon's generation arenas are not host shared memory")
        try:
            if self._ep is None:
                self._ep = nixl.NixlEndpoint(self.name)
            if region not in self._regs:
                self._regs[region] = self._ep.register([region])
            md = self._ep.metadata()
        except nixl.NixlError as exc:
            raise NixlSetupFailed(str(exc)) from exc
        return {"md": md, "regions": [list(region)], "target": region[0]}

    def progress(self) -> None:
        if self._ep is not None:
            try:
                for msgs in self._ep.notifications().values():
                    self.arrived.update(m for m in msgs if m.startswith(NOTIF_PREFIX))
            except nixl.NixlError as exc:
                log.warning("progressing the NIXL endpoint failed: %s", exc)

    def take(self, transfer: str) -> bool:
        """Whether ``transfer``'s WRITE notification arrived (forgetting it and any older ones)."""
        tag = notif_tag(transfer)
        if tag in self.arrived:
            self.arrived.clear()
            return True
        return False

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
            self._ep, self._regs = None, {}
