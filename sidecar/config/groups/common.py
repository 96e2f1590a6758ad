"""Converters several setting groups use."""

from __future__ import annotations

from sidecar.config import values as v
from sidecar.config.values import parse_size

OPT_TEXT, OPT_COUNT, AUTO_SIZE = v.optional(v.text), v.optional(v.count), v.optional(parse_size, auto=True)
OPT_PATH = v.optional(v.to_path)
