"""One step's bookkeeping, free of sockets: who began, what each rank will send, what has arrived,
which units of work can run, and how long each phase took.

The daemon feeds it events (``begin``, ``piece_done``/``bytes_received``, ``commit``) and asks it
questions (``ready_units``, ``sealed``). Every check raises ``RefitError`` with the kind and the rank
at fault, so the daemon can fail the step on every rank with one message.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from sidecar.daemon.coverage import CoverageError, Piece
from sidecar.daemon.sole_batches import SoleBatches
from sidecar.daemon.tracker import CoverageTracker, FrameError
from sidecar.errors import ErrorKind, RefitError
from sidecar.ops.gcpause import gc_paused
from sidecar.plan.build import RefitPlan, TensorSpec, Unit
from transport.wire import ProtocolError, dtype_from_name, dtype_names

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.memory.generations import Generation


@dataclass(frozen=True, slots=True)
class Declared:
    """One piece a rank announced in BEGIN: ``[name, dtype, global_shape, offsets, shape]`` on the wire."""

    name: str
    dtype_name: str
    global_shape: tuple[int, ...]
    piece: Piece

    @classmethod
    def from_wire(cls, rank: int, row: Any, index: int = 0) -> Declared:
        """Row ``index`` of rank ``rank``'s BEGIN, its field types checked (ProtocolError naming the
        field, the type expected and the type sent); the values are checked by the tracker."""
        if type(row) is list and len(row) == 5:  # the fast path: one check per field, no message built
            name, dtype, global_shape, offsets, shape = row
            if (
                type(name) is str
                and name
                and type(dtype) is str
                and dtype in _WIRE_DTYPES
                and type(global_shape) is list
                and type(offsets) is list
                and type(shape) is list
                and len(global_shape) == len(offsets) == len(shape)
                and set(map(type, global_shape + offsets + shape)) <= _INT
            ):
                return cls(
                    name, dtype, tuple(global_shape), Piece.of_ints(rank, tuple(offsets), tuple(shape))
                )
        raise _row_error(rank, row, index)


_INT = frozenset({int})
_WIRE_DTYPES = dtype_names()


def _row_error(rank: int, row: Any, index: int) -> ProtocolError:
    """What is wrong with BEGIN row ``index`` that :meth:`Declared.from_wire` refused."""
    where = f"rank {rank}: BEGIN piece {index}"
    if not (isinstance(row, list) and len(row) == 5):
        return ProtocolError(
            f"{where} is a {wire_type(row)}, expected a list [name, dtype, global_shape, offsets, shape]: "
            "send one such list per piece"
        )
    name, dtype, global_shape, offsets, shape = row
    if not isinstance(name, str) or not name:
        return ProtocolError(
            f"{where}: name is a {wire_type(name)}, expected a non-empty str (the tensor's name)"
        )
    if not isinstance(dtype, str):
        return ProtocolError(
            f"{where} ({name!r}): dtype is a {wire_type(dtype)}, expected a str such as 'bfloat16'"
        )
    if dtype not in _WIRE_DTYPES:
        return ProtocolError(
            f"{where} ({name!r}): unknown dtype {dtype[:40]!r}; supported: {sorted(_WIRE_DTYPES)}"
        )
    for field_name, v in (("global_shape", global_shape), ("offsets", offsets), ("shape", shape)):
        if not isinstance(v, list) or any(type(d) is not int for d in v):
            return ProtocolError(
                f"{where} ({name!r}): {field_name} is a {wire_type(v)}, expected a list of ints "
                "(one per dim of the global tensor)"
            )
    return ProtocolError(
        f"{where} ({name!r}): global_shape, offsets and shape have {len(global_shape)}, {len(offsets)} "
        f"and {len(shape)} entries: give one per dim of the global tensor"
    )


def begin_rows(rank: int, pieces: Any) -> list[Any]:
    """A BEGIN's rows: ``pieces`` itself when it is a list, or the list packed in it when it is
    bytes (msgpack of the same list: what the client sends, so that the daemon can tell a step that
    declares exactly what the previous one did by comparing bytes, without decoding them)."""
    if type(pieces) is list:
        return pieces
    if type(pieces) is not bytes:
        raise ProtocolError(
            f"rank {rank}: BEGIN pieces is a {wire_type(pieces)}, expected a list of "
            "[name, dtype, global_shape, offsets, shape] rows, or msgpack bytes of one"
        )
    try:
        rows = msgpack.unpackb(pieces, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(
            f"rank {rank}: BEGIN pieces holds {len(pieces)} bytes that are not msgpack "
            f"({type(exc).__name__}): pack the list of rows with msgpack"
        ) from None
    if type(rows) is not list:
        raise ProtocolError(
            f"rank {rank}: BEGIN pieces packs a {wire_type(rows)}, expected a list of "
            "[name, dtype, global_shape, offsets, shape] rows"
        )
    return rows


@dataclass(frozen=True, slots=True)
class Skeleton:
    """What the ranks of a step declared, once checked against ``plan``.

    RL steps of one model declare the very same pieces every time. A later step whose ranks begin
    with exactly the same ``pieces`` (compared as sent: bytes, or lists), in the same order, takes
    this over instead of parsing, declaring and checking every row again: for a step of 10,000
    tensors that was most of the time from BEGIN to READY. Everything here is read-only; the
    tracker is a template (``CoverageTracker.fresh`` gives each step its own arrivals)."""

    plan: RefitPlan
    keys: tuple[tuple[int, Any], ...]  # (rank, its BEGIN's pieces as sent), in BEGIN order
    declared: dict[int, list[int]]
    pieces: list[tuple[int, str, int]]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    tracker: CoverageTracker
    skipped: frozenset[int]
    #: ``pieces`` as PIECE_DONE reads them (:meth:`CoverageTracker.whole_rows`), made by the first
    #: step that needs them and kept for the steps after it (one holder: the dataclass is frozen),
    #: and the batches of sole pieces seen so far (:class:`SoleBatch`, by rank, first id, length)
    done_rows: list[Any] = field(default_factory=lambda: [None, SoleBatches()])


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same rows as sent, type for type: ``==`` alone says ``0.0 == 0`` and
    ``True == 1``, so rows that a first step refuses ("expected a list of ints") would be taken over
    unchecked by a following one. ``a`` is the skeleton's (checked, shallow) rows: the walk ends
    at its depth, whatever ``b`` nests."""
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def wire_type(value: Any) -> str:
    """A wire value's type for a message (never its repr: it may be huge or nested deep)."""
    if isinstance(value, list):
        return f"list of {len(value)}"
    return "bool" if isinstance(value, bool) else type(value).__name__


@dataclass(slots=True)
class Phases:
    """Wall-clock marks of one step (``time.monotonic()``) and the seconds spent validating."""

    first_begin: float = 0.0
    all_begun: float = 0.0
    all_received: float = 0.0
    quant_start: float = 0.0
    quant_end: float = 0.0
    quant_busy: float = 0.0  # seconds the worker spent in units (receive and quantize overlap)
    validate: float = 0.0  # seconds spent checking declarations against the plan and coverage
    published: float = 0.0

    def seconds(self) -> dict[str, float]:
        """Per-phase seconds. ``wait_ranks``: first BEGIN to the last; ``receive``: READY to the last
        byte; ``quantize``: worker busy time (it overlaps receive: layers are quantized as they
        complete); ``quantize_tail``: what quantization added after the last byte; ``publish``: the
        last unit to the generation going live; ``total``: first BEGIN to live."""
        end = self.published or time.monotonic()
        return {
            "wait_ranks": max(0.0, self.all_begun - self.first_begin) if self.all_begun else 0.0,
            "validate": self.validate,
            "receive": max(0.0, (self.all_received or end) - (self.all_begun or self.first_begin)),
            "quantize": self.quant_busy,
            "quantize_tail": max(0.0, self.quant_end - self.all_received)
            if self.quant_end and self.all_received
            else 0.0,
            "publish": max(0.0, self.published - max(self.quant_end, self.all_received))
            if self.published
            else 0.0,
            "total": max(0.0, end - self.first_begin),
        }


@dataclass(slots=True)
class StepState:
    step: int
    world_size: int
    deadline: float
    declared: dict[int, list[int]] = field(default_factory=dict)  # rank -> its wire piece ids
    pieces: list[tuple[int, str, int]] = field(default_factory=list)  # wire id -> (rank, name, tracker id)
    peers: dict[int, bytes] = field(default_factory=dict)  # rank -> the identity that began it
    committed: set[int] = field(default_factory=set)
    tracker: CoverageTracker = field(default_factory=CoverageTracker)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name -> dtype, shape
    complete: set[str] = field(default_factory=set)
    units_submitted: set[int] = field(default_factory=set)
    units_done: set[int] = field(default_factory=set)
    bytes_in: int = 0
    phases: Phases = field(default_factory=Phases)
    ready_sent: bool = False
    max_pieces: int = 1 << 20  # pieces all ranks may declare in the step (max_step_pieces)
    staged: set[int] = field(default_factory=set)  # ranks READY handed the staging handle (local writers)
    nixl_offers: dict[int, tuple[dict[str, Any], list[Any]]] = field(
        default_factory=dict
    )  # rank -> (offer, rows)
    # The serve loop's state of the step: it ends with the step (the loop drops this object).
    target: Generation | None = None  # the generation the step writes, once claimed
    deferred: list[Unit] = field(default_factory=list)  # units ready before the target was free
    parked: dict[int, list[Unit]] = field(default_factory=dict)  # ring: ready units whose group has no region
    ring_ranks: dict[int, set[int]] = field(default_factory=dict)  # ring: group -> ranks holding part of it
    #: ring: group -> {rank: [(wire piece id, index in the rank's NIXL offer)]} READ at its grant
    ring_pulls: dict[int, dict[int, list[tuple[int, int]]]] = field(default_factory=dict)
    pulling: set[int] = field(default_factory=set)  # wire ids the daemon READs (or will): no frames for them
    blocked: dict[str, Any] | None = None  # the target generation, held by readers (status, timeout text)
    #: wire ids of pieces outside this node's share (``RefitPlan.dropped``): READY tells their
    #: ranks to skip them, and data for one is refused
    skipped: set[int] = field(default_factory=set)
    #: passthrough inputs whose remote frames the daemon writes straight into ``target`` (name ->
    #: byte offset there, a subset of ``Arenas.direct``: no local rank holds a piece of them, since
    #: no trainer process ever maps a generation); empty: every input goes through staging
    direct: Mapping[str, int] = field(default_factory=dict)
    #: passthrough units waiting for the local ranks' COMMIT (Pipeline.tensors_complete): their copy
    #: out of staging then takes no memory bandwidth from those ranks' copies in
    after_local: list[Unit] = field(default_factory=list)
    #: the last checked step's declarations (:class:`Skeleton`): ranks that begin with the same
    #: pieces in the same order are only compared with it, and the step takes it over at
    #: :meth:`settle`; the first rank that differs has every rank declared for real
    skeleton: Skeleton | None = None
    keys: list[tuple[int, Any]] = field(default_factory=list)  # (rank, pieces as sent), BEGIN order
    followed: int = 0  # leading ``keys`` matched to the skeleton and not declared (yet)
    settled: bool = False  # took the skeleton over: its declarations were checked against the plan
    #: ``pieces`` as PIECE_DONE reads them, once every rank declared, and the batches of sole
    #: pieces seen (shared with the skeleton: :attr:`Skeleton.done_rows`)
    done_rows: list[Any] = field(default_factory=lambda: [None, SoleBatches()])

    # ---- BEGIN

    def begin(self, rank: int, pieces: list[Any] | bytes) -> None:
        """Rank ``rank`` declares its pieces: BEGIN's ``pieces``, a list of rows or msgpack bytes
        of one (:func:`begin_rows`). A refused BEGIN declares nothing."""
        if rank in self.declared:
            raise RefitError(
                f"rank {rank} began step {self.step} twice",
                kind=ErrorKind.PROTOCOL,
                rank=rank,
                step=self.step,
            )
        if not 0 <= rank < self.world_size:
            raise RefitError(
                f"rank {rank} is outside world_size {self.world_size}",
                kind=ErrorKind.INVALID,
                rank=rank,
                step=self.step,
            )
        if not self.declared:
            self.phases.first_begin = time.monotonic()
        with gc_paused():  # a BEGIN of many pieces makes many small objects: no collections meanwhile
            if not self._follow(rank, pieces):
                self._declare(rank, begin_rows(rank, pieces))
        self.keys.append((rank, pieces))

    def _follow(self, rank: int, pieces: Any) -> bool:
        """Whether ``rank``'s BEGIN is the next one of the skeleton, as sent (then it is only noted:
        :meth:`settle` takes the skeleton over). The first BEGIN that is not ends following: the
        ranks followed so far are declared for real first."""
        sk, k = self.skeleton, len(self.keys)
        if sk is None or self.followed != k:
            return False
        if (
            k < len(sk.keys)
            and sk.keys[k][0] == rank
            and _same(sk.keys[k][1], pieces)
            and len(sk.pieces) <= self.max_pieces
        ):
            self.declared[rank] = sk.declared[rank]
            self.followed += 1
            return True
        self._unfollow()
        return False

    def _unfollow(self) -> None:
        """Declare the ranks that followed the skeleton (a later BEGIN differs from it, or the plan
        changed): a prefix of declarations that were checked together, so they declare cleanly."""
        followed, self.followed = self.keys[: self.followed], 0
        for rank, _ in followed:
            del self.declared[rank]
        for rank, pieces in followed:
            self._declare(rank, begin_rows(rank, pieces))

    def settle(self, plan: RefitPlan | None) -> None:
        """Every rank began. If each followed the skeleton and ``plan`` is the one it was checked
        against, take its declarations over (:meth:`validate_against` then has nothing to check);
        otherwise declare the followed ranks now."""
        sk = self.skeleton
        if sk is None or not self.followed or self.followed != len(self.keys):
            return
        with gc_paused():
            if plan is sk.plan and len(self.keys) == len(sk.keys):
                self.pieces, self.tensors = sk.pieces, dict(sk.tensors)
                self.done_rows = sk.done_rows
                self.tracker, self.skipped = sk.tracker.fresh(), set(sk.skipped)
                self.settled = True
            else:
                self._unfollow()

    def skeleton_for(self, plan: RefitPlan) -> Skeleton:
        """This step's declarations, checked against ``plan`` (after :meth:`validate_against`), for
        the next step to follow."""
        if self.settled and self.skeleton is not None:
            return self.skeleton
        return Skeleton(
            plan,
            tuple(self.keys),
            dict(self.declared),
            self.pieces,
            dict(self.tensors),
            self.tracker.fresh(),
            frozenset(self.skipped),
            self.done_rows,
        )

    def _declare(self, rank: int, rows: list[Any]) -> None:
        """Parse and check every row first, then declare them all: a refused BEGIN declares nothing."""
        total = len(self.pieces) + len(rows)
        if total > self.max_pieces:
            raise RefitError(
                f"rank {rank}'s BEGIN declares {len(rows)} pieces, {total} in step {self.step} with the other "
                f"ranks', over max_step_pieces={self.max_pieces}: send fewer, larger pieces (a whole expert "
                "slab rather than one piece per expert), or raise max_step_pieces (--max-step-pieces, "
                "REFITD_MAX_STEP_PIECES)",
                kind=ErrorKind.INVALID,
                rank=rank,
                step=self.step,
            )
        declared = [Declared.from_wire(rank, row, i) for i, row in enumerate(rows)]
        new: dict[str, tuple[str, tuple[int, ...]]] = {}
        for d in declared:
            known = self.tensors.get(d.name) or new.setdefault(d.name, (d.dtype_name, d.global_shape))
            if known != (d.dtype_name, d.global_shape):
                raise RefitError(
                    f"tensor {d.name!r}: rank {rank} says {d.dtype_name} {list(d.global_shape)} but "
                    f"{'another rank' if d.name in self.tensors else 'an earlier piece'} said {known[0]} "
                    f"{list(known[1])}; every rank must describe the same global tensor",
                    kind=ErrorKind.INVALID,
                    rank=rank,
                    step=self.step,
                )
        try:
            ids = self.tracker.declare_all(
                [(d.name, d.global_shape, d.piece, _itemsize(d.dtype_name)) for d in declared]
            )
        except CoverageError as exc:
            raise RefitError(str(exc), kind=ErrorKind.COVERAGE, rank=rank, step=self.step) from None
        self.tensors.update(new)
        first = len(self.pieces)
        self.pieces.extend((rank, d.name, pid) for d, pid in zip(declared, ids))
        self.declared[rank] = list(range(first, len(self.pieces)))

    @property
    def all_begun(self) -> bool:
        return len(self.declared) == self.world_size

    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.declared]

    def specs(self) -> list[TensorSpec]:
        """The step's global tensors, in first-declared order (the plan's input order)."""
        return [TensorSpec(n, dtype_from_name(d), shape) for n, (d, shape) in self.tensors.items()]

    def validate_against(self, plan: RefitPlan) -> None:
        """Names, dtypes and shapes against the plan, then exact coverage: all problems in one error.

        Tensors the plan drops (outside this node's share) are set aside first: neither checked nor
        staged, their pieces skipped (:meth:`skipped_ids`)."""
        if self.settled and self.skeleton is not None and plan is self.skeleton.plan:
            return  # the skeleton's declarations, checked against this very plan
        self._set_aside(plan.dropped)
        problems = []
        expected = {i.name: i for i in plan.inputs}
        for name, (dtype, shape) in self.tensors.items():
            spec = expected.get(name)
            if spec is None:
                problems.append(f"tensor {name!r} is not part of the plan (a renamed or extra tensor?)")
            elif dtype_from_name(dtype) != spec.dtype or tuple(shape) != tuple(spec.shape):
                problems.append(
                    f"tensor {name!r} is {dtype} {list(shape)}, the plan expects "
                    f"{str(spec.dtype).removeprefix('torch.')} {list(spec.shape)}"
                )
        for name in expected:
            if name not in self.tensors:
                problems.append(f"tensor {name!r}: no rank sent any part of it")
        if problems:
            raise RefitError(_join(problems), kind=ErrorKind.INVALID, step=self.step)
        try:
            self.tracker.check_declared(expected)
        except CoverageError as exc:
            raise RefitError(str(exc), kind=ErrorKind.COVERAGE, step=self.step) from None

    def _set_aside(self, dropped: frozenset[str]) -> None:
        names = [n for n in self.tensors if n in dropped]
        if not names:
            return
        for name in names:
            del self.tensors[name]
        self.tracker.forget(names)
        gone = set(names)
        self.skipped = {pid for pid, (_, name, _) in enumerate(self.pieces) if name in gone}

    def skipped_ids(self, rank: int) -> list[int]:
        """``rank``'s wire piece ids outside this node's share, which it must not send."""
        if not self.skipped:
            return []
        return [pid for pid in self.declared.get(rank, ()) if pid in self.skipped]

    # ---- data

    def piece_received(
        self, rank: int, piece_id: int, offsets: list[int] | None = None, shape: list[int] | None = None
    ) -> str | None:
        """Record the block ``offsets``/``shape`` of a piece (global coordinates; the whole piece when
        None); returns the tensor name if that tensor just completed. A block outside the piece or
        overlapping data already received is a PROTOCOL error of ``rank``."""
        name, tid = self.piece(rank, piece_id)
        try:
            self.tracker.received(name, tid, offsets, shape)
        except FrameError as exc:
            raise RefitError(str(exc), kind=ErrorKind.PROTOCOL, rank=rank, step=self.step) from None
        except CoverageError as exc:
            raise RefitError(str(exc), kind=ErrorKind.COVERAGE, rank=rank, step=self.step) from None
        if shape is None:
            self.bytes_in += self.tracker.piece_nbytes(name, tid)
        else:
            self.bytes_in += math.prod(shape) * _itemsize(self.tensors[name][0])
        if self.tracker.tensor_complete(name) and name not in self.complete:
            self.complete.add(name)
            if len(self.complete) == len(self.tensors):
                self.phases.all_received = time.monotonic()
            return name
        return None

    def pieces_done(self, rank: int, ids: list[Any]) -> list[str]:
        """PIECE_DONE: ``rank`` wrote each piece of ``ids`` whole into staging. Returns the tensors
        that just completed. :meth:`piece_received` for each, in one pass (a batch names hundreds
        of small pieces); the first refused id raises as it would there, after the ones before it."""
        pieces, skipped = self.pieces, self.skipped
        rows, batches = self.done_rows
        if rows is None or len(rows) != len(pieces):  # made once all ranks declared; then kept
            rows = self.done_rows[0] = self.tracker.whole_rows(pieces)
            batches = self.done_rows[1] = SoleBatches()
        n = len(rows)
        if ids and not skipped and set(map(type, ids)) == _INT:
            # a batch of sole pieces that an earlier step sent the same (the client sends the same
            # batches every step): only whether one arrived already is asked, in C
            key = (rank, ids[0], len(ids))
            known = batches.get(key)
            if known is not None and known.ids == ids:
                if self.tracker.received_keys(known.keys, known.zeros):
                    return self._took(known.nbytes, list(known.names))
            elif (
                min(ids) >= 0 and max(ids) < n
            ):  # the usual batch, checked and looked up without a Python loop
                take = list(map(rows.__getitem__, ids))
                if set(map(_RANK, take)) == {rank}:
                    done_at_once = self.tracker.received_sole(take)
                    if done_at_once is not None:
                        batches.remember(key, ids, take, done_at_once, n)
                        return self._took(*done_at_once)
        take, bad = [], len(ids)  # the position of the first refused id (any value, None included)
        for at, pid in enumerate(ids):
            if type(pid) is not int or not 0 <= pid < n or pid in skipped or rows[pid][0] != rank:
                bad = at  # refused below, once the ids before it are recorded
                break
            take.append(rows[pid])
        try:
            nbytes, done = self.tracker.received_whole(take)
        except FrameError as exc:
            raise RefitError(str(exc), kind=ErrorKind.PROTOCOL, rank=rank, step=self.step) from None
        except CoverageError as exc:
            raise RefitError(str(exc), kind=ErrorKind.COVERAGE, rank=rank, step=self.step) from None
        self._took(nbytes, done)
        if bad < len(ids):
            self.piece(rank, ids[bad])  # raises, naming what is wrong with it
        return done

    def _took(self, nbytes: int, done: list[str]) -> list[str]:
        """Count ``nbytes`` in, note the tensors ``done`` (a tensor's count of pending pieces reaches
        0 once: none of them completed before)."""
        self.bytes_in += nbytes
        complete = self.complete
        complete.update(done)
        if done and len(complete) == len(self.tensors):
            self.phases.all_received = time.monotonic()
        return done

    def piece(self, rank: int, piece_id: int) -> tuple[str, int]:
        """(tensor name, tracker piece id) of wire piece ``piece_id``, which ``rank`` must own."""
        if type(piece_id) is int and 0 <= piece_id < len(self.pieces):
            owner, name, tid = self.pieces[piece_id]
            if owner == rank and piece_id in self.skipped:
                raise RefitError(
                    f"rank {rank} sent data for piece {piece_id} of {name!r}, which READY told it to skip: "
                    "the tensor lies outside this node's share of the engine (node_rank, engine_ep); a "
                    "client must not send the pieces READY lists under 'skip'",
                    kind=ErrorKind.PROTOCOL,
                    rank=rank,
                    step=self.step,
                )
            if owner == rank:
                return name, tid
        shown = piece_id if type(piece_id) is int else f"<{wire_type(piece_id)}>"
        raise RefitError(
            f"rank {rank} sent data for piece {shown}, which it did not declare in BEGIN: "
            "piece ids are the ints READY listed for this rank",
            kind=ErrorKind.PROTOCOL,
            rank=rank,
            step=self.step,
        )

    def piece_ids(self, rank: int) -> list[int]:
        return list(self.declared.get(rank, ()))

    def ready_units(self, plan: RefitPlan, name: str) -> list[Unit]:
        """Units reading ``name`` whose inputs are now all complete and that were not yet submitted."""
        units = []
        submitted, complete = self.units_submitted, self.complete
        for unit in plan.units_for_input(name):
            if unit.index in submitted:
                continue
            for i in unit.inputs:
                if i not in complete:
                    break
            else:
                submitted.add(unit.index)
                units.append(unit)
        return units

    # ---- COMMIT and seal

    def commit(self, rank: int) -> None:
        if rank not in self.declared:
            raise RefitError(
                f"rank {rank} committed before BEGIN", kind=ErrorKind.PROTOCOL, rank=rank, step=self.step
            )
        lacking = self.tracker.incomplete(rank)
        if lacking:
            raise RefitError(
                f"rank {rank} committed step {self.step} with data missing: " + _join(lacking),
                kind=ErrorKind.COVERAGE,
                rank=rank,
                step=self.step,
            )
        self.committed.add(rank)

    def sealed(self, plan: RefitPlan) -> bool:
        return len(self.committed) == self.world_size and len(self.units_done) == len(plan.units)


_INT = {int}
_RANK = operator.itemgetter(0)


def _itemsize(dtype_name: str) -> int:
    return dtype_from_name(dtype_name).itemsize


def _join(lines: Iterable[str], limit: int = 12) -> str:
    lines = list(lines)
    shown = "; ".join(lines[:limit])
    return shown + (f"; and {len(lines) - limit} more" if len(lines) > limit else "")
