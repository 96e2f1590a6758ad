"""The environment outside the daemon's settings: the native CPU quantizers' build and Triton's
interpreter switch. Not :class:`~sidecar.config.settings.DaemonConfig` fields (``refitd convert``,
the benches and the tests need them with no daemon config), but read here, in the config package,
so refitd's environment is read in one place; ``sidecar.numerics`` imports only this of sidecar."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: The native CPU quantizers' build (:class:`NativeBuild`): ``0`` turns them off, the C compiler
#: command, where builds are cached.
NATIVE_ENV, NATIVE_CC_ENV, NATIVE_DIR_ENV = "REFITD_NATIVE", "REFITD_CC", "REFITD_NATIVE_DIR"


@dataclass(frozen=True, slots=True)
class NativeBuild:
    """How the native CPU quantizers are built (sidecar.numerics.native). Not DaemonConfig fields:
    ``refitd convert``, the benches and the tests build them too, with no daemon config; read from
    the environment each time it is asked for (:meth:`from_env`), so a test may change it."""

    disabled: bool  # REFITD_NATIVE=0 (or false, no, off): the torch reference quantizes
    compiler: tuple[str, ...]  # REFITD_CC split into words (``ccache gcc``), else ``cc``
    cache_dir: Path  # REFITD_NATIVE_DIR, else $XDG_CACHE_HOME/refitd, else ~/.cache/refitd

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NativeBuild:
        """From ``env`` (default ``os.environ``)."""
        env = os.environ if env is None else env
        explicit, xdg = env.get(NATIVE_DIR_ENV), env.get("XDG_CACHE_HOME")
        cache = Path(explicit) if explicit else (Path(xdg) if xdg else Path.home() / ".cache") / "refitd"
        return cls(
            disabled=env.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "no", "off"),
            compiler=tuple(shlex.split(env.get(NATIVE_CC_ENV, "") or "cc")) or ("cc",),
            cache_dir=cache,
        )


def triton_interpret_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether Triton's ``TRITON_INTERPRET`` (its CPU interpreter: tests only) is on in ``env``
    (default ``os.environ``): what a Triton before 3.4, which has no ``knobs`` to ask, goes by."""
    env = os.environ if env is None else env
    return env.get("TRITON_INTERPRET", "0") not in ("", "0")
