"""Logs, metrics and timelines.

Logs are ``text`` or ``json`` lines, at ``debug`` / ``info`` / ``warning`` / ``error``. The
rest is off unless given (sidecar.ops.metrics, sidecar.ops.timeline): ``metrics_listen`` is the
``HOST:PORT`` of an HTTP server answering ``/healthz``, ``/readyz`` and ``/metrics`` (port 0: any
free port); ``timeline_dir`` gets a Chrome-trace JSON file per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sidecar.config import values as v
from sidecar.config.groups.common import OPT_PATH as _OPT_PATH
from sidecar.config.values import LogFormat, LogLevel, knob


@dataclass(frozen=True, kw_only=True)
class OpsSettings:
    """Logs, metrics and timelines. (one group of :class:`sidecar.config.settings.DaemonConfig`)"""

    TITLE: ClassVar[str] = "logs, metrics and timelines"

    log_format: LogFormat = field(
        default=LogFormat.TEXT,
        metadata=knob("--log-format", v.choice(LogFormat), "FMT", "text or json", note="text or json"),
    )
    log_level: LogLevel = field(
        default=LogLevel.INFO,
        metadata=knob(
            "--log-level",
            v.choice(LogLevel),
            "LEVEL",
            "debug, info, warning or error",
            note="debug, info, warning, error",
        ),
    )
    metrics_listen: str | None = field(
        default=None,
        metadata=knob(
            "--metrics-listen",
            v.optional(v.host_port),
            "HOST:PORT",
            "serve /healthz, /readyz, /metrics over HTTP",
            example='"127.0.0.1:9464"',
            note="HTTP /healthz, /readyz, /metrics; default: off",
        ),
    )
    timeline_dir: Path | None = field(
        default=None,
        metadata=knob(
            "--timeline-dir",
            _OPT_PATH,
            "DIR",
            "write a Chrome-trace JSON per step here",
            is_path=True,
            example='"/var/log/refitd/timelines"',
            note="a Chrome-trace JSON per step; default: off",
        ),
    )
