"""Where settings come from: a TOML file, ``REFITD_*`` variables, flags; later sources win.

Each source gives ``{field: Setting}`` (the raw value and where it came from); :func:`config_from_sources`
merges them over the defaults and builds one :class:`~sidecar.config.settings.DaemonConfig`, every
problem of every source reported at once, each with its origin.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.config.runtime_dir import _default_runtime_dir
from sidecar.config.settings import (
    CONFIG_ENV,
    ENV_PREFIX,
    GROUP_OF,
    KNOBS,
    NON_SETTING_ENV,
    DaemonConfig,
)
from sidecar.config.values import ConfigError, Problem, unknown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True, slots=True)
class Setting:
    """A raw value and where it came from, e.g. ``environment variable REFITD_WORLD_SIZE``."""

    value: Any
    origin: str


def _anchor(name: str, value: Any, base: Path) -> Any:
    """A relative path setting made absolute against ``base``; anything else as it is."""
    if KNOBS[name].is_path and isinstance(value, str) and value.strip():
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
    for name, knob in KNOBS.items():
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
        if key in KNOBS:
            out[key] = Setting(_anchor(key, value, path.parent), f"key {key!r} in {path}")
        else:
            problems.append(unknown(f"key {key!r} in {path}", key, list(KNOBS)))
    return out


def _env_values(env: Mapping[str, str], problems: list[Problem]) -> dict[str, Setting]:
    out = {}
    names = [ENV_PREFIX + name.upper() for name in KNOBS]
    for var, value in sorted(env.items()):
        if not var.startswith(ENV_PREFIX) or var in NON_SETTING_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if var in names:
            out[name] = Setting(_anchor(name, value, Path.cwd()), f"environment variable {var}")
        else:
            problems.append(unknown(f"environment variable {var}", var, names))
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
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, knob in KNOBS.items():
        default = defaults[name]
        default = getattr(default, "value", default)
        shown = f"; default {default}" if default not in (None, (), dataclasses.MISSING) else ""
        title = GROUP_OF[name]
        if title not in groups:
            groups[title] = parser.add_argument_group(f"settings: {title}")
        groups[title].add_argument(
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
