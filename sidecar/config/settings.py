"""The daemon's settings: one frozen :class:`DaemonConfig`, from a TOML file, ``REFITD_*``, then flags.

Later sources win: a command-line flag beats an environment variable, which beats the config file,
which beats the default. ``0`` is a value, never "unset": a source that does not mention a setting
leaves the one below it in place. Every problem in every source is collected and reported at once,
one per line, each naming where the bad value came from (``key 'world_size' in /etc/refitd.toml``,
``environment variable REFITD_WORLD_SIZE``, ``flag --world-size``) and what to give instead::

    config = load_config()          # sys.argv[1:] and os.environ; --config / REFITD_CONFIG names the file
    prepare_runtime_dir(config.runtime_dir)     # creates runtime_dir 0700, or refuses one others can enter

Each setting is declared once, as a field of one of the groups in :mod:`sidecar.config.groups`
(identity and sockets, formats, memory and GPUs, timeouts, layouts and forwarding, ops), which
:class:`DaemonConfig` joins; the field's metadata (a ``Knob``) carries its flag, converter, help and
example; flags (``sidecar.config.sources``) and the example file
(``sidecar.config.example``) are made from the fields. File key: the field name; variable: ``REFITD_``
+ the name in upper case (lists comma-separated); sizes: ``4096``, ``512MiB``, ``2GiB``, ``1.5G``.
Relative paths in the file are relative to its folder, elsewhere to the working directory. The
dataclass never reads ``os.environ``: :func:`default_runtime_dir` receives the environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sidecar.config import values as v
from sidecar.config.checks import value_problems
from sidecar.config.environment import NATIVE_CC_ENV, NATIVE_DIR_ENV, NATIVE_ENV
from sidecar.config.groups.formats import FormatSettings
from sidecar.config.groups.identity import IdentitySettings
from sidecar.config.groups.layouts import LayoutSettings
from sidecar.config.groups.memory import DEFAULT_DEVICE_BUDGET as DEFAULT_DEVICE_BUDGET  # re-exported
from sidecar.config.groups.memory import DEFAULT_GPU_REGIONS as DEFAULT_GPU_REGIONS  # re-exported
from sidecar.config.groups.memory import MemorySettings
from sidecar.config.groups.ops import OpsSettings
from sidecar.config.groups.timeouts import TimeoutSettings
from sidecar.config.runtime_dir import default_listen
from sidecar.config.runtime_dir import default_runtime_dir as default_runtime_dir  # re-exported
from sidecar.config.runtime_dir import prepare_runtime_dir as prepare_runtime_dir  # re-exported
from sidecar.config.values import MAX_IPC_PATH_BYTES as MAX_IPC_PATH_BYTES  # re-exported
from sidecar.config.values import (  # the enums and helpers callers import from here, re-exported
    ConfigError,
    DrainMode,
    ForwardMover,
    Knob,
    LogFormat,
    LogLevel,
    MiB,
    NodeLayout,
    NodeRole,
    Problem,
    Residency,
    parse_size,
)
from sidecar.config.values import is_loopback_host as is_loopback_host  # re-exported
from sidecar.config.values import split_host_port as split_host_port  # re-exported
from sidecar.config.values import tcp_host as tcp_host  # re-exported
from sidecar.numerics.formats import Format, FormatParams, Nvfp4Names  # re-exported
from transport.arena import ArenaKind  # re-exported

#: Settings SIGHUP may change in a running daemon; everything else needs a restart.
RELOADABLE = frozenset(
    {"log_level", "log_format", "drain", "step_timeout_s", "rank_timeout_s", "heartbeat_interval_s"}
    | {"reader_timeout_s", "shutdown_timeout_s", "forward_timeout_s"}
)

#: Exit status for a configuration error: ``EX_CONFIG`` from sysexits.h. The unit file lists it in
#: ``RestartPreventExitStatus=`` so systemd does not restart a daemon that would fail the same way.
EXIT_CONFIG = 78

ENV_PREFIX = "REFITD_"
#: The environment variable naming the config file (``--config`` beats it).
CONFIG_ENV = "REFITD_CONFIG"
#: ``REFITD_*`` variables that are not daemon settings; any other unknown one is an error.
#: (the Slurm launcher hands trainers and engines their endpoints in REFITD_ENDPOINT*)
NON_SETTING_ENV = frozenset(
    {CONFIG_ENV, "REFITD_ENDPOINT", "REFITD_ENDPOINTS", "REFITD_ENDPOINTS_FILE"}
    | {NATIVE_ENV, NATIVE_CC_ENV, NATIVE_DIR_ENV}
)


@dataclass(frozen=True, kw_only=True)
class DaemonConfig(
    OpsSettings, LayoutSettings, TimeoutSettings, MemorySettings, FormatSettings, IdentitySettings
):
    """Everything the daemon reads at start: the groups' fields, in the order identity, formats,
    memory, timeouts, layouts, ops (dataclasses take a base's fields last-base first). Validated on
    construction; :class:`ConfigError` lists every problem. Each field also accepts the text a file,
    variable or flag would give (``"2GiB"``, ``"mxfp8"``, ``"4"``); it is converted once, here.
    """

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        for name, spec in KNOBS.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, spec.convert(value))
            except (TypeError, ValueError) as exc:
                problems.append(Problem(f"{name} = {value!r}: {exc}", (name,)))
        bad = {p.keys[0] for p in problems}
        if not bad & {"runtime_dir", "listen"} and self.listen is None:
            object.__setattr__(self, "listen", default_listen(self.runtime_dir))
        problems.extend(value_problems(self, bad))
        if problems:
            raise ConfigError(problems)

    def replace(self, **changes: Any) -> DaemonConfig:
        """A copy with ``changes``, validated again. A default ``listen`` follows a new ``runtime_dir``."""
        unknown = [k for k in changes if k not in KNOBS]
        if unknown:
            raise ConfigError(v.unknown(f"setting {k!r}", k, list(KNOBS)) for k in unknown)
        if (
            "runtime_dir" in changes
            and "listen" not in changes
            and self.listen == default_listen(self.runtime_dir)
        ):
            changes["listen"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (str, int, float, list, None) by field name; drop the Nones for TOML."""
        return {name: v.plain(getattr(self, name)) for name in KNOBS}


#: field name -> how it is spelled and converted; the file key is the name, the variable REFITD_<NAME>
KNOBS: dict[str, Knob] = {f.name: f.metadata["knob"] for f in dataclasses.fields(DaemonConfig)}
#: field name -> the title of the group declaring it (``--help`` and the example file list them by group)
GROUP_OF: dict[str, str] = {
    name: cls.TITLE
    for cls in DaemonConfig.__mro__[1:]
    if "TITLE" in vars(cls)
    for name in vars(cls)["__annotations__"]
    if name in KNOBS
}

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_DEVICE_BUDGET",
    "DEFAULT_GPU_REGIONS",
    "ENV_PREFIX",
    "EXIT_CONFIG",
    "GROUP_OF",
    "KNOBS",
    "MAX_IPC_PATH_BYTES",
    "NON_SETTING_ENV",
    "RELOADABLE",
    "ArenaKind",
    "ConfigError",
    "DaemonConfig",
    "DrainMode",
    "Format",
    "FormatParams",
    "ForwardMover",
    "Knob",
    "LogFormat",
    "LogLevel",
    "MiB",
    "NodeLayout",
    "NodeRole",
    "Nvfp4Names",
    "Problem",
    "Residency",
    "default_listen",
    "default_runtime_dir",
    "is_loopback_host",
    "parse_size",
    "prepare_runtime_dir",
    "split_host_port",
    "tcp_host",
]
