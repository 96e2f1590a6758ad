"""Fixtures every test file may use; the helpers behind them are the ``support`` package.

* ``daemons``: ``start(**settings) -> RunningDaemon``, the real serve loop in a thread of the test
  (``observers=[...]`` for hooks such as a TimelineObserver); every daemon started is closed after
  the test. ``RunningDaemon`` and ``daemon_factory`` are in :mod:`support.daemons`.
* ``free_port``: :func:`support.net.free_port`, for tests that need TCP (prefer ``ipc://`` paths in
  ``tmp_path``).
* ``wait_until``: :func:`support.waiting.wait_until`, a condition polled with a deadline.
* every test starts with no kernel calls kept by :mod:`sidecar.plan.reuse` (autouse).

pytest puts this file's folder (tests/) first on ``sys.path`` when it loads it, so test files import
the helpers as ``from support import procs`` / ``from support.daemons import RunningDaemon`` whether
pytest runs from the repository root or from tests/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import net, waiting
from support.daemons import RunningDaemon, daemon_factory

from sidecar.plan import reuse


@pytest.fixture(autouse=True)
def _fresh_kernel_calls() -> None:
    """Each test starts with no kept kernel calls (sidecar.plan.reuse): a buffer the allocator hands out
    again at an address an earlier test used would otherwise take the kept path in one test order and
    the full path in another."""
    reuse.forget()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """``start(**settings)``: a RunningDaemon under ``tmp_path`` (DaemonConfig fields, ``hf_config=``
    a config dict, ``observers=``); all of them are closed when the test ends, whatever it did."""
    yield from daemon_factory(tmp_path)


@pytest.fixture
def free_port() -> Callable[..., int]:
    """``free_port(host="127.0.0.1") -> int``: a port the OS just said is free."""
    return net.free_port


@pytest.fixture
def wait_until() -> Callable[..., object]:
    """``wait_until(what, predicate, timeout=30)``: ``predicate``'s first truthy value, or a failure
    naming ``what`` once the deadline passes."""
    return waiting.wait_until
