"""The wire protocol: one versioned msgpack header frame, then raw data frames. No pickle anywhere.

A message on the wire is a ZeroMQ multipart message::

    +----------------------------------------------+  +-----------+     +-----------+
    | header: msgpack map                          |  | data 0    | ... | data n-1  |
    |   "v": PROTOCOL_VERSION (int)                |  | raw bytes |     | raw bytes |
    |   "k": Kind (int)                            |  | (zero-    |     |           |
    |   "n": number of data frames that follow     |  |  copy)    |     |           |
    |   "f": fields of this kind (map, str keys)   |  +-----------+     +-----------+
    +----------------------------------------------+

On a ROUTER socket the peer identity frame comes first. Every frame is size-checked against
``Limits`` before anything is decoded; a bad message is refused with a ``ProtocolError`` that says
which check failed, and the receiver keeps serving. Errors travel as data: an ``ERROR`` message's
fields are ``{"kind", "message", "rank", "step"}`` (see ``sidecar.errors``). Every message a daemon
sends also carries its ``"instance"`` field (random per start): a client that sees a new one knows
the daemon restarted.

Attempts. Every push of a trainer rank is one attempt: its HELLO names ``"attempt"`` (an int the
client numbers its pushes with, required) and ``"step"``, and every message after it on that
connection belongs to that attempt (the client repeats the number in each; a BEGIN, PIECE_DONE,
SHARD, COMMIT or ABORT naming another is a PROTOCOL error). Every message the daemon sends a rank names ``"attempt"``: the one current on
its connection, which is the attempt whose message it answers (a connection's messages are handled
in order, answered at once). A step failure told a rank whose current attempt is not at that step
names none: it concerns that rank's attempt at the step, whose HELLO has not arrived yet. A client
ignores anything naming an attempt other than its current one (a late answer to the COMMIT of a push
that failed must not fail its retry of the same step number) and takes what names none as before.
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 2  # 2: BEGIN's pieces may be msgpack bytes of the rows (sidecar.daemon.step)
#: the streamed-refit sub-protocol (STREAM / GROUP / STREAM_FAILED): a reader asks for it in ATTACH
#: (``"stream": STREAM_VERSION``) and the daemon says in ATTACHED which version it speaks (absent: none);
#: a reader and a daemon that disagree fall back to whole generations, nothing else changes
STREAM_VERSION = 1


class Kind(enum.IntEnum):
    """Message kinds. Trainer client <-> daemon, then reader <-> daemon, then either direction."""

    HELLO = 1  # client: rank, world_size, pid, host, local, attempt, step -> WELCOME (opens an attempt)
    WELCOME = 2  # daemon: instance, attempt, staging arena, limits
    BEGIN = 3  # client: step, rank, pieces it will send -> READY (when the daemon can take the step)
    READY = 4  # daemon: step accepted; piece ids (skip: those outside its node share, not sent); write now
    SHARD = 5  # client (remote): name, piece id, sub-block offsets and shape + 1 data frame
    PIECE_DONE = 6  # client (local): piece written straight into the staging arena
    CREDIT = 7  # daemon: frames the remote client may send
    COMMIT = 8  # client: this rank sent everything for the step
    ABORT = 9  # client: abort the step, with a reason
    ACK = 14  # daemon: a request was accepted ("of": the kind it acknowledges)
    RESULT = 10  # daemon: the step was published (step, generation, phase times)
    LOADED = 15  # daemon: every engine attached at publish time loaded the step, or which did not
    PULLED = 16  # daemon: the pieces it READ over NIXL from a remote client (or which failed)
    SLOT = 17  # daemon (staging ring): write group ``group`` now, into the region at byte ``offset``
    ERROR = 11  # either: {kind, message, rank, step}; to a trainer rank also the attempt it answers
    PING = 12  # liveness, both ways
    PONG = 13
    ATTACH = 20  # reader: name -> ATTACHED
    ATTACHED = 21  # daemon: instance, the generation arenas
    WAIT = 22  # reader: min_step -> GENERATION when one is published
    GENERATION = 23  # daemon: generation index, step, layout
    RELEASE = 24  # reader: generation index, step
    REVOKED = 25  # daemon: a reader's hold on a generation was dropped (reader_timeout_s) to write a step
    STREAM = (
        26  # daemon -> streaming reader: step s is being written into generation g; its groups, the live one
    )
    GROUP = 27  # daemon -> streaming reader: these groups of step s are written and readable now
    STREAM_FAILED = (
        28  # daemon -> streaming reader: step s failed; reload what it took from the live generation
    )
    STATUS = 30  # anyone -> STATUS_REPLY
    STATUS_REPLY = 31
    DETACH = 32  # reader or client leaving
    FORWARD_BEGIN = 40  # trainer node's forwarder: step, source, layout rows -> FORWARD_READY
    FORWARD_READY = 41  # inference node: target generation claimed and carved; credits, mover
    FORWARD_DATA = 42  # forwarder: tensor index, byte offset + 1 data frame (the ZeroMQ mover)
    FORWARD_COMMIT = 43  # forwarder: every byte sent (or written by NIXL) -> FORWARDED
    FORWARDED = 44  # inference node: the forwarded step is published there
    FORWARD_ABORT = 45  # forwarder: drop the transfer in progress (a newer step, or giving up)


_KINDS = frozenset(int(k) for k in Kind)


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits checked on every frame before decoding."""

    max_header_bytes: int = 1 << 20
    max_frame_bytes: int = 64 << 20
    max_frames: int = 64


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the receiver refuses it and keeps serving."""


class HeaderTooLarge(ProtocolError):
    """A message header over ``Limits.max_header_bytes`` (a BEGIN of very many pieces, most likely)."""


#: how much of a peer-supplied value an error message quotes
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict, _QUOTE.maxset = 3, 4, 4, 4, 4
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 80, 80, 40


def safe_repr(value: Any, limit: int = 200) -> str:
    """A bounded ``repr`` of a value a peer sent, for error messages: never raises, never recurses
    deeply (a list nested 1000 deep is ``[[[[...]]]]``), at most ``limit`` characters."""
    try:
        text = _QUOTE.repr(value)
    except Exception:  # a hostile object's repr may raise anything (RecursionError included)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(slots=True)
class Message:
    kind: Kind
    fields: dict[str, Any] = field(default_factory=dict)
    frames: list[Any] = field(default_factory=list)  # bytes-like; zmq.Frame on receive

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str, types: type | tuple[type, ...]) -> Any:
        """A field that must be present with one of ``types``; ProtocolError otherwise."""
        if key not in self.fields:
            raise ProtocolError(f"{self.kind.name} message lacks field {key!r}")
        value = self.fields[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            raise ProtocolError(f"{self.kind.name} field {key!r} has type {type(value).__name__}")
        return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``: the header, then its data frames untouched (zero-copy)."""
    header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "k": int(msg.kind), "n": len(msg.frames), "f": msg.fields},
        use_bin_type=True,
    )
    return [header, *msg.frames]


def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Parse ``frames`` (header first) into a Message, checking every limit first."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) - 1 > limits.max_frames:
        raise ProtocolError(f"{len(frames) - 1} data frames exceed the limit of {limits.max_frames}")
    raw = frames[0]
    raw = raw.bytes if hasattr(raw, "bytes") else bytes(raw)
    if len(raw) > limits.max_header_bytes:
        raise HeaderTooLarge(f"header of {len(raw)} bytes exceeds the limit of {limits.max_header_bytes}")
    for i, frame in enumerate(frames[1:]):
        size = len(frame.buffer) if hasattr(frame, "buffer") else len(frame)
        if size > limits.max_frame_bytes:
            raise ProtocolError(
                f"data frame {i} of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}; "
                "send smaller chunks (the client splits shards by the limit the daemon announces)"
            )
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a msgpack map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {safe_repr(version)} is not supported (this side speaks {PROTOCOL_VERSION}); "
            "run the same refitd version on both sides"
        )
    k = header.get("k")
    if type(k) is not int or k not in _KINDS:
        raise ProtocolError(f"unknown message kind {safe_repr(k)}")
    kind = Kind(k)
    fields = header.get("f", {})
    if not isinstance(fields, dict):
        raise ProtocolError(f"{kind.name} fields are not a map")
    n = header.get("n")
    if type(n) is not int or n != len(frames) - 1:
        raise ProtocolError(f"{kind.name} announces {safe_repr(n)} data frames, got {len(frames) - 1}")
    return Message(kind, fields, list(frames[1:]))


# --------------------------------------------------------------------------------------------------
# dtypes on the wire: a closed list of names, never an arbitrary attribute lookup

# filled on first use, so that importing this module (``refitd status`` does) does not import torch
_DTYPES: dict[str, torch.dtype] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _load_dtypes() -> None:
    import torch

    _DTYPES.update(
        {
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float32": torch.float32,
            "float64": torch.float64,
            "float8_e4m3fn": torch.float8_e4m3fn,
            "uint8": torch.uint8,
            "int8": torch.int8,
            "int32": torch.int32,
            "int64": torch.int64,
            "bool": torch.bool,
        }
    )
    _DTYPE_NAMES.update({v: k for k, v in _DTYPES.items()})


def dtype_names() -> frozenset[str]:
    """Every dtype name that may travel on the wire."""
    if not _DTYPES:
        _load_dtypes()
    return frozenset(_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    if not _DTYPE_NAMES:
        _load_dtypes()
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    if not _DTYPES:
        _load_dtypes()
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}") from None
