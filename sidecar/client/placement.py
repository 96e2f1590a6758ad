"""Where READY places a rank's pieces in a staging ring, and in which GPU's staging arena.

With one GPU (or host staging) each of READY's ``placement`` rows is ``[group, offset in the
group's region]``; where the daemon spreads the groups over several GPUs (docs/multi_gpu.md,
"Per-GPU work") READY's ``ring`` says ``arenas: N``, each row gains the staging arena (GPU) of its
group, ``[group, offset, arena]``, a local rank gets every GPU's handle (``stagings``) and each SLOT
names the arena of the region it grants. Anything else is a protocol error (the step fails on every
rank: the client ABORTs it, and the last published generation stays live).
"""

from __future__ import annotations

from typing import Any

from transport.wire import ProtocolError

__all__ = ["placed_row", "ring_arenas"]


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def ring_arenas(ready: dict) -> int:
    """How many staging arenas (GPUs) READY's ring spreads the groups over: 1 unless it says."""
    ring = ready.get("ring")
    count = ring.get("arenas", 1) if isinstance(ring, dict) else 1
    if type(count) is not int or count < 1:
        raise ProtocolError(
            f"READY's ring names {_shown(count)} staging arenas: it must be a positive integer; run "
            "the same refitd version on the daemon and the client"
        )
    return count


def placed_row(row: Any, arenas: int) -> tuple[int, int, int]:
    """(group, offset in its region, staging arena) of one of READY's placement rows:
    ``[group, offset]``, or ``[group, offset, arena]`` where the ring spreads over several GPUs."""
    if not isinstance(row, (list, tuple)) or len(row) not in (2, 3) or any(type(v) is not int for v in row):
        raise ProtocolError(
            f"READY's placement row {str(row)[:60]} is not [group, offset] or [group, offset, arena] "
            "integers: run the same refitd version on the daemon and the client"
        )
    arena = row[2] if len(row) == 3 else 0
    if not 0 <= arena < arenas:
        raise ProtocolError(
            f"READY places group {row[0]} in staging arena {arena}, but its ring has {arenas} "
            f"(0..{arenas - 1}): the daemon and the client disagree on the protocol"
        )
    return row[0], row[1], arena
