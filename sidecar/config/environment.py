"""The environment outside the daemon's settings: the native CPU quantizers' build, Triton's
interpreter switch and OpenMP's wait policy. Not :class:`~sidecar.config.settings.DaemonConfig` fields (``refitd convert``,
the benches and the tests need them with no daemon config), but read here, in the config package,
so refitd's environment is read in one place; ``sidecar.numerics`` imports only this of sidecar."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, MutableMapping
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


#: OpenMP (libgomp, torch's on Linux) threads that wait by spinning take the cores refitd shares with
#: trainers and engines, and each other's: on the 2-core CI machine `refitd demo`'s quantize time per
#: step went from a 276 ms median (worst 1.8 s) to 41 ms with a short spin before sleeping, while one
#: daemon alone quantizes as fast as with the default (OMP_WAIT_POLICY=PASSIVE lost 20-33% there).
GOMP_SPINCOUNT = "1000"


def brief_openmp_spin(environ: MutableMapping[str, str] = os.environ) -> None:
    """``GOMP_SPINCOUNT=1000`` unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set: ``refitd`` (and
    the benches that measure its CPU path) call this before torch loads, since libgomp reads it once."""
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
