"""One enum per concept the wire spells as a string; strings are converted once, where they arrive.

``PeerRole``: who a connected peer is to the daemon (decides which requests it may make: the serve
loop's routing table, sidecar.daemon.loop). ``Mover``: how one rank's (or one forwarded step's) bytes
travelled. ``WaitMode``: what a reader's WAIT asks for.
"""

from __future__ import annotations

import enum
from typing import Any


class PeerRole(str, enum.Enum):
    """Who a peer of the daemon's control socket is; set by the message that introduced it."""

    TRAINER = "trainer"  # a trainer rank (HELLO)
    READER = "reader"  # an engine reader or worker (ATTACH)
    FORWARDER = "forwarder"  # a trainer node's daemon, on an inference node (FORWARD_BEGIN)


class Mover(str, enum.Enum):
    """How bytes moved: into staging in place, READ over NIXL, as ZeroMQ frames, or some of each."""

    STAGING = "staging"  # a local rank wrote its pieces straight into the staging arena
    NIXL = "nixl"  # the daemon READ them (or a forwarder WROTE them) over NIXL
    ZMQ = "zmq"  # ZeroMQ frames under credits
    NIXL_ZMQ = "nixl+zmq"  # some pieces each way

    @classmethod
    def parse(cls, value: Any) -> Mover | None:
        """``value`` (a wire string) as a Mover; None for anything else."""
        try:
            return cls(value)
        except ValueError:
            return None


class WaitMode(enum.Enum):
    """What a reader's WAIT asks for."""

    LATEST = "latest"  # whatever generation is live (min_step nil)
    AT_LEAST = "at_least"  # the live generation once its step is >= min_step
    CANCEL = "cancel"  # forget the outstanding WAIT

    @classmethod
    def of(cls, fields: dict[str, Any]) -> tuple[WaitMode, int | None]:
        """``(mode, min_step)`` of a WAIT's fields; ValueError when min_step is not an int or nil."""
        min_step = fields.get("min_step")
        if min_step is not None and not isinstance(min_step, int):
            raise ValueError("WAIT min_step must be an integer or nil")
        if fields.get("cancel"):
            return cls.CANCEL, None
        return (cls.LATEST, None) if min_step is None else (cls.AT_LEAST, min_step)
