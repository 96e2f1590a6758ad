"""The example config file, made from the settings' declarations (nothing here to keep in step).

Every key appears once, in field order: set to its default, or commented out with an example value
where there is no default to show; each line's comment is the field's ``note``. Given a config,
:func:`example_toml` writes that config's values instead (a file that loads back to the same config).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sidecar.config.settings import GROUP_OF, KNOBS, DaemonConfig
from sidecar.config.values import plain

HEADER = "# refitd config: later sources win (this file < REFITD_* variables < flags)."
NOTE_COLUMN = 40  # where a line's comment starts, unless the line is longer


def toml_value(value: Any) -> str:
    """``value`` as TOML: strings quoted, whole floats as integers, enums by their config word."""
    value = plain(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string is a JSON string


def example_toml(config: DaemonConfig | None = None) -> str:
    """The example file (``config`` None), or a file that loads back to ``config``."""
    lines, title = [HEADER], None
    for f in dataclasses.fields(DaemonConfig):
        knob = KNOBS[f.name]
        if GROUP_OF[f.name] != title:
            title = GROUP_OF[f.name]
            lines += ["", f"# ---- {title}"]
        if config is not None and getattr(config, f.name) is not None:
            line = f"{f.name} = {toml_value(getattr(config, f.name))}"
        else:
            missing = f.default is dataclasses.MISSING or f.default is None
            text = knob.example if knob.example is not None else toml_value(f.default)
            commented = missing if knob.commented is None else knob.commented
            if config is not None:
                commented = True  # this config leaves it unset
            line = f"{'# ' if commented else ''}{f.name} = {text}"
        first, *more = knob.note.split("\n") if knob.note else [""]
        lines.append(f"{line:<{max(NOTE_COLUMN, len(line) + 2)}}# {first}" if first else line)
        lines.extend(f"{'#':<{NOTE_COLUMN}}# {note}" for note in more)
    return "\n".join(lines) + "\n"


#: Every key of the config file, at its default; a key left out keeps its default.
EXAMPLE_TOML = example_toml()
