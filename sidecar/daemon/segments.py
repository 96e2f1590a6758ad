"""The record of a daemon's shared-memory segments (``<runtime_dir>/segments.json``) and the clean-up
after a daemon that died without unlinking them. Light on purpose: Ray's supervisor imports it too."""

from __future__ import annotations

import json
import os
from pathlib import Path

SEGMENTS_FILE = "segments.json"


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(runtime_dir: Path) -> list[str]:
    """Unlink the ``/dev/shm`` segments a dead daemon listed in ``<runtime_dir>/segments.json``
    (the daemon writes it at start); a live owner's are left alone. Returns the names removed."""
    path = Path(runtime_dir) / SEGMENTS_FILE
    try:
        record = json.loads(path.read_text())
        pid, names = int(record.get("pid", 0)), [str(n) for n in record.get("segments", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    if pid_alive(pid):
        return []
    removed = []
    for name in names:
        segment = Path("/dev/shm", name)
        if segment.exists():
            segment.unlink(missing_ok=True)
            removed.append(name)
    return removed
