"""``RunningDaemon``: refitd's real serve loop (sockets, shared memory, the quantization worker) in a
thread of the test process, asked about itself over its control socket as an operator would.

    with RunningDaemon(tmp_path, hf_config=make_hf_config(...), world_size=2, observers=[obs]) as d:
        ...  # RefitClient(d.endpoint, ...), RefitReader(d.endpoint, ...); d.status(); d.barrier()

``daemon_factory(tmp_path)`` is the body of a fixture that starts any number and closes them all
(tests/conftest.py's ``daemons`` fixture).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from adapters.base import RefitReader
from sidecar.config.settings import DaemonConfig, prepare_runtime_dir
from sidecar.daemon.loop import Daemon
from sidecar.ops.observers import Observer

#: short timeouts for tests; any of them can be overridden
DEFAULTS: dict[str, Any] = dict(reader_timeout_s=3.0, rank_timeout_s=10.0, heartbeat_interval_s=0.2)


class RunningDaemon:
    def __init__(
        self,
        tmp_path: Path,
        *,
        hf_config: dict | None = None,
        observers: Sequence[Any] = (),
        **settings: Any,
    ):
        """``settings`` are DaemonConfig fields over :data:`DEFAULTS` (``runtime_dir`` defaults to
        ``tmp_path/run``); ``hf_config`` a config.json dict written to ``tmp_path``; ``observers``
        the daemon's observers (e.g. a TimelineObserver)."""
        if hf_config is not None:
            path = tmp_path / "config.json"
            path.write_text(json.dumps(hf_config))
            settings.setdefault("hf_config", path)
        self.config = DaemonConfig(**{"runtime_dir": tmp_path / "run", **DEFAULTS, **settings})
        prepare_runtime_dir(self.config.runtime_dir)
        self.daemon = Daemon(self.config, observers=list(observers))
        self.daemon.start()
        self.thread: threading.Thread | None = threading.Thread(
            target=self.daemon.serve_forever, name="refitd-test", daemon=True
        )
        self.thread.start()
        self.endpoint = self.config.listen

    def status(self) -> dict:
        """Asked over the control socket, as an operator would (the serve loop owns the state)."""
        with RefitReader(self.endpoint, name="test-status") as reader:
            return reader.status(timeout=30)

    def barrier(self) -> None:
        """A STATUS round trip: the serve loop is done with every message and hook before it."""
        self.status()

    def close(self) -> None:
        """Stop the loop, join its thread and free the daemon's memory; a second call does nothing."""
        if self.thread is None:
            return
        self.daemon.request_stop()
        self.thread.join(timeout=30)
        self.thread = None
        self.daemon.close()

    def __enter__(self) -> RunningDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopTurns(Observer):
    """Wakes a waiting test at the end of a turn of the serve loop where ``predicate(daemon)`` holds.

    The predicate runs on the serve loop's own thread, between two turns, so it reads the daemon's
    state whole (never half-way through a message); the test blocks on a condition the loop
    notifies rather than asking over and over. Pass it as one of the daemon's ``observers``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._predicate: Callable[[Daemon], bool] | None = None
        self._met = False

    def on_tick(self, daemon: Daemon, now: float) -> None:
        with self._cond:
            if self._predicate is not None and not self._met and self._predicate(daemon):
                self._met = True
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Daemon], bool], timeout: float) -> bool:
        """True once a turn that ends after this call finds ``predicate`` true; False after
        ``timeout`` seconds without one (a loop that stopped turning included)."""
        with self._cond:
            self._predicate, self._met = predicate, False
            try:
                return self._cond.wait_for(lambda: self._met, timeout)
            finally:
                self._predicate = None


def daemon_factory(tmp_path: Path, **defaults: Any) -> Iterator:
    """Yields ``start(**settings) -> RunningDaemon`` (``defaults`` under ``settings``); closes every
    daemon it started afterwards."""
    started: list[RunningDaemon] = []

    def start(**settings: Any) -> RunningDaemon:
        started.append(RunningDaemon(tmp_path, **{**defaults, **settings}))
        return started[-1]

    yield start
    for d in started:
        d.close()
