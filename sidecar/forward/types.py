"""What both halves of forwarding share (sidecar.forward.sender, sidecar.forward.receiver): the job a
forwarder carries, the transfer an inference daemon receives, the requests a forwarder thread puts
to the serve loop, and the errors that end one attempt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import zmq

from sidecar.protocol.enums import Mover
from transport.layout import Layout, Slot
from transport.wire import Kind, dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.memory.generations import Generation


class Request(enum.Enum):
    """What a forwarder thread asks of the serve loop (its inbox; the loop thread owns the holds)."""

    HOLD = "hold"  # hold the job's generation and hand back byte views of it (or refuse: reused)
    RELEASE = "release"  # the bytes are read (or the attempt failed): release the hold
    STATE = "state"  # update the peer's row in status


class Link(Protocol):
    """What a mover uses of the forwarder that runs it: the control channel of one transfer."""

    transfer: str  # this attempt's token, echoed in every reply

    def send(self, kind: Kind, fields: dict[str, Any], frames=(), *, copy: bool = False) -> None: ...

    def await_credit(self, deadline: float) -> int: ...

    def poll_credit(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Job:
    """One published generation to forward: metadata only; the bytes come with a hold."""

    step: int
    generation: int
    rows: tuple[tuple[str, str, tuple[int, ...], int], ...]  # name, dtype, shape, nbytes
    nbytes: int  # what goes on the wire (FP8 where the plan quantizes)
    bytes_bf16: int  # what the same step weighed in BF16, as the trainer sent it
    source: str  # the trainer daemon's instance
    region: tuple[int, int] | None = None  # the arena's whole segment (address, size), if host shm
    offsets: tuple[int, ...] = ()  # each row's byte offset in the arena

    @classmethod
    def of(
        cls, gen: Generation, step: int, bytes_bf16: int, source: str, region: tuple[int, int] | None
    ) -> Job:
        """``gen`` as a job; ``region``: its arena's whole segment if host shm (forward.movers.shm_region)."""
        layout = list(gen.arena.layout)
        rows = tuple((s.name, dtype_name(s.dtype), s.shape, s.nbytes) for s in layout)
        offsets = tuple(s.offset for s in layout)
        nbytes = sum(r[3] for r in rows)
        return cls(step, gen.index, rows, nbytes, bytes_bf16, source, region, offsets)


class ForwardFailed(RuntimeError):
    """One attempt failed; the forwarder retries with the newest generation."""


class Superseded(Exception):
    """A newer generation was published before this one's bytes started moving."""


@dataclass(slots=True)
class Inbound:
    """The transfer an inference daemon is receiving (at most one: a newer one replaces it)."""

    identity: bytes
    transfer: str
    step: int
    source: str
    layout: Layout
    slots: list[Slot]
    started: float
    last_seen: float
    sender: str = ""  # the forwarder's CURVE public key (z85): who may continue this transfer
    target: Generation | None = None
    flat: dict[str, torch.Tensor] = field(default_factory=dict)
    index: int = 0  # next tensor expected
    offset: int = 0  # next byte of it
    received: int = 0
    unacked: int = 0
    offered: tuple[Mover, ...] = (Mover.ZMQ,)  # the movers the forwarder offered
    mover: Mover = Mover.ZMQ
    mover_reason: str = ""
    committer: bytes | None = None  # NIXL: FORWARD_COMMIT came, publish once the notification did

    def skip_empty(self) -> None:
        while self.index < len(self.slots) and self.offset >= self.slots[self.index].nbytes:
            self.index, self.offset = self.index + 1, 0

    @property
    def complete(self) -> bool:
        self.skip_empty()
        return self.index == len(self.slots)


FORWARD_KINDS = frozenset({Kind.FORWARD_BEGIN, Kind.FORWARD_DATA, Kind.FORWARD_COMMIT, Kind.FORWARD_ABORT})


def curve_user_id(frame: Any) -> str | None:
    """The CURVE public key (z85) the ZAP handler authenticated for a received frame; None when the
    connection has none (``ipc://``, or a listener without CURVE)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return user or None


def forward_keys(config: DaemonConfig, allowed: set[bytes]) -> frozenset[str]:
    """The z85 public keys that may forward to this inference node: ``curve_trainer_keys`` when
    given, else every key allowed to connect."""
    from transport.curve import allowed_keys

    keys = allowed if config.curve_trainer_keys is None else allowed_keys(config.curve_trainer_keys)
    return frozenset(k.decode() if isinstance(k, bytes) else str(k) for k in keys)
