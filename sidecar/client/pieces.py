"""What a trainer rank hands ``push_step`` and what it gets back, normalized once: ``Shard``,
``StepResult``, the ``Piece`` rows of a BEGIN, and the pure helpers both writers share.

``Link`` is the narrow view of the client's connection that the writers get (the staging writer in
``sidecar.client.local``, the remote sender in ``sidecar.client.remote``): send, keep the step
alive, take in what the daemon said meanwhile. Everything runs on the client's one worker thread.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from sidecar.client.dtensor import dtensor_boxes, is_dtensor, replica_sender
from sidecar.ops.gcpause import gc_paused
from transport.wire import dtype_name

DONE_BATCH_BYTES = 32 << 20  # local path: tell the daemon about written pieces at least this often
DONE_BATCH_PIECES = 512  # local path: ... and after at most this many; remote: pieces per gc pause
#: while copying pieces or streaming frames, look for an ERROR (and keep the daemon's heartbeat)
#: this often, not after every piece (a poll costs more than copying a small tensor)
POLL_INTERVAL_S = 0.001


@dataclass(frozen=True, slots=True)
class Link:
    """What a writer needs of the client's connection (all on the client's worker thread)."""

    #: send a message, never blocking past the step's deadline
    send: Callable[..., None]
    #: ``keepalive(step, deadline, what)``: raise on a passed deadline or a silent daemon; ping when due
    keepalive: Callable[[int, float, str], None]
    #: ``poll(step, timeout_s)``: take in what the daemon sent (credits, grants, errors: raised),
    #: waiting up to ``timeout_s`` for the first message
    poll: Callable[[int, float], None]
    #: the daemon's heartbeat interval (seconds)
    heartbeat: Callable[[], float]


@dataclass(frozen=True, slots=True)
class Shard:
    """A slice of one global tensor held by this rank: ``global[offsets[d] : offsets[d] + tensor.shape[d]]``."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(d) for d in self.offsets))


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    generation: int
    bytes_in: int
    bytes_out: int
    seconds: dict[str, float]
    loads: list[dict[str, Any]] = field(default_factory=list)  # wait="loaded": each engine worker's ack
    # disaggregated trainer node: each inference daemon's forwarding state as this step went live
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # how this rank's bytes moved: "staging" (same node), "nixl" (the daemon READ them), "zmq" (frames),
    # "nixl+zmq" (some pieces each way); mover_reason says why NIXL was not (or not wholly) used
    mover: str = ""
    mover_reason: str = ""


@dataclass(slots=True)
class Piece:
    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    whole: bool = False  # the whole global tensor (offsets all 0): written without slicing

    def wire(self) -> list[Any]:
        shape = list(self.tensor.shape)
        return [
            self.name,
            dtype_name(self.tensor.dtype),
            shape if self.whole else list(self.global_shape),
            list(self.offsets),
            shape,
        ]


def packed_rows(pieces: list[Piece]) -> bytes:
    """BEGIN's ``pieces``: every piece's :meth:`Piece.wire` row, packed with msgpack (one bytes
    value the daemon compares with the previous step's without decoding it). Packed from tuples
    (msgpack writes a tuple, and a torch.Size, as the same array as a list): no lists made."""
    names = _DTYPE_NAMES
    rows = []
    for p in pieces:
        t = p.tensor
        dtype = names.get(t.dtype) or names.setdefault(t.dtype, dtype_name(t.dtype))
        rows.append((p.name, dtype, t.shape if p.whole else p.global_shape, p.offsets, t.shape))
    return msgpack.packb(rows, use_bin_type=True)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


class StepPieces:
    """The pieces of the last step a client pushed, and their packed BEGIN rows, reused when the
    next step hands over the very same tensors: the same objects under the same names, with the
    same shapes and dtypes, in the same order (a trainer pushing its parameters every step). A
    step of 10,000 tensors then costs an identity check per tensor, not a Piece and a row.

        cache = StepPieces()
        pieces, rows = cache.of(named_tensors)   # the same list and bytes while nothing changed
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # push_step_async may be called from several threads
        self._key: list[tuple[str, torch.Tensor, torch.Size, torch.dtype]] | None = None
        self._pieces: list[Piece] = []
        self._rows = b""

    def of(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[list[Piece], bytes]:
        """``(pieces(named_tensors), packed_rows(...))``, the last ones while the tensors are the same."""
        with gc_paused():  # ``items`` alone is a tuple per tensor: no collections meanwhile
            return self._of(named_tensors)

    def _of(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[list[Piece], bytes]:
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        with self._lock:
            key = self._key
            if key is not None and len(key) == len(items) and _same_tensors(items, key):
                return self._pieces, self._rows
        made = _pieces_of(items)
        # a DTensor's pieces are views of its local shard: made afresh each step, never cached
        whole = (
            len(made) == len(items)
            and all(p.whole for p in made)
            and not any(is_dtensor(v) for _, v in items)
        )
        new = [(n, t, t.shape, t.dtype) for n, t in items] if whole else None
        # other tensor objects of the same names, shapes and dtypes (a fresh state_dict() each
        # step): the same rows, so the same bytes (the daemon compares them with the last step's)
        same_rows = new is not None and key is not None and _same_rows(new, key)
        rows = self._rows if same_rows else packed_rows(made)
        with self._lock:
            self._key, self._pieces, self._rows = new, made, rows
        return made, rows


def _same_rows(new: list, key: list) -> bool:
    """Whether two keys describe the same rows: names, shapes and dtypes (not the objects)."""
    if len(new) != len(key):
        return False
    for (name, _, shape, dtype), (k_name, _, k_shape, k_dtype) in zip(new, key):
        if name != k_name or shape != k_shape or dtype != k_dtype:
            return False
    return True


def _same_tensors(items: list, key: list) -> bool:
    for (name, v), (k_name, k_tensor, k_shape, k_dtype) in zip(items, key):
        if v is not k_tensor or name != k_name or v.shape != k_shape or v.dtype != k_dtype:
            return False
    return True


def pieces(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[Piece]:
    """Normalize user input (tensors, DTensors, Shards, lists of Shards) into pieces, validating each."""
    with gc_paused():  # many small objects at once: no collections meanwhile
        return _pieces_of(named_tensors)


def _pieces_of(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[Piece]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    # beside DTensors, a plain tensor is a replica (FSDP2 leaves buffers such as DeepSeek-V3's
    # e_score_correction_bias unsharded: every rank's state_dict() holds it): one rank sends it
    send_plain = replica_sender(next((v for _, v in items if is_dtensor(v)), None))
    pieces = []
    for name, value in items:
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if is_dtensor(v):  # this rank's local shard where it lies (sidecar.client.dtensor): no gather
                for t, g, o in dtensor_boxes(name, v):
                    whole = t.shape == g
                    pieces.append(Piece(name, t, g, _ZEROS[len(g)] if whole else o, whole))
                continue
            if isinstance(v, torch.Tensor):
                if not send_plain:
                    continue
                shape = v.shape  # a torch.Size: a tuple already
                pieces.append(Piece(name, v, shape, _ZEROS[len(shape)], True))
                continue
            if not isinstance(v, Shard):
                raise TypeError(f"{name!r}: expected a tensor or a Shard, got {type(v).__name__}")
            t, g, o = v.tensor, v.global_shape, v.offsets
            if not (len(g) == len(o) == t.dim()) or any(
                oo < 0 or oo + s > gg for oo, s, gg in zip(o, t.shape, g)
            ):
                raise ValueError(
                    f"{name!r}: shard of shape {list(t.shape)} at offsets {list(o)} does not fit the global "
                    f"shape {list(g)}"
                )
            pieces.append(Piece(name, t, g, o))
    return pieces


class _Zeros(dict):
    """``_ZEROS[n]``: the tuple of ``n`` zeros (the offsets of a whole tensor), made once per n."""

    def __missing__(self, n: int) -> tuple[int, ...]:
        self[n] = (0,) * n
        return self[n]


_ZEROS = _Zeros()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of ``tensor``'s values (itself when it already is one)."""
    src = tensor.detach()
    return (src.cpu() if src.device.type != "cpu" else src).contiguous()


def blocks(
    shape: tuple[int, ...], itemsize: int, limit: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a C-contiguous ``shape`` into contiguous sub-blocks of at most ``limit`` bytes each.

    Each block fixes the leading indices, takes a range along one dim and all of the dims after it.
    """
    nd = len(shape)
    if itemsize > limit:
        raise ValueError(f"a single element of {itemsize} bytes exceeds the frame limit {limit}")
    if nd == 0 or itemsize * _prod(shape) <= limit:
        yield (0,) * nd, shape
        return
    k = next(k for k in range(1, nd + 1) if itemsize * _prod(shape[k:]) <= limit)
    row = itemsize * _prod(shape[k:])
    step = max(1, limit // row)
    for lead in itertools.product(*(range(d) for d in shape[: k - 1])):
        for r0 in range(0, shape[k - 1], step):
            r1 = min(shape[k - 1], r0 + step)
            yield (*lead, r0, *(0,) * (nd - k)), (*(1,) * len(lead), r1 - r0, *shape[k:])


def _prod(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)
