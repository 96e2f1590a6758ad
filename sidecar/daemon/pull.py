"""Remote trainer shards over NIXL: the daemon READs each piece from the client's registered memory.

Choice (automatic): the daemon advertises ``pull: ["nixl"]`` in WELCOME when NIXL works here and its
staging arena is host shared memory; a remote client that can use NIXL too registers a contiguous CPU
copy of each piece and sends ``nixl: {md, regions}`` in BEGIN (one ``[addr, nbytes]`` per piece, in
BEGIN's order). READY then lists, in ``pull``, the pieces the daemon READs; the client streams the
others as ZeroMQ SHARD frames. Only pieces whose staging destination is one contiguous range (whole
tensors, dim-0 slices) are pulled; the rest, and zero-byte pieces, always travel as frames.

When the READ of a rank's pieces completes the daemon accounts them as PIECE_DONE does and sends
``PULLED {step, pieces}``; if it fails it sends ``PULLED {step, pieces: [], failed: [...], reason}``
and the client streams those pieces as frames instead. The client COMMITs after PULLED.

Through a staging ring (sidecar.daemon.memory.staging) READY still lists the pulled pieces, but no
READ is posted then: each layer group's pieces are READ into its region when the group is granted
one (a READ per rank and group, so one ``PULLED`` each), and the region is reused only after the
group's units ran, which needs every byte of it, so a READ never lands in a region another group
holds. A remote rank then sends frames only for what is not pulled, each group after its SLOT.

Threads: the daemon's endpoint lives on its serve loop, progressed every tick while a READ is in
flight (the progress thread is off: transport.nixl); the client's on its worker thread.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sidecar.errors import RefitError
from sidecar.protocol.enums import Mover
from transport import nixl
from transport.shm import shm_region
from transport.wire import Kind

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.memory.staging import RingStaging
    from sidecar.daemon.step import StepState

log = logging.getLogger("refitd.pull")

#: offers (clients' metadata, one per rank and step) whose peers are kept loaded; more start over
MAX_KNOWN_OFFERS = 16


def support(staging: Any) -> tuple[bool, str]:
    """Whether this daemon can pull remote shards over NIXL, and why not."""
    ok, why = nixl.available()
    if not ok:
        return False, f"NIXL is unavailable: {why}"
    if shm_region(staging) is None:
        return False, "the staging arena is not host shared memory"
    return True, ""


@dataclass
class Pull:
    """One rank's READ in flight."""

    rank: int
    identity: bytes
    pieces: list[int]
    transfer: nixl.Transfer
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class PullSide:
    """The daemon's NIXL endpoint for pulling trainer shards (serve loop only)."""

    def __init__(self, name: str):
        self.name = name
        self._ep: nixl.NixlEndpoint | None = None
        self._region: tuple[int, int] | None = None
        self._reg: nixl.Registration | None = None
        # an offer's metadata -> (its peer's name, the offer's regions, those as ints), loaded
        self._peers: dict[bytes, tuple[str, Any, list[list[int]]]] = {}
        self.inflight: list[Pull] = []
        #: the last READ's (targets, regions as ints, endpoint, local, remote, bytes): a READ of
        #: the same targets list under the same regions reuses its descriptors (Pulls.start)
        self._last: tuple | None = None
        #: a peer's name -> the regions (``_peers``' ints) the endpoint last holds for it
        self._regions_set: dict[str, list[list[int]]] = {}

    def endpoint(self, staging: Any) -> nixl.NixlEndpoint:
        if self._ep is None:
            self._ep = nixl.NixlEndpoint(self.name)
        region = shm_region(staging)
        if region is None:
            raise nixl.NixlError("the staging arena is not host shared memory")
        if region != self._region:
            if self._reg is not None:
                self._ep.deregister(self._reg)
                self._reg = None
            self._reg, self._region = self._ep.register([region]), region
        return self._ep

    def start(
        self,
        staging: Any,
        rank: int,
        identity: bytes,
        offer: dict[str, Any],
        targets: list[tuple[int, torch.Tensor, int]],
        notif: bytes,
    ) -> Pull:
        """Post one READ: ``targets`` are ``(piece id, contiguous staging view, index in the offer)``."""
        ep = self.endpoint(staging)
        peer, regions = self._peer(ep, offer)
        last = self._last
        if last is not None and last[0] is targets and last[1] is regions and last[2] is ep:
            local, remote, nbytes = last[3:]  # the same pieces into the same places: checked before
        else:
            local, remote = [], []
            for _pid, view, index in targets:
                addr, n = regions[index]
                if n != view.numel() * view.element_size():
                    raise ValueError(
                        f"region {index} holds {n} bytes, its piece {view.numel() * view.element_size()}"
                    )
                local.append((view.data_ptr(), n))
                remote.append((addr, n))
            nbytes = sum(n for _, n in local)
            self._last = (targets, regions, ep, local, remote, nbytes)
        transfer = ep.read(peer, local, remote, notif)
        pull = Pull(rank, identity, [t[0] for t in targets], transfer, nbytes)
        self.inflight.append(pull)
        return pull

    def _peer(self, ep: nixl.NixlEndpoint, offer: dict[str, Any]) -> tuple[str, list[list[int]]]:
        """The offer's peer and its regions as ints, loaded once per offer: through a staging ring
        a rank's pieces are READ a group at a time, all under the one offer of its BEGIN."""
        md = bytes(offer["md"])
        known = self._peers.get(md)
        if known is not None and (
            known[1] is offer["regions"]
            # the same regions again, and still the ones the endpoint holds for that peer (another
            # offer of the same agent may have set others since): a rank that registered the same
            # buffers, every step of a trainer pushing its parameters; compared in C, not parsed,
            # sorted and set again
            or (self._regions_set.get(known[0]) is known[2] and known[1] == offer["regions"])
        ):
            return known[0], known[2]
        regions = [[int(a), int(n)] for a, n in offer["regions"]]
        live = [r for r in regions if r[1]]
        if known is None:
            if len(self._peers) >= MAX_KNOWN_OFFERS:
                self._peers.clear()
            name = ep.add_peer(md, regions=live)
        else:  # the same registrations, another table of pieces in them
            name = known[0]
            ep.set_peer_regions(name, live)
        self._peers[md] = (name, offer["regions"], regions)
        self._regions_set[name] = regions
        return name, regions

    def poll(self) -> list[tuple[Pull, str | None]]:
        """Finished pulls: ``(pull, None)`` when done, ``(pull, why)`` when failed."""
        finished = []
        for pull in list(self.inflight):
            try:
                if pull.transfer.poll() != "DONE":
                    continue
                finished.append((pull, None))
            except nixl.NixlError as exc:
                finished.append((pull, str(exc)))
            self.inflight.remove(pull)
        if self._ep is not None and self.inflight:
            try:
                self._ep.progress()
            except nixl.NixlError as exc:
                log.warning("progressing the pull endpoint failed: %s", exc)
        return finished

    def cancel(self) -> None:
        for pull in self.inflight:
            pull.transfer.release()
        self.inflight = []

    def forget_region(self) -> None:
        """Deregister the staging arena, which is about to be unmapped (retired after a failed
        step). Its replacement is usually mapped at the very same address and size, so comparing
        regions alone would keep this registration, of pages that are gone, for the new arena."""
        if self._reg is not None:
            self._ep.deregister(self._reg)
        self._reg, self._region = None, None
        self._last = None  # its descriptors, and the views they came from

    def close(self) -> None:
        self.cancel()
        if self._ep is not None:
            self._ep.close()
            self._ep, self._reg, self._region = None, None, None
        self._peers.clear()
        self._regions_set.clear()
        self._last = None


def contiguous_block(full: list[int] | tuple[int, ...], shape: list[int]) -> bool:
    """Whether the block ``shape`` of a C-contiguous tensor of shape ``full`` is one byte range:
    every dim after its first one longer than 1 is whole (where the block starts does not matter)."""
    first = next((d for d, s in enumerate(shape) if s != 1), len(shape))
    return all(shape[d] == full[d] for d in range(first + 1, len(full)))


def _dest(view: torch.Tensor, row: list[Any]) -> torch.Tensor:
    """A piece's place in its tensor's staging ``view`` (BEGIN's row: name, ..., offsets, shape)."""
    offsets, shape = row[3], row[4]
    if any(offsets) or list(view.shape) != list(shape):
        view = view[tuple(slice(int(o), int(o) + int(s)) for o, s in zip(offsets, shape))]
    return view


class Pulls:
    """The serve loop's side of NIXL pulls (a component built with its LoopContext): whether they
    work here, the READ of each remote rank's pieces, and how each rank's bytes last moved."""

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx
        self.side: PullSide | None = None  # made on the first pull
        self.ok, self.reason = False, "not started"
        self.movers: dict[str, dict[str, Any]] = {}  # str(rank) -> mover of its last step, and why
        #: rank -> its last READ's (staging views, BEGIN rows, ids, skipped, offer regions, targets):
        #: a step of the same rows (Trainers._offer_rows: the same list), ids and regions reuses them
        self._targets: dict[int, tuple] = {}

    def probe(self, staging: Any, staging_regions: int) -> None:
        """At start: can remote shards be pulled over NIXL here, and if not, why. A staging ring
        (``staging_regions``) is READ a layer group at a time (:meth:`ring`, :meth:`granted`)."""
        self.ok, self.reason = support(staging)
        if not self.ok:
            log.info("remote trainer shards travel as ZeroMQ frames: %s", self.reason)

    @property
    def busy(self) -> bool:
        return self.side is not None and bool(self.side.inflight)

    def frames(self, rank: int, why: str) -> dict[str, Any]:
        """READY's fields for a remote rank whose pieces all travel as ZeroMQ frames, and why."""
        self.movers[str(rank)] = {"mover": Mover.ZMQ.value, "reason": why}
        return {"pull": [], "mover_reason": why}

    def start(self, state: StepState, rank: int, identity: bytes, ids: list[int]) -> dict[str, Any]:
        """READY's ``pull`` fields for a remote rank: post the READ of its pieces whose staging
        destination is contiguous; anything else (or any failure) travels as ZeroMQ frames."""
        offer, rows = state.nixl_offers.get(rank, (None, None))
        if offer is None:
            return self.frames(rank, self.reason if not self.ok else "the client did not offer NIXL")
        staging = self.ctx.arenas.staging
        try:
            regions = offer["regions"]
            if len(regions) != len(ids) or len(rows) != len(ids):
                raise ValueError(f"{len(regions)} regions for {len(ids)} pieces")
            views = staging.tensors()
            last = self._targets.get(rank)
            if (
                last is not None
                and last[0] is views
                and last[1] is rows
                and last[2] == ids
                and last[3] == state.skipped
                and (last[4] is regions or last[4] == regions)
            ):  # the same pieces, offer and staging as this rank's last READ (compared in C)
                targets = last[5]
            else:
                targets = []
                for index, (pid, row) in enumerate(zip(ids, rows)):
                    if pid in state.skipped:
                        continue  # outside this node's share: not sent at all
                    name, offsets, shape = row[0], row[3], row[4]
                    view = views[name]
                    if any(offsets) or list(view.shape) != shape:  # a part of the tensor, not all of it
                        view = view[tuple(slice(int(o), int(o) + int(s)) for o, s in zip(offsets, shape))]
                    if view.numel() and view.is_contiguous() and int(regions[index][1]):
                        targets.append((pid, view, index))
                self._targets[rank] = (views, rows, list(ids), set(state.skipped), regions, targets)
            if not targets:
                raise ValueError("no piece has a contiguous staging destination")
            if self.side is None:
                self.side = PullSide(f"refitd-{self.ctx.instance}-pull")
            pull = self.side.start(staging, rank, identity, offer, targets, b"")
        except Exception as exc:  # NixlError, a malformed offer: frames instead
            why = f"NIXL pull set-up failed: {type(exc).__name__}: {exc}"
            log.warning("rank %d step %d: %s; ZeroMQ frames", rank, state.step, why)
            return self.frames(rank, why)
        state.pulling.update(pull.pieces)
        streamed = len(ids) - len(pull.pieces) - len(state.skipped_ids(rank))
        why = f"{streamed} piece(s) without a contiguous staging destination go as frames" if streamed else ""
        mover = Mover.NIXL_ZMQ if streamed else Mover.NIXL
        self.movers[str(rank)] = {"mover": mover.value, "reason": why}
        return {"pull": pull.pieces, "mover_reason": why}

    def ring(self, state: StepState, rank: int, ids: list[int], ring: RingStaging) -> dict[str, Any]:
        """READY's ``pull`` fields for a remote rank when staging is a ring: the pieces READ into
        their group's region once it is granted (:meth:`granted`), noted in ``state.ring_pulls``.
        Nothing is posted yet; pieces without a contiguous destination travel as frames."""
        offer, rows = state.nixl_offers.get(rank, (None, None))
        if offer is None:
            return self.frames(rank, self.reason if not self.ok else "the client did not offer NIXL")
        planned: dict[int, list[tuple[int, int]]] = {}
        try:
            regions = offer["regions"]
            if len(regions) != len(ids) or len(rows) != len(ids):
                raise ValueError(f"{len(regions)} regions for {len(ids)} pieces")
            for index, (pid, row) in enumerate(zip(ids, rows)):
                if pid in state.skipped:
                    continue  # outside this node's share: not sent at all
                name, shape = row[0], [int(s) for s in row[4]]
                full = state.tensors[name][1]
                if int(regions[index][1]) and math.prod(shape) and contiguous_block(full, shape):
                    planned.setdefault(ring.group_of[name], []).append((pid, index))
            if not planned:
                raise ValueError("no piece has a contiguous staging destination")
            if self.side is None:
                self.side = PullSide(f"refitd-{self.ctx.instance}-pull")
            self.side.endpoint(self.ctx.arenas.staging)  # the staging arena registered now, once
        except Exception as exc:  # NixlError, a malformed offer: frames instead
            why = f"NIXL pull set-up failed: {type(exc).__name__}: {exc}"
            log.warning("rank %d step %d: %s; ZeroMQ frames", rank, state.step, why)
            return self.frames(rank, why)
        for group, pieces in planned.items():
            state.ring_pulls.setdefault(group, {})[rank] = pieces
        pulled = [pid for pieces in planned.values() for pid, _ in pieces]
        state.pulling.update(pulled)
        streamed = len(ids) - len(pulled) - len(state.skipped_ids(rank))
        why = f"{streamed} piece(s) without a contiguous staging destination go as frames" if streamed else ""
        mover = Mover.NIXL_ZMQ if streamed else Mover.NIXL
        self.movers[str(rank)] = {"mover": mover.value, "reason": why}
        return {"pull": pulled, "mover_reason": why}

    def granted(self, state: StepState, group: int, ring: RingStaging) -> None:
        """Ring group ``group`` was granted a region: post the READ of each rank's pulled pieces of
        it into the region. A READ that cannot be posted is a failed one (the rank sends frames)."""
        staging = self.ctx.arenas.staging
        for rank, pieces in sorted(state.ring_pulls.get(group, {}).items()):
            identity = state.peers[rank]
            offer, rows = state.nixl_offers[rank]
            try:
                targets = [(pid, _dest(ring.view(staging, rows[i][0]), rows[i]), i) for pid, i in pieces]
                self.side.start(staging, rank, identity, offer, targets, b"")
            except Exception as exc:  # NixlError, a malformed offer: this group's pieces go as frames
                self._failed(
                    state, rank, identity, [pid for pid, _ in pieces], f"{type(exc).__name__}: {exc}"
                )

    def _failed(self, state: StepState, rank: int, identity: bytes, pieces: list[int], why: str) -> None:
        state.pulling.difference_update(pieces)  # the rank sends them as frames now
        why = f"NIXL READ failed: {why}"
        log.warning("rank %d step %d: %s; the client sends frames instead", rank, state.step, why)
        self.movers[str(rank)] = {"mover": Mover.ZMQ.value, "reason": why}
        self.ctx.send(
            identity, Kind.PULLED, {"step": state.step, "pieces": [], "failed": pieces, "reason": why}
        )

    def progress(self) -> None:
        """Each turn while a READ is in flight: account the pieces of finished READs (PULLED), or
        tell the rank to send those of a failed one as frames."""
        if not self.busy:
            return
        ctx = self.ctx
        for pull, failed in self.side.poll():
            state = ctx.step
            if state is None:
                continue
            if failed is not None:
                self._failed(state, pull.rank, pull.identity, pull.pieces, failed)
                continue
            state.pulling.difference_update(pull.pieces)
            try:  # whole pieces READ into staging: recorded as a PIECE_DONE's, ready units submitted together
                done = state.pieces_done(pull.rank, pull.pieces)
                if done:
                    ctx.tensors_complete(done)
            except RefitError as exc:
                ctx.fail_step(exc)
                return
            ctx.send(pull.identity, Kind.PULLED, {"step": state.step, "pieces": pull.pieces})

    def cancel(self) -> None:
        if self.side is not None:
            self.side.cancel()

    def forget(self) -> None:
        """The staging arena is being retired: nothing may stay registered on its memory, and no
        view of it kept (its memory goes once none is left)."""
        self._targets.clear()
        if self.side is not None:
            self.side.forget_region()

    def close(self) -> None:
        self._targets.clear()
        if self.side is not None:
            self.side.close()
            self.side = None

    def status(self) -> dict[str, Any]:
        return {"nixl": self.ok, "reason": self.reason, "ranks": self.movers}
