"""Structured logging: text by default, one JSON object per line on request.

Fields passed as ``extra={"step": 3, "rank": 1, "phase": "receive"}`` become ``step=3 rank=1
phase=receive`` in text and keys in JSON, so logs can be filtered by step, rank and phase.
"""

from __future__ import annotations

import json
import logging
import sys
import time

STRUCTURED_FIELDS = ("step", "rank", "phase", "record")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields = [
            f"{k}={getattr(record, k)}" for k in STRUCTURED_FIELDS[:3] if getattr(record, k, None) is not None
        ]
        if fields:
            line += " [" + " ".join(fields) + "]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in STRUCTURED_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: int | str = logging.INFO, stream=None) -> None:
    """Route the ``refitd`` loggers to ``stream`` (stderr) in ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if str(fmt) in ("json", "LogFormat.JSON") else TextFormatter())
    root = logging.getLogger("refitd")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
