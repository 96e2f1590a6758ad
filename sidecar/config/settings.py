"""The daemon's settings: one frozen :class:`DaemonConfig`, from a TOML file, ``REFITD_*``, then flags.

Later sources win: a command-line flag beats an environment variable, which beats the config file,
which beats the default. ``0`` is a value, never "unset": a source that does not mention a setting
leaves the one below it in place. Every problem in every source is collected and reported at once,
one per line, each naming where the bad value came from (``key 'world_size' in /etc/refitd.toml``,
``environment variable REFITD_WORLD_SIZE``, ``flag --world-size``) and what to give instead::

    config = load_config()          # sys.argv[1:] and os.environ; --config / REFITD_CONFIG names the file
    prepare_runtime_dir(config)     # creates runtime_dir 0700, or refuses one others can enter

A setting's file key is its field name (``world_size``), its variable ``REFITD_`` + the name in upper
case (``REFITD_WORLD_SIZE``; lists comma-separated: ``REFITD_IGNORE_PATTERNS=a,b``), its flag the one
in :data:`_KNOBS` (``--world-size``). Sizes take ``4096``, ``512MiB``, ``2GiB`` or ``1.5G`` (binary
units; ``GB`` is refused as ambiguous). Relative paths in the file are relative to the file's folder;
in a variable or flag, to the working directory. :data:`EXAMPLE_TOML` shows every key.

The dataclass never reads ``os.environ``: :func:`default_runtime_dir` receives the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import ipaddress
import logging
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from sidecar.numerics.formats import Format

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

#: Settings SIGHUP may change in a running daemon; everything else needs a restart.
RELOADABLE = frozenset(
    {
        "log_level",
        "log_format",
        "step_timeout_s",
        "rank_timeout_s",
        "heartbeat_interval_s",
        "reader_timeout_s",
        "shutdown_timeout_s",
        "drain",
        "forward_timeout_s",
    }
)

#: Exit status for a configuration error: ``EX_CONFIG`` from sysexits.h. The unit file lists it in
#: ``RestartPreventExitStatus=`` so systemd does not restart a daemon that would fail the same way.
EXIT_CONFIG = 78

ENV_PREFIX = "REFITD_"
#: The environment variable naming the config file (``--config`` beats it).
CONFIG_ENV = "REFITD_CONFIG"
#: ``REFITD_*`` variables that are not daemon settings; any other unknown one is an error.
#: (the Slurm launcher hands trainers and engines their endpoints in REFITD_ENDPOINT*)
NON_SETTING_ENV = frozenset({CONFIG_ENV, "REFITD_ENDPOINT", "REFITD_ENDPOINTS", "REFITD_ENDPOINTS_FILE"})
CONTROL_SOCKET = "control.sock"
#: staging regions when ``arena = "cuda"`` and ``staging_regions`` is unset: a whole step of BF16
#: (67 GB for Qwen3.5-35B-A3B) does not belong on a GPU the engines share; four layer groups do.
DEFAULT_GPU_REGIONS = 4
#: Longest ``ipc://`` path the kernel accepts: ``sun_path`` is 108 bytes including the final NUL.
MAX_IPC_PATH_BYTES = 107
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


class LogFormat(str, enum.Enum):
    TEXT = "text"
    JSON = "json"


class DrainMode(str, enum.Enum):
    """What SIGTERM does to a step in flight: wait for it (up to ``shutdown_timeout_s``) or abort it."""

    FINISH = "finish"
    ABORT = "abort"


class ArenaKind(str, enum.Enum):
    """Where the daemon's arenas live: POSIX shared memory, or GPU memory shared through CUDA IPC."""

    SHM = "shm"
    CUDA = "cuda"


class NodeLayout(str, enum.Enum):
    """Where the trainer and the engines run: on this node (``colocated``), or on different nodes."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


class NodeRole(str, enum.Enum):
    """In a disaggregated layout: the daemon beside the trainer, or one beside inference engines."""

    TRAINER = "trainer"
    INFERENCE = "inference"


class ForwardMover(str, enum.Enum):
    """How forwarded bytes move between nodes: NIXL where both sides have it (``auto``), only NIXL
    (``nixl``: a forwarder fails rather than fall back), or only ZeroMQ frames (``zmq``)."""

    AUTO = "auto"
    NIXL = "nixl"
    ZMQ = "zmq"


class LogLevel(str, enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def level(self) -> int:
        """The ``logging`` module's number for this level."""
        return int(getattr(logging, self.name))


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the configuration; ``keys`` are the settings it involves."""

    message: str
    keys: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.message


class ConfigError(ValueError):
    """Every problem found in the configuration, one per line. The CLI exits with :data:`EXIT_CONFIG`."""

    def __init__(self, problems: Iterable[Problem | str]) -> None:
        self.problems = tuple(p if isinstance(p, Problem) else Problem(p) for p in problems)
        super().__init__("\n".join(map(str, self.problems)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ConfigError, (self.problems,))

    def annotated(self, origins: Mapping[str, str]) -> ConfigError:
        """The same problems, each followed by where its settings came from (defaults say nothing)."""
        out = []
        for p in self.problems:
            where = [origins[k] for k in p.keys if k in origins]
            out.append(Problem(f"{p.message} (from {'; '.join(where)})" if where else p.message, p.keys))
        return ConfigError(out)


# --------------------------------------------------------------------------------------------------
# the config


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon reads at start. Validated on construction; :class:`ConfigError` lists
    every problem. Each field also accepts the text a file, variable or flag would give (``"2GiB"``,
    ``"mxfp8"``, ``"4"``); it is converted once, here.
    """

    """Where it listens. ``runtime_dir`` holds the sockets and the daemon's state and is made mode
    0700, which is what keeps other users off the sockets. ``listen`` is the control endpoint:
    ``ipc://PATH`` inside ``runtime_dir`` (default ``ipc://<runtime_dir>/control.sock``), or
    ``tcp://HOST:PORT`` for remote clients, only ever when given explicitly."""
    runtime_dir: Path
    listen: str | None = None

    """What it publishes. ``model_type`` is a registry key (``qwen3_5_moe``, ``qwen3_moe``);
    ``hf_config`` a Hugging Face config.json (or the folder holding it) from which the plan and the
    arena sizes are made at start. ``format`` is the routed experts' target format. The layer counts
    and ``ignore_patterns`` (fnmatch over module names) keep routed experts in BF16; without
    ``num_hidden_layers`` the count comes from the config or the tensor names."""
    model_type: str | None = None
    hf_config: Path | None = None
    format: Format = Format.BLOCK_FP8
    num_hidden_layers: int | None = None
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    ignore_patterns: tuple[str, ...] = ()

    """The trainer: how many ranks push each step."""
    world_size: int = 1

    """A node's share of a multi-node inference engine (sidecar.plan.build.EngineLayout): the engine
    runs expert-parallel over ``engine_ep`` ranks (and ``engine_tp``-way tensor parallel within a
    node) on ``nodes`` nodes, and this daemon plans, allocates and publishes only what the engine's
    GPUs on node ``node_rank`` hold: routed experts outside its share are dropped (trainer ranks are
    told to skip them). ``nodes = 1`` (the default) publishes the whole model. A launcher sets
    ``node_rank`` per node: ``REFITD_NODE_RANK=$SLURM_NODEID`` under Slurm, the node's index among
    the engine's nodes under Ray."""
    engine_ep: int = 1
    engine_tp: int = 1
    nodes: int = 1
    node_rank: int | None = None

    """Arena sizes in bytes, allocated once at start. None sizes them from the plan.
    ``staging_regions``: 0 stages a whole step; N streams it through N regions the size of its
    largest layer group (sidecar.daemon.memory.staging). None: 0 for shm arenas, ``DEFAULT_GPU_REGIONS`` for cuda."""
    staging_bytes: int | None = None
    publish_bytes: int | None = None
    staging_regions: int | None = None

    """Timeouts in seconds. A step not sealed within ``step_timeout_s`` is aborted; a trainer rank silent
    for ``rank_timeout_s`` mid-step is declared dead (ranks ping every ``heartbeat_interval_s``, which
    must be shorter); a reader holding a generation the daemon needs is dropped after
    ``reader_timeout_s`` (a step whose timeout would come first fails at once, naming the reader), and
    an attached reader that stops pinging (it pings every ``heartbeat_interval_s`` or more often) is
    dropped after ``reader_timeout_s`` of silence; shutdown escalates after ``shutdown_timeout_s``."""
    step_timeout_s: float = 300.0
    rank_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    reader_timeout_s: float = 30.0
    shutdown_timeout_s: float = 10.0
    drain: DrainMode = DrainMode.ABORT  # SIGTERM: abort the step in flight, or let it finish first

    """Memory: ``arena`` is ``shm`` (POSIX shared memory, any machine) or ``cuda`` (``cudaMalloc`` on
    ``gpu``, a UUID or an index, shared with trainers and engines through CUDA IPC)."""
    arena: ArenaKind = ArenaKind.SHM
    gpu: str | None = None

    """Wire limits: the largest data frame and header accepted, and the frames a remote client may have
    in flight before it waits for credit."""
    max_frame_bytes: int = 64 * MiB
    max_header_bytes: int = 16 * MiB  # a BEGIN takes ~40 B per piece (~100 with a NIXL offer)
    credit_frames: int = 8
    max_step_pieces: int = 1 << 20  # pieces all ranks may declare in one step (Qwen3.5 per expert: ~30k)

    """Logging: ``text`` or ``json`` lines, at ``debug`` / ``info`` / ``warning`` / ``error``."""
    log_format: LogFormat = LogFormat.TEXT
    log_level: LogLevel = LogLevel.INFO

    """Operations (sidecar.ops.metrics, sidecar.ops.timeline), off unless given: ``metrics_listen`` is the
    ``HOST:PORT`` of an HTTP server answering ``/healthz``, ``/readyz`` and ``/metrics`` (port 0:
    any free port); ``timeline_dir`` gets a Chrome-trace JSON file per step."""
    metrics_listen: str | None = None
    timeline_dir: Path | None = None

    """Disaggregated layout (decision 8): ``layout = "disaggregated"`` and a ``role``. A ``trainer``
    daemon forwards every generation it publishes to the inference daemons in ``peers`` (their
    ``tcp://HOST:PORT`` control endpoints); an ``inference`` daemon publishes what it is forwarded
    (it plans nothing: size its arenas with ``publish_bytes``). ``forward_timeout_s`` bounds how long
    a forwarder waits on a peer, and how long it may hold a generation for one transfer (so it must
    be below ``reader_timeout_s``). ``forward_mover`` picks how the bytes move: ``auto`` uses NIXL
    where both sides have it and ZeroMQ frames otherwise, ``zmq`` never uses NIXL, ``nixl`` makes a
    forwarder fail rather than fall back (an inference daemon treats it as ``auto``)."""
    layout: NodeLayout = NodeLayout.COLOCATED
    role: NodeRole | None = None
    peers: tuple[str, ...] = ()
    forward_timeout_s: float = 20.0
    forward_mover: ForwardMover = ForwardMover.AUTO

    """CURVE on TCP control channels (``refitd keygen NAME`` writes ``NAME.key`` and ``NAME.key.pub``).
    ``curve_secret_key`` is this daemon's keypair file (``curve_public_key`` defaults to the public
    key inside it); ``curve_allowed_keys`` a public-key file, or a folder of ``*.pub`` files, of the
    clients allowed in; ``curve_server_key`` the public key of the inference daemons a trainer
    daemon forwards to (one key for every peer). A daemon refuses to listen on a non-loopback TCP
    address, or to forward to a non-loopback peer, without them."""
    curve_secret_key: Path | None = None
    curve_public_key: Path | None = None
    curve_allowed_keys: Path | None = None
    curve_server_key: Path | None = None
    #: inference role: the trainer daemons' public keys (a file or a folder of ``*.pub``), the only
    #: clients whose FORWARD_* messages it takes; default: every key of ``curve_allowed_keys``
    curve_trainer_keys: Path | None = None

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        for name, knob in _KNOBS.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, knob.convert(value))
            except (TypeError, ValueError) as exc:
                problems.append(Problem(f"{name} = {value!r}: {exc}", (name,)))
        bad = {p.keys[0] for p in problems}
        if not bad & {"runtime_dir", "listen"} and self.listen is None:
            object.__setattr__(self, "listen", default_listen(self.runtime_dir))
        problems.extend(_value_problems(self, bad))
        if problems:
            raise ConfigError(problems)

    def replace(self, **changes: Any) -> DaemonConfig:
        """A copy with ``changes``, validated again. A default ``listen`` follows a new ``runtime_dir``."""
        unknown = [k for k in changes if k not in _KNOBS]
        if unknown:
            raise ConfigError(_unknown(f"setting {k!r}", k, list(_KNOBS)) for k in unknown)
        if (
            "runtime_dir" in changes
            and "listen" not in changes
            and self.listen == default_listen(self.runtime_dir)
        ):
            changes["listen"] = None
        return dataclasses.replace(self, **changes)

    @property
    def share(self) -> tuple[Any, int] | None:
        """``(EngineLayout, node_rank)`` when this daemon publishes one node's share of a multi-node
        engine (``nodes > 1``), for ``RefitPlan.build(share=...)``; None: the whole model."""
        if self.nodes == 1:
            return None
        from sidecar.plan.build import EngineLayout

        return EngineLayout(ep=self.engine_ep, tp=self.engine_tp, nodes=self.nodes), int(self.node_rank or 0)

    @property
    def ring_regions(self) -> int:
        """Staging regions in effect: ``staging_regions``, else 0 on shm and DEFAULT_GPU_REGIONS on cuda."""
        if self.staging_regions is not None:
            return self.staging_regions
        return DEFAULT_GPU_REGIONS if self.arena is ArenaKind.CUDA else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (str, int, float, list, None) by field name; drop the Nones for TOML."""
        out: dict[str, Any] = {}
        for name in _KNOBS:
            value = getattr(self, name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out


def default_listen(runtime_dir: Path) -> str:
    return f"ipc://{Path(runtime_dir) / CONTROL_SOCKET}"


def default_runtime_dir(env: Mapping[str, str], *, uid: int | None = None) -> Path:
    """``$RUNTIME_DIRECTORY`` (systemd's ``RuntimeDirectory=``; the first, if it lists several), else
    ``$XDG_RUNTIME_DIR/refitd``, else ``/tmp/refitd-<uid>``. Empty or relative values are skipped."""
    return _default_runtime_dir(env, uid)[0]


def _default_runtime_dir(env: Mapping[str, str], uid: int | None) -> tuple[Path, str]:
    systemd = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if os.path.isabs(systemd):
        return Path(systemd), "the default from $RUNTIME_DIRECTORY"
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "refitd", "the default from $XDG_RUNTIME_DIR"
    uid = os.getuid() if uid is None else uid
    return Path(f"/tmp/refitd-{uid}"), "the default /tmp/refitd-<uid>"


# --------------------------------------------------------------------------------------------------
# converters: the text or native value of one setting -> its type; ValueError says what was expected


def parse_size(value: int | float | str) -> int:
    """Bytes from ``4096``, ``"4096"``, ``"512MiB"``, ``"2GiB"``, ``"1.5G"`` (K, M, G, T are powers of 1024)."""
    expected = "expected a size in bytes such as 4096, 512MiB, 2GiB or 1.5G"
    if isinstance(value, bool):
        raise ValueError(expected)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        raise ValueError(expected)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if not match:
        raise ValueError(expected)
    number, unit = Decimal(match[1]), match[2].lower()
    if unit in ("kb", "mb", "gb", "tb"):
        raise ValueError(
            f"{match[2]} is ambiguous: write {match[1]}{match[2][0].upper()}iB for powers of 1024"
        )
    scale = {"": 1, "b": 1, "k": KiB, "ki": KiB, "kib": KiB, "m": MiB, "mi": MiB, "mib": MiB}
    scale |= {"g": GiB, "gi": GiB, "gib": GiB, "t": TiB, "ti": TiB, "tib": TiB}
    if unit not in scale:
        raise ValueError(f"unknown unit {match[2]!r}: {expected}")
    size = number * scale[unit]
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def _optional(convert: Callable[[Any], Any], *, auto: bool = False) -> Callable[[Any], Any]:
    """``convert`` that lets None through (and the text ``auto``, when ``auto``)."""

    def optional(value: Any) -> Any:
        if value is None or (auto and isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        return convert(value)

    return optional


def _path(value: Any) -> Path:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a path")
    return Path(value).expanduser()


def _hf_config(value: Any) -> Path:
    """A config.json path; a model folder holding one stands for it."""
    path = _path(value)
    return path / "config.json" if (path / "config.json").is_file() else path


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a non-empty string")
    return value.strip()


def _count(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError("expected a whole number such as 4")


def _seconds(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError("expected a number of seconds such as 10 or 0.5")


def _patterns(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [p for p in value.split(",") if p.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in value):
        raise ValueError(
            "expected fnmatch patterns: a list of non-empty strings, or one comma-separated string"
        )
    return tuple(p.strip() for p in value)


def split_host_port(text: str) -> tuple[str, int]:
    """``("127.0.0.1", 9464)`` from ``"127.0.0.1:9464"``; an IPv6 host comes in brackets: ``[::1]:9464``."""
    if "://" in text:
        raise ValueError("expected HOST:PORT without a scheme, e.g. 127.0.0.1:9464")
    host, colon, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("write an IPv6 address in brackets, e.g. [::1]:9464")
    if not (colon and host and port.isdigit() and int(port) <= 65535):
        raise ValueError(
            "expected HOST:PORT with a port from 0 to 65535 (0: any free port), e.g. 127.0.0.1:9464, "
            "0.0.0.0:9464 or [::1]:9464"
        )
    return host, int(port)


def _host_port(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9464")
    split_host_port(value)
    return value.strip()


def _peers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [p for p in value.split(",") if p.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ValueError("expected tcp://HOST:PORT endpoints: a list, or one comma-separated string")
    out = []
    for p in (p.strip() for p in value):
        host, colon, port = p.removeprefix("tcp://").rpartition(":")
        if not (p.startswith("tcp://") and colon and host and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{p!r} is not tcp://HOST:PORT (an inference daemon's listen endpoint)")
        out.append(p)
    return tuple(out)


def is_loopback_host(host: str) -> bool:
    """True only for addresses no other machine can reach: a literal IPv4 address in 127.0.0.0/8,
    IPv6 ``::1`` (bracketed or not, or as ``::ffff:127.x.y.z``), or the name ``localhost``.

    Any other name needs a resolver to mean something (``127.attacker.example`` resolves wherever its
    owner likes), so it is not loopback, and neither is ``*`` or an interface name."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint; None for any other scheme."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint.removeprefix("tcp://").rpartition(":")[0]


def _format(value: Any) -> Format:
    return Format.parse(value)


def _enum(cls: type[enum.Enum]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"choose one of {', '.join(m.value for m in cls)}") from None

    return convert


@dataclass(frozen=True, slots=True)
class _Knob:
    """How one field is spelled on the command line and converted from any source."""

    flag: str
    convert: Callable[[Any], Any]
    metavar: str
    help: str
    is_path: bool = False


_OPT_TEXT, _OPT_COUNT, _AUTO_SIZE = _optional(_text), _optional(_count), _optional(parse_size, auto=True)
_FORMATS = ", ".join(f.value for f in Format)

#: field name -> its flag, converter and help; the file key is the name, the variable REFITD_<NAME>.
_KNOBS: dict[str, _Knob] = {
    "runtime_dir": _Knob("--runtime-dir", _path, "DIR", "sockets and state (made mode 0700)", is_path=True),
    "listen": _Knob("--listen", _OPT_TEXT, "URL", "ipc://PATH in runtime_dir, or tcp://HOST:PORT"),
    "model_type": _Knob("--model-type", _OPT_TEXT, "TYPE", "model family: qwen3_5_moe, qwen3_moe"),
    "hf_config": _Knob(
        "--hf-config", _optional(_hf_config), "PATH", "Hugging Face config.json", is_path=True
    ),
    "format": _Knob("--format", _format, "FMT", f"routed experts' format: {_FORMATS}"),
    "num_hidden_layers": _Knob("--num-hidden-layers", _OPT_COUNT, "N", "decoder layers (default: inferred)"),
    "num_first_layers_in_bf16": _Knob("--first-bf16", _count, "N", "first N layers' experts stay BF16"),
    "num_last_layers_in_bf16": _Knob("--last-bf16", _count, "N", "last N layers' experts stay BF16"),
    "ignore_patterns": _Knob("--ignore", _patterns, "PATTERN", "fnmatch of modules kept BF16 (repeatable)"),
    "world_size": _Knob("--world-size", _count, "N", "trainer ranks that push each step"),
    "engine_ep": _Knob("--engine-ep", _count, "N", "the engine's expert-parallel size (node share)"),
    "engine_tp": _Knob("--engine-tp", _count, "N", "the engine's tensor-parallel size (node share)"),
    "nodes": _Knob("--nodes", _count, "N", "nodes the engine spans; >1 publishes this node's share only"),
    "node_rank": _Knob(
        "--node-rank", _OPT_COUNT, "N", "this node's index among --nodes (e.g. $SLURM_NODEID)"
    ),
    "staging_bytes": _Knob("--staging-bytes", _AUTO_SIZE, "SIZE", "staging arena (auto: from the plan)"),
    "publish_bytes": _Knob("--publish-bytes", _AUTO_SIZE, "SIZE", "publish arena (auto: from the plan)"),
    "staging_regions": _Knob(
        "--staging-regions",
        _OPT_COUNT,
        "N",
        f"stream steps through N layer-sized staging regions; 0: whole step (default: 0 shm, "
        f"{DEFAULT_GPU_REGIONS} cuda)",
    ),
    "step_timeout_s": _Knob("--step-timeout", _seconds, "SECONDS", "abort a step not sealed by then"),
    "rank_timeout_s": _Knob("--rank-timeout", _seconds, "SECONDS", "a rank silent this long is dead"),
    "heartbeat_interval_s": _Knob("--heartbeat-interval", _seconds, "SECONDS", "rank ping interval"),
    "reader_timeout_s": _Knob("--reader-timeout", _seconds, "SECONDS", "drop a silent reader, or its hold"),
    "shutdown_timeout_s": _Knob("--shutdown-timeout", _seconds, "SECONDS", "escalate shutdown after this"),
    "drain": _Knob("--drain", _enum(DrainMode), "MODE", "SIGTERM: abort the step in flight, or finish it"),
    "arena": _Knob("--arena", _enum(ArenaKind), "KIND", "shm (POSIX shared memory) or cuda (CUDA IPC)"),
    "gpu": _Knob("--gpu", _OPT_TEXT, "UUID|INDEX", "arena=cuda: the GPU holding the arenas (default 0)"),
    "max_frame_bytes": _Knob("--max-frame-bytes", parse_size, "SIZE", "largest data frame accepted"),
    "max_header_bytes": _Knob("--max-header-bytes", parse_size, "SIZE", "largest header accepted"),
    "credit_frames": _Knob("--credit-frames", _count, "N", "frames a remote client may have in flight"),
    "max_step_pieces": _Knob("--max-step-pieces", _count, "N", "pieces all ranks may declare in one step"),
    "log_format": _Knob("--log-format", _enum(LogFormat), "FMT", "text or json"),
    "log_level": _Knob("--log-level", _enum(LogLevel), "LEVEL", "debug, info, warning or error"),
    "metrics_listen": _Knob(
        "--metrics-listen", _optional(_host_port), "HOST:PORT", "serve /healthz, /readyz, /metrics over HTTP"
    ),
    "timeline_dir": _Knob(
        "--timeline-dir", _optional(_path), "DIR", "write a Chrome-trace JSON per step here", is_path=True
    ),
    "layout": _Knob("--layout", _enum(NodeLayout), "LAYOUT", "colocated, or disaggregated (needs --role)"),
    "role": _Knob("--role", _optional(_enum(NodeRole)), "ROLE", "disaggregated: trainer or inference"),
    "peers": _Knob("--peers", _peers, "URL[,URL]", "trainer role: inference daemons' tcp:// endpoints"),
    "forward_timeout_s": _Knob("--forward-timeout", _seconds, "SECONDS", "give up on a peer after this"),
    "forward_mover": _Knob(
        "--forward-mover", _enum(ForwardMover), "MOVER", "forwarded bytes: auto (NIXL, else zmq), nixl or zmq"
    ),
    "curve_secret_key": _Knob(
        "--curve-secret-key", _optional(_path), "PATH", "this daemon's CURVE keypair (NAME.key)", is_path=True
    ),
    "curve_public_key": _Knob(
        "--curve-public-key",
        _optional(_path),
        "PATH",
        "its public key (default: from NAME.key)",
        is_path=True,
    ),
    "curve_allowed_keys": _Knob(
        "--curve-allowed-keys", _optional(_path), "PATH", "clients' public keys: file or dir", is_path=True
    ),
    "curve_server_key": _Knob(
        "--curve-server-key", _optional(_path), "PATH", "the peers' public key (trainer role)", is_path=True
    ),
    "curve_trainer_keys": _Knob(
        "--curve-trainer-keys",
        _optional(_path),
        "PATH",
        "inference role: the trainer daemons' public keys, file or dir (default: curve_allowed_keys)",
        is_path=True,
    ),
}
_TIMEOUTS = tuple(name for name in _KNOBS if name.endswith("_s"))
_PLAN_SIZED = "too small; give a size such as 2GiB, or leave it unset to size it from the plan"


# --------------------------------------------------------------------------------------------------
# value checks, after conversion; each problem names the setting and what to do


def _value_problems(c: DaemonConfig, bad: set[str]) -> Iterable[Problem]:
    def ok(*names: str) -> bool:
        return not bad.intersection(names)

    if ok("runtime_dir") and not c.runtime_dir.is_absolute():
        bad.add("runtime_dir")
        yield Problem(f"runtime_dir = '{c.runtime_dir}' is relative: give an absolute path", ("runtime_dir",))
    if ok("runtime_dir", "listen") and c.listen is not None:
        yield from _listen_problems(c.listen, c.runtime_dir)
    if ok("model_type") and c.model_type is not None:
        from sidecar.plan.models import get_model  # the registry; imported late, it is only needed here

        try:
            get_model(c.model_type)
        except ValueError as exc:
            yield Problem(f"model_type = {c.model_type!r}: {exc}", ("model_type",))
    timelines = c.timeline_dir
    if ok("timeline_dir") and timelines is not None and timelines.exists() and not timelines.is_dir():
        yield Problem(
            f"timeline_dir = '{timelines}' is not a directory: give a directory (it is created if missing)",
            ("timeline_dir",),
        )
    if ok("hf_config") and c.hf_config is not None and not c.hf_config.is_file():
        path = c.hf_config
        yield Problem(f"hf_config = '{path}' is not a file: give the model's config.json", ("hf_config",))
    minimums = {
        "num_first_layers_in_bf16": (0, "give a layer count >= 0"),
        "num_last_layers_in_bf16": (0, "give a layer count >= 0"),
        "num_hidden_layers": (1, "give a positive count, or leave it unset to take it from the config"),
        "world_size": (1, "give the number of trainer ranks, at least 1"),
        "engine_ep": (1, "give the engine's expert-parallel size, at least 1 (1: no expert parallelism)"),
        "engine_tp": (1, "give the engine's tensor-parallel size, at least 1"),
        "nodes": (1, "give the number of nodes the engine spans, at least 1"),
        "node_rank": (0, "give this node's index among the engine's nodes, from 0"),
        "staging_bytes": (1, _PLAN_SIZED),
        "publish_bytes": (1, _PLAN_SIZED),
        "staging_regions": (0, "give 0 to stage whole steps, or a number of regions such as 4"),
        "max_frame_bytes": (1, "too small; give a size such as 64MiB"),
        "max_header_bytes": (1, "too small; give a size such as 1MiB"),
        "credit_frames": (1, "give at least 1 frame in flight"),
        "max_step_pieces": (1, "give at least 1; a real model needs up to ~1M (a piece per expert per rank)"),
    }
    for name, (least, hint) in minimums.items():
        value = getattr(c, name)
        if ok(name) and value is not None and value < least:
            bad.add(name)
            yield Problem(f"{name} = {value}: {hint}", (name,))
    for name in _TIMEOUTS:
        value = getattr(c, name)
        if ok(name) and not (math.isfinite(value) and value > 0):
            bad.add(name)
            yield Problem(f"{name} = {value}: give a positive, finite number of seconds", (name,))
    first, last, layers = c.num_first_layers_in_bf16, c.num_last_layers_in_bf16, c.num_hidden_layers
    keys = ("num_first_layers_in_bf16", "num_last_layers_in_bf16", "num_hidden_layers")
    if ok(*keys) and layers is not None and first + last > layers:
        yield Problem(
            f"num_first_layers_in_bf16 ({first}) + num_last_layers_in_bf16 ({last}) exceeds "
            f"num_hidden_layers ({layers}): lower one of them, or use format = 'bf16'",
            keys,
        )
    yield from _layout_problems(c, ok)
    yield from _share_problems(c, ok)
    keys = ("heartbeat_interval_s", "rank_timeout_s")
    if ok(*keys) and c.heartbeat_interval_s >= c.rank_timeout_s:
        yield Problem(
            f"heartbeat_interval_s ({c.heartbeat_interval_s:g}) must be less than rank_timeout_s "
            f"({c.rank_timeout_s:g}), or live ranks are declared dead between pings: lower the first "
            f"or raise the second",
            keys,
        )


_SHARE_KEYS = ("engine_ep", "engine_tp", "nodes", "node_rank")


def _share_problems(c: DaemonConfig, ok: Callable[..., bool]) -> Iterable[Problem]:
    """A node's share: a layout :class:`EngineLayout` accepts, and this node's index inside it."""
    if not ok(*_SHARE_KEYS) or (c.nodes == 1 and c.node_rank in (None, 0)):
        return
    from sidecar.plan.build import EngineLayout  # the planner; imported late, it is only needed here

    try:
        EngineLayout(ep=c.engine_ep, tp=c.engine_tp, nodes=c.nodes)
    except ValueError as exc:
        yield Problem(
            f"engine_ep = {c.engine_ep}, engine_tp = {c.engine_tp}, nodes = {c.nodes}: {exc}", _SHARE_KEYS[:3]
        )
    if c.node_rank is None:
        yield Problem(
            f"nodes = {c.nodes} needs node_rank: this node's index, 0 to {c.nodes - 1} (under Slurm "
            "REFITD_NODE_RANK=$SLURM_NODEID), so the daemon publishes that node's share",
            ("nodes", "node_rank"),
        )
    elif c.node_rank >= c.nodes:
        yield Problem(
            f"node_rank = {c.node_rank} is outside the engine's {c.nodes} node(s): give 0 to {c.nodes - 1}",
            ("nodes", "node_rank"),
        )
    if c.nodes > 1 and c.layout is NodeLayout.DISAGGREGATED:
        yield Problem(
            "nodes > 1 (a node's share) applies to layout = 'colocated': a disaggregated trainer node "
            "forwards whole generations; set nodes = 1 there",
            ("nodes", "layout"),
        )


_KEYGEN_HINT = (
    "make keys with `refitd keygen NAME` and give curve_secret_key = NAME.key and curve_allowed_keys "
    "(the clients' *.key.pub files, or a folder of them)"
)


def _layout_problems(c: DaemonConfig, ok: Callable[..., bool]) -> Iterable[Problem]:
    """The disaggregated layout's settings, and CURVE wherever a TCP endpoint leaves the machine."""
    disaggregated = c.layout is NodeLayout.DISAGGREGATED
    if ok("layout", "role") and disaggregated and c.role is None:
        yield Problem("layout = 'disaggregated' needs role = 'trainer' or 'inference'", ("layout", "role"))
    if ok("layout", "role") and not disaggregated and c.role is not None:
        yield Problem(
            f"role = {c.role.value!r} only applies to layout = 'disaggregated'; set it, or drop role",
            ("layout", "role"),
        )
    trainer = disaggregated and c.role is NodeRole.TRAINER
    if ok("peers", "role") and trainer and not c.peers:
        yield Problem(
            "role = 'trainer' needs peers: the inference daemons' endpoints, e.g. tcp://10.0.0.6:5555",
            ("peers", "role"),
        )
    if ok("peers", "role") and c.peers and not trainer:
        yield Problem("peers are only for layout = 'disaggregated' with role = 'trainer'", ("peers", "role"))
    inference = disaggregated and c.role is NodeRole.INFERENCE
    curve = ("listen", "curve_secret_key", "curve_allowed_keys")
    if ok("role", *curve) and inference and not (tcp_host(c.listen or "") and c.curve_secret_key):
        yield Problem(
            "role = 'inference' takes forwarded generations only from trainer daemons identified by their "
            "CURVE key: listen on tcp://HOST:PORT with curve_secret_key and curve_allowed_keys (the trainer "
            f"daemons' *.key.pub); {_KEYGEN_HINT}",
            ("role", *curve),
        )
    if ok("role", "curve_trainer_keys") and c.curve_trainer_keys is not None and not inference:
        yield Problem(
            "curve_trainer_keys is only for layout = 'disaggregated' with role = 'inference'",
            ("role", "curve_trainer_keys"),
        )
    keys = ("forward_timeout_s", "reader_timeout_s")
    if ok(*keys) and trainer and c.forward_timeout_s >= c.reader_timeout_s:
        yield Problem(
            f"forward_timeout_s ({c.forward_timeout_s:g}) must be less than reader_timeout_s "
            f"({c.reader_timeout_s:g}): a forwarder holds a generation while it sends it, and that hold "
            "must never be dropped under it",
            keys,
        )
    for name in (
        "curve_secret_key",
        "curve_public_key",
        "curve_allowed_keys",
        "curve_server_key",
        "curve_trainer_keys",
    ):
        path = getattr(c, name)
        if ok(name) and path is not None and not path.exists():
            yield Problem(f"{name} = '{path}' does not exist; {_KEYGEN_HINT}", (name,))
    host = tcp_host(c.listen or "")
    port = (c.listen or "").rpartition(":")[2]
    if not (host and port.isdigit() and 1 <= int(port) <= 65535):
        host = None  # not a well-formed tcp:// endpoint: _listen_problems says so
    if ok("listen") and host is not None and not is_loopback_host(host) and c.curve_secret_key is None:
        yield Problem(
            f"listen = {c.listen!r} is reachable from other machines, and refitd refuses to listen there "
            f"without CURVE (authentication and encryption): {_KEYGEN_HINT}",
            ("listen", "curve_secret_key"),
        )
    if (
        ok("listen", "curve_secret_key")
        and host is not None
        and c.curve_secret_key
        and not c.curve_allowed_keys
    ):
        yield Problem(
            "curve_secret_key is set but curve_allowed_keys is not: without an allow-list any key gets in; "
            "give the clients' public keys (a NAME.key.pub file, or a folder of them)",
            ("curve_allowed_keys",),
        )
    remote = [p for p in c.peers if not is_loopback_host(tcp_host(p) or "")]
    if ok("peers") and remote and (c.curve_server_key is None or c.curve_secret_key is None):
        yield Problem(
            f"peers {remote} are on other machines: forwarding to them needs CURVE, curve_server_key (the "
            f"inference daemons' NAME.key.pub) and curve_secret_key (this daemon's keypair); {_KEYGEN_HINT}",
            ("peers", "curve_server_key", "curve_secret_key"),
        )
    if ok("curve_server_key", "curve_secret_key") and c.curve_server_key and not c.curve_secret_key:
        yield Problem(
            "curve_server_key needs curve_secret_key too (the keypair this daemon presents to its peers)",
            ("curve_server_key", "curve_secret_key"),
        )


def _listen_problems(listen: str, runtime_dir: Path) -> Iterable[Problem]:
    keys = ("listen", "runtime_dir")
    scheme, sep, rest = listen.partition("://")
    if scheme == "ipc" and sep:
        root, path = os.path.normpath(runtime_dir), os.path.normpath(rest) if rest else ""
        if not os.path.isabs(path) or os.path.commonpath([path, root]) != root or path == root:
            yield Problem(
                f"listen = {listen!r} is outside runtime_dir {root}, whose mode 0700 keeps other users "
                f"off the socket: use ipc://{root}/{CONTROL_SOCKET}, or change runtime_dir",
                keys,
            )
        elif len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            yield Problem(
                f"listen = {listen!r}: a socket path may be at most {MAX_IPC_PATH_BYTES} bytes, this one "
                f"is {len(os.fsencode(path))}; choose a shorter runtime_dir",
                keys,
            )
    elif scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if not (colon and host and port.isdigit() and 1 <= int(port) <= 65535):
            yield Problem(
                f"listen = {listen!r}: expected tcp://HOST:PORT with a port from 1 to 65535, "
                f"e.g. tcp://10.0.0.5:5555 or tcp://*:5555",
                ("listen",),
            )
    else:
        yield Problem(
            f"listen = {listen!r}: use ipc://PATH inside runtime_dir (the default), or tcp://HOST:PORT "
            f"for clients on other nodes",
            ("listen",),
        )


def _unknown(what: str, key: str, valid: Sequence[str]) -> Problem:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return Problem(f"unknown {what}{hint} (valid: {', '.join(valid)})")


# --------------------------------------------------------------------------------------------------
# sources: each gives {field: Setting}; later ones win


@dataclass(frozen=True, slots=True)
class Setting:
    """A raw value and where it came from, e.g. ``environment variable REFITD_WORLD_SIZE``."""

    value: Any
    origin: str


def _anchor(name: str, value: Any, base: Path) -> Any:
    """A relative path setting made absolute against ``base``; anything else as it is."""
    if _KNOBS[name].is_path and isinstance(value, str) and value.strip():
        return str(base / Path(value).expanduser())
    return value


def file_to_values(path: Path) -> dict[str, Setting]:
    """The settings in a TOML file; ConfigError lists an unreadable file or every unknown key."""
    problems: list[Problem] = []
    values = _file_values(Path(path), problems)
    return _raise_if(values, problems)


def env_to_values(env: Mapping[str, str]) -> dict[str, Setting]:
    """The ``REFITD_<FIELD>`` variables in ``env``; ConfigError lists every unknown ``REFITD_`` one."""
    problems: list[Problem] = []
    values = _env_values(env, problems)
    return _raise_if(values, problems)


def args_to_values(args: argparse.Namespace) -> dict[str, Setting]:
    """The flags given in ``args`` (parsed with :func:`add_serve_arguments`); None means not given."""
    out = {}
    for name, knob in _KNOBS.items():
        value = getattr(args, name, None)
        if value is not None:
            out[name] = Setting(_anchor(name, value, Path.cwd()), f"flag {knob.flag}")
    return out


def _raise_if(values: dict[str, Setting], problems: list[Problem]) -> dict[str, Setting]:
    if problems:
        raise ConfigError(problems)
    return values


def _file_values(path: Path, problems: list[Problem]) -> dict[str, Setting]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        problems.append(
            Problem(f"cannot read config file {path}: {exc.strerror or exc}; fix --config / {CONFIG_ENV}")
        )
        return {}
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        problems.append(Problem(f"config file {path} is not valid TOML: {exc}"))
        return {}
    out = {}
    for key, value in data.items():
        if key in _KNOBS:
            out[key] = Setting(_anchor(key, value, path.parent), f"key {key!r} in {path}")
        else:
            problems.append(_unknown(f"key {key!r} in {path}", key, list(_KNOBS)))
    return out


def _env_values(env: Mapping[str, str], problems: list[Problem]) -> dict[str, Setting]:
    out = {}
    names = [ENV_PREFIX + name.upper() for name in _KNOBS]
    for var, value in sorted(env.items()):
        if not var.startswith(ENV_PREFIX) or var in NON_SETTING_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if var in names:
            out[name] = Setting(_anchor(name, value, Path.cwd()), f"environment variable {var}")
        else:
            problems.append(_unknown(f"environment variable {var}", var, names))
    return out


def config_from_sources(*layers: Mapping[str, Setting], env: Mapping[str, str]) -> DaemonConfig:
    """The config from ``layers`` (e.g. file, environment, flags; later wins) over the defaults.
    ``env`` supplies the default ``runtime_dir``. Problems name the source of each bad value."""
    return _build(layers, env, [])


def _build(
    layers: Iterable[Mapping[str, Setting]], env: Mapping[str, str], problems: list[Problem]
) -> DaemonConfig:
    merged: dict[str, Setting] = {}
    for layer in layers:
        merged.update(layer)
    if "runtime_dir" not in merged:
        merged["runtime_dir"] = Setting(*_default_runtime_dir(env, None))
    try:
        config = DaemonConfig(**{name: s.value for name, s in merged.items()})
    except ConfigError as exc:
        problems.extend(exc.annotated({name: s.origin for name, s in merged.items()}).problems)
    if problems:
        raise ConfigError(problems)
    return config


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, plus ``--config``; every default is None, so "not given" is not 0."""
    group = parser.add_argument_group("settings (flags beat REFITD_* variables, which beat the config file)")
    group.add_argument(
        "--config", dest="config_file", metavar="PATH", help=f"TOML config file [env {CONFIG_ENV}]"
    )
    defaults = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    for name, knob in _KNOBS.items():
        default = defaults[name]
        default = getattr(default, "value", default)
        shown = f"; default {default}" if default not in (None, (), dataclasses.MISSING) else ""
        group.add_argument(
            knob.flag,
            dest=name,
            default=None,
            metavar=knob.metavar,
            action="append" if name == "ignore_patterns" else "store",
            help=f"{knob.help} [env {ENV_PREFIX}{name.upper()}{shown}]",
        )


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, *, file: Path | None = None
) -> DaemonConfig:
    """The config from the file (``--config``, else ``$REFITD_CONFIG``, else ``file``), ``env``
    (default ``os.environ``) and the flags in ``args``, with every problem of every source at once."""
    env = os.environ if env is None else env
    problems: list[Problem] = []
    layers = []
    path = getattr(args, "config_file", None) or env.get(CONFIG_ENV) or file
    if path:
        layers.append(_file_values(Path(path).expanduser().absolute(), problems))
    layers.append(_env_values(env, problems))
    layers.append(args_to_values(args))
    return _build(layers, env, problems)


def load_config(
    argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None, file: Path | None = None
) -> DaemonConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) as ``refitd serve`` flags, then :func:`config_from_args`."""
    parser = argparse.ArgumentParser(prog="refitd serve")
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv), env, file=file)


def prepare_runtime_dir(config: DaemonConfig, *, uid: int | None = None) -> Path:
    """Create ``runtime_dir`` with mode 0700 if it is missing (its parent must exist), and check it:
    a directory, not a link, owned by ``uid`` (default: this process's), that nobody else can enter."""
    path, uid = config.runtime_dir, os.geteuid() if uid is None else uid
    where = "choose another directory with --runtime-dir or REFITD_RUNTIME_DIR"
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(
            [Problem(f"cannot create runtime_dir {path}: {exc.strerror or exc}; {where}", ("runtime_dir",))]
        ) from None
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if stat.S_ISLNK(st.st_mode):
        problems.append(f"runtime_dir {path} is a symbolic link; give the directory itself, or {where}")
    elif not stat.S_ISDIR(st.st_mode):
        problems.append(f"runtime_dir {path} exists and is not a directory; {where}")
    elif st.st_uid != uid:
        problems.append(
            f"runtime_dir {path} is owned by uid {st.st_uid}, not uid {uid} that refitd runs as; {where}"
        )
    elif mode & 0o077:
        problems.append(
            f"runtime_dir {path} has mode {mode:04o}: group or others can reach its sockets; "
            f"run `chmod 700 {path}`, or {where}"
        )
    elif mode & 0o700 != 0o700:
        problems.append(f"runtime_dir {path} has mode {mode:04o}: refitd needs rwx; run `chmod 700 {path}`")
    if problems:
        raise ConfigError(Problem(p, ("runtime_dir",)) for p in problems)
    return path


#: Every key of the config file, at its default; a key left out keeps its default.
EXAMPLE_TOML = """\
# refitd config: later sources win (this file < REFITD_* variables < flags).
# runtime_dir = "/run/refitd"           # default: $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/refitd, /tmp/refitd-<uid>
# listen = "tcp://*:5555"               # default: ipc://<runtime_dir>/control.sock
model_type = "qwen3_5_moe"
# hf_config = "/models/qwen3.5-35b-a3b/config.json"
format = "block_fp8"                    # block_fp8, mxfp8, fp8_per_tensor, bf16
# num_hidden_layers = 40                # default: from hf_config or the tensor names
num_first_layers_in_bf16 = 0
num_last_layers_in_bf16 = 0
ignore_patterns = []                    # fnmatch over module names, e.g. ["*.layers.0.mlp"]
world_size = 1
engine_ep = 1                           # a node's share of a multi-node engine: its expert-parallel size,
engine_tp = 1                           # its tensor-parallel size (within a node),
nodes = 1                               # the nodes it spans (1: publish the whole model),
# node_rank = 0                         # and this node's index (Slurm: REFITD_NODE_RANK=$SLURM_NODEID)
# staging_bytes = "16GiB"               # default: sized from the plan
# publish_bytes = "8GiB"                # default: sized from the plan
# staging_regions = 4                   # stream a step through N layer-sized regions, 0: stage it whole;
#                                       # default: 0 with arena = "shm", 4 with arena = "cuda"
step_timeout_s = 300
rank_timeout_s = 10
heartbeat_interval_s = 1
reader_timeout_s = 30
shutdown_timeout_s = 10
drain = "abort"                         # SIGTERM mid-step: abort it, or finish it (within shutdown_timeout_s)
arena = "shm"                           # shm, or cuda (arenas in GPU memory, CUDA IPC)
# gpu = "GPU-5c1e..."                   # arena = cuda: UUID or index of the arenas' GPU
max_frame_bytes = "64MiB"
max_header_bytes = "16MiB"
credit_frames = 8
max_step_pieces = 1048576               # pieces all ranks may declare in one step
log_format = "text"                     # text or json
log_level = "info"                      # debug, info, warning, error
# metrics_listen = "127.0.0.1:9464"     # HTTP /healthz, /readyz, /metrics; default: off
# timeline_dir = "/var/log/refitd/timelines"  # a Chrome-trace JSON per step; default: off
layout = "colocated"                    # colocated, or disaggregated (then give role)
# role = "trainer"                      # disaggregated: trainer or inference
# peers = ["tcp://10.0.0.6:5555"]       # trainer role: the inference daemons' endpoints
forward_timeout_s = 20                  # below reader_timeout_s
forward_mover = "auto"                  # auto (NIXL where both sides have it, else ZeroMQ frames), nixl, zmq
# curve_secret_key = "/etc/refitd/node.key"           # `refitd keygen node`; needed to listen on a non-loopback tcp://
# curve_public_key = "/etc/refitd/node.key.pub"       # default: read from curve_secret_key
# curve_allowed_keys = "/etc/refitd/clients"          # a *.key.pub file or a folder of them
# curve_server_key = "/etc/refitd/inference.key.pub"  # trainer role: the inference daemons' public key
# curve_trainer_keys = "/etc/refitd/trainers"         # inference role: who may forward; default: curve_allowed_keys
"""
