"""Ports for tests: bound by the OS, never fixed numbers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free a moment ago on ``host`` (whoever binds it next may race another process;
    possible, not likely). Prefer ``ipc://`` paths in ``tmp_path`` where a test allows it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
