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

Threads: the daemon's endpoint lives on its serve loop, progressed every tick while a READ is in
flight (the progress thread is off: transport.nixl); the client's on its worker thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from transport import nixl
from transport.shm import shm_region

log = logging.getLogger("refitd.pull")


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
        self.inflight: list[Pull] = []

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
        regions = [[int(a), int(n)] for a, n in offer["regions"]]
        peer = ep.add_peer(bytes(offer["md"]), regions=[r for r in regions if r[1]])
        local, remote = [], []
        for _pid, view, index in targets:
            addr, n = regions[index]
            if n != view.numel() * view.element_size():
                raise ValueError(
                    f"region {index} holds {n} bytes, its piece {view.numel() * view.element_size()}"
                )
            local.append((view.data_ptr(), n))
            remote.append((addr, n))
        transfer = ep.read(peer, local, remote, notif)
        pull = Pull(rank, identity, [t[0] for t in targets], transfer, sum(n for _, n in local))
        self.inflight.append(pull)
        return pull

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

    def close(self) -> None:
        self.cancel()
        if self._ep is not None:
            self._ep.close()
            self._ep, self._reg, self._region = None, None, None
