"""The peers of the daemon's control socket, as the serve loop knows them.

A peer becomes known by the message that introduces it (HELLO: a trainer rank; ATTACH: a reader;
FORWARD_BEGIN: a forwarder) and carries that :class:`PeerRole`; the serve loop checks a request's
role once, against its routing table, before any handler runs (sidecar.daemon.loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.protocol.enums import PeerRole, WaitMode

#: a forwarder's hold on a generation is kept under this identity prefix (sidecar.forward.sender)
FORWARDER_PREFIX = b"forward:"


@dataclass(slots=True)
class Peer:
    identity: bytes
    role: PeerRole
    last_seen: float
    rank: int | None = None
    pid: int | None = None
    host: str = ""
    name: str = ""
    local: bool = False
    waiting: WaitMode | None = None  # reader: what its outstanding WAIT asks for
    min_step: int | None = None  # reader: the step its outstanding WAIT (AT_LEAST) needs
    hello_seq: int = 0  # trainer: when (in daemon events) its latest HELLO arrived
    #: trainer: the attempt its latest HELLO opened (every answer on this connection names it), and
    #: the step that attempt pushes (its HELLO's, then its latest BEGIN's)
    attempt: int | None = None
    attempt_step: int | None = None
    #: local trainer: (arena name, layout id) of the staging handle a READY last gave it in full;
    #: later READYs on this connection name it by id (sidecar.daemon.trainers.staging_handle)
    staging: tuple[str, str] | None = None


class Peers(dict[bytes, Peer]):
    """identity -> Peer; a dict with the questions the components ask of it."""

    def of_role(self, role: PeerRole) -> list[Peer]:
        return [p for p in self.values() if p.role is role]

    def holder_label(self, identity: bytes) -> str:
        """Who holds a generation, for logs and errors: a reader's name and pid, or a forwarder."""
        if identity.startswith(FORWARDER_PREFIX):
            return f"the forwarder to {identity.removeprefix(FORWARDER_PREFIX).decode(errors='replace')}"
        peer = self.get(identity)
        if peer is None:
            return f"a reader that left (peer {identity.hex()[:16]})"
        return f"reader {peer.name!r} (pid {peer.pid}, peer {identity.hex()[:16]})"
