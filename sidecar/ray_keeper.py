"""``python -m sidecar.ray_keeper PARENT_PID -- COMMAND...``: run COMMAND one process away from a Ray
worker, so that it always gets SIGTERM, never SIGKILL, when the worker goes.

A Ray worker that exits SIGKILLs its direct children (``RAY_kill_child_processes_on_worker_exit``,
on by default) and may kill its process group. ``refitd serve`` killed that way cannot unlink its
shared-memory segments. So :class:`sidecar.ray.NodeDaemon` starts this keeper instead, which starts
the daemon in a session of its own and waits for it:

* the keeper dies with its parent (``PR_SET_PDEATHSIG``: SIGTERM when the supervisor thread that
  started it dies) and the daemon with the keeper (SIGTERM when the keeper dies, even by SIGKILL);
* SIGTERM, SIGINT and SIGHUP sent to the keeper are passed to the daemon;
* the keeper exits with the daemon's status (``128 + N`` when the daemon died of signal N).

It imports nothing heavy: it starts in milliseconds, beside every daemon.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # prctl(2)
EXIT_USAGE = 2


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to this process when the thread that forked it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum)) != 0:  # pragma: no cover - Linux always accepts it
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def exit_status(code: int) -> int:
    """A child's ``returncode`` as a shell reports it: ``128 + N`` for death by signal N."""
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -m sidecar.ray_keeper PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return EXIT_USAGE
    die_with_parent()
    if os.getppid() != int(args[0]):  # the parent died before prctl took effect
        return 128 + signal.SIGTERM
    child = subprocess.Popen(args[2:], start_new_session=True, preexec_fn=die_with_parent)

    def forward(signum: int, frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    return exit_status(child.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
