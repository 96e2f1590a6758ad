"""PIECE_DONE batches a step recorded, kept for the next steps (sidecar.daemon.step): a client sends the
same batches of sole whole pieces every step, so a later step's batch of the very same ids is recorded
from what the first one worked out."""

from __future__ import annotations

import operator
from dataclasses import dataclass

__all__ = ["REMEMBERED_IDS_PER_PIECE", "SoleBatch", "SoleBatches"]

_KEY = operator.itemgetter(3)  # of CoverageTracker.whole_rows' rows


@dataclass(frozen=True, slots=True)
class SoleBatch:
    """A PIECE_DONE batch of sole whole pieces (each its tensor's only piece, of one rank, none
    twice), as :meth:`CoverageTracker.received_sole` recorded it once: a later step's batch of
    the very same ids is recorded from this (:meth:`CoverageTracker.received_keys`)."""

    ids: list[int]
    keys: list[tuple[str, int]]
    names: tuple[str, ...]
    zeros: dict[str, int]  # each name: no piece pending
    nbytes: int


#: the batches remembered per skeleton hold at most this many ids per declared piece in all (a
#: client that sends other batches every step cannot grow them further: they start over)
REMEMBERED_IDS_PER_PIECE = 2


class SoleBatches(dict):
    """The :class:`SoleBatch` es seen, by (rank, first id, length); ``held``: their ids in all."""

    held = 0

    def remember(self, key: tuple, ids: list[int], take: list, done: tuple[int, list[str]], n: int) -> None:
        """Keep a batch :meth:`CoverageTracker.received_sole` took, of a step of ``n`` pieces."""
        if self.held + len(ids) > REMEMBERED_IDS_PER_PIECE * n:
            self.clear()
            self.held = 0
        nbytes, names = done
        self[key] = SoleBatch(list(ids), list(map(_KEY, take)), tuple(names), dict.fromkeys(names, 0), nbytes)
        self.held += len(ids)
