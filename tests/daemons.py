"""``RunningDaemon``: refitd's real serve loop (sockets, shared memory, the quantization worker) in a
thread of the test process, asked about itself over its control socket as an operator would.

    d = RunningDaemon(tmp_path, hf_config=make_hf_config(...), world_size=2, staging_regions=2)
    ...  # RefitClient(d.endpoint, ...), RefitReader(d.endpoint, ...)
    d.close()

``daemon_factory(tmp_path)`` is the body of a fixture that starts any number and closes them all.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adapters.base import RefitReader
from sidecar.config.settings import DaemonConfig, prepare_runtime_dir
from sidecar.daemon.loop import Daemon

#: short timeouts for tests; any of them can be overridden
DEFAULTS: dict[str, Any] = dict(reader_timeout_s=3.0, rank_timeout_s=10.0, heartbeat_interval_s=0.2)


class RunningDaemon:
    def __init__(self, tmp_path: Path, *, hf_config: dict | None = None, **settings: Any):
        if hf_config is not None:
            path = tmp_path / "config.json"
            path.write_text(json.dumps(hf_config))
            settings.setdefault("hf_config", path)
        self.config = DaemonConfig(**{"runtime_dir": tmp_path / "run", **DEFAULTS, **settings})
        prepare_runtime_dir(self.config)
        self.daemon = Daemon(self.config)
        self.daemon.start()
        self.thread = threading.Thread(target=self.daemon.serve_forever, name="refitd-test", daemon=True)
        self.thread.start()
        self.endpoint = self.config.listen

    def status(self) -> dict:
        """Asked over the control socket, as an operator would (the serve loop owns the state)."""
        with RefitReader(self.endpoint, name="test-status") as reader:
            return reader.status(timeout=30)

    def close(self) -> None:
        self.daemon.request_stop()
        self.thread.join(timeout=30)
        self.daemon.close()


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
