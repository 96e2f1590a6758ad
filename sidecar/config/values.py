"""The values settings take: their enums, the converters from any source's text, and the errors.

Every converter takes the text a file, a variable or a flag gives (or the native value) and returns
the setting's type, or raises ValueError saying what was expected. ``Problem`` / ``ConfigError`` carry
every problem found, each naming its setting.
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from sidecar.numerics.formats import Format
from transport.arena import ArenaKind

CONTROL_SOCKET = "control.sock"
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


class NodeLayout(str, enum.Enum):
    """Where the trainer and the engines run: on this node (``colocated``), or on different nodes."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


class NodeRole(str, enum.Enum):
    """In a disaggregated layout: the daemon beside the trainer, or one beside inference engines."""

    TRAINER = "trainer"
    INFERENCE = "inference"


class Residency(str, enum.Enum):
    """Where the two generations live when the arenas are on a GPU (``arena = "cuda"``): in host
    memory, page-locked (``host``: the device holds only rings within ``device_budget``), or on the
    GPU (``device``: small models, where both generations fit the budget). Shm arenas are host."""

    HOST = "host"
    DEVICE = "device"


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


def unknown(what: str, key: str, valid: Sequence[str]) -> Problem:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return Problem(f"unknown {what}{hint} (valid: {', '.join(valid)})")


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


def optional(convert: Callable[[Any], Any], *, auto: bool = False) -> Callable[[Any], Any]:
    """``convert`` that lets None through (and the text ``auto``, when ``auto``)."""

    def optional(value: Any) -> Any:
        if value is None or (auto and isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        return convert(value)

    return optional


def to_path(value: Any) -> Path:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a path")
    return Path(value).expanduser()


def hf_config_path(value: Any) -> Path:
    """A config.json path; a model folder holding one stands for it."""
    path = to_path(value)
    return path / "config.json" if (path / "config.json").is_file() else path


def text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a non-empty string")
    return value.strip()


def count(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError("expected a whole number such as 4")


def seconds(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError("expected a number of seconds such as 10 or 0.5")


def patterns(value: Any) -> tuple[str, ...]:
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


def host_port(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9464")
    split_host_port(value)
    return value.strip()


def peer_endpoints(value: Any) -> tuple[str, ...]:
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


def gpu_list(value: Any) -> tuple[str, ...]:
    """GPUs as CUDA indices or ``GPU-`` UUIDs: a list, or one comma-separated string."""
    if isinstance(value, str):
        value = [p for p in value.split(",") if p.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            "expected GPUs (CUDA indices or GPU-... UUIDs): a list, or one comma-separated string"
        )
    out: list[str] = []
    for item in value:
        text = str(item).strip()
        if not (text.isdigit() or text.upper().startswith("GPU-")):
            raise ValueError(f"{text!r} is neither a CUDA index (0, 1, ...) nor a GPU UUID (GPU-...)")
        if text in out:
            raise ValueError(f"GPU {text!r} is listed twice")
        out.append(text)
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


def fmt(value: Any) -> Format:
    return Format.parse(value)


def choice(cls: type[enum.Enum]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"choose one of {', '.join(m.value for m in cls)}") from None

    return convert


#: the config's words for the arena kinds (``arena = "cuda"``); the handles on the wire say ``cuda_ipc``
ARENA_WORDS = {ArenaKind.SHM: "shm", ArenaKind.CUDA_IPC: "cuda"}


def arena(value: Any) -> ArenaKind:
    """The user's ``shm`` / ``cuda`` as an :class:`ArenaKind` (converted here, once)."""
    if isinstance(value, ArenaKind):
        return value
    words = {word: kind for kind, word in ARENA_WORDS.items()}
    kind = words.get(str(value).strip().lower())
    if kind is None:
        raise ValueError(f"choose one of {', '.join(words)}")
    return kind


def plain(value: Any) -> Any:
    """A setting's value as plain JSON data: enums by their config word, paths as text, lists."""
    if isinstance(value, ArenaKind):
        return ARENA_WORDS[value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return list(value) if isinstance(value, tuple) else value


# --------------------------------------------------------------------------------------------------
# how a setting is declared (with its field: sidecar.config.settings.DaemonConfig)


@dataclass(frozen=True, slots=True)
class Knob:
    """How one setting is spelled and converted, declared with its field (``field(metadata=knob(...))``).

    ``flag`` / ``metavar`` / ``help`` make its command-line flag; ``convert`` takes any source's text
    (or the native value) to the field's type. ``example`` is the TOML text the example file shows
    (default: the field's default), commented out when ``commented`` (default: when the field has
    no default); ``note`` is the example line's comment (``\n`` continues it on the next line).
    """

    flag: str
    convert: Callable[[Any], Any]
    metavar: str
    help: str
    is_path: bool = False
    example: str | None = None
    commented: bool | None = None
    note: str = ""


def knob(
    flag: str,
    convert: Callable[[Any], Any],
    metavar: str,
    help: str,
    is_path: bool = False,
    example: str | None = None,
    commented: bool | None = None,
    note: str = "",
) -> dict[str, Knob]:
    """A :class:`DaemonConfig` field's metadata: everything about the setting but its default."""
    return {"knob": Knob(flag, convert, metavar, help, is_path, example, commented, note)}
