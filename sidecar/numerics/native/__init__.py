"""The native CPU quantizers (``quant.c``, ``fourbit.c``): compiled once per machine with the system C compiler,
loaded with ctypes (which drops the GIL during each call, so threads can split one tensor).

Built as ``cc -O3 -march=native -ffp-contract=off -fno-fast-math -fPIC -shared`` into a cache
directory, under a name hashed from the source, the flags, the compiler's ``--version`` and this CPU's
``/proc/cpuinfo`` flags line (a home directory shared by machines with different CPUs never loads a
build for the wrong ``-march``). The file is written under a temporary name and renamed into place, so
daemons and tests building at once never load half a file. ``-ffp-contract=off`` is required: an FMA
would round ``x * (1 / scale)`` differently from torch.

Nothing here is ever an error for the caller: no compiler, a failed compile or ``REFITD_NATIVE=0``
gives one WARNING naming what failed, and :func:`load` returns None (the torch reference then runs,
slower). Build ahead of time with ``python -m sidecar.numerics.native``.

Environment (read by sidecar.config.environment.NativeBuild, where refitd reads its environment):

``REFITD_NATIVE``      ``0`` turns the native path off (the torch reference quantizes)
``REFITD_CC``          the C compiler command (default ``cc``; may carry words, e.g. ``ccache gcc``)
``REFITD_NATIVE_DIR``  where builds are cached (default ``$XDG_CACHE_HOME/refitd`` or ``~/.cache/refitd``)

Usage::

    from sidecar.numerics import native

    lib = native.load()           # ctypes.CDLL, or None with native.unavailable_reason() saying why
    path = native.build()         # compile now (raises NativeBuildError saying what failed)
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

from sidecar.config.environment import NativeBuild

__all__ = [
    "ABI",
    "FLAGS",
    "NativeBuildError",
    "build",
    "build_key",
    "cache_dir",
    "compiler",
    "load",
    "reset",
    "unavailable_reason",
]

log = logging.getLogger("sidecar.numerics.native")

#: the C sources compiled together into one library, and the header they share (both hashed into the key)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("quant.c", "fourbit.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("common.h", "fp8_vec.h"))
#: compile flags; -ffp-contract=off keeps every multiply and add a separately rounded operation
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
#: what ``refitd_native_abi()`` must return (bumped with any change of the entry points' signatures)
ABI = 2
#: a compile that takes longer than this has failed (a few seconds is normal)
COMPILE_TIMEOUT_S = 300.0

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "refitd_native_abi": (_int, []),
    # x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, s, s_bstride, s_rstride, begin, end
    "refitd_block_fp8": (
        _i64,
        [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64],
    ),
    "refitd_mxfp8": (_i64, [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64]),
    # x, n, k, x_bstride, x_rstride, begin, end
    "refitd_amax_bits": (_i64, [_ptr, _i64, _i64, _i64, _i64, _i64, _i64]),
    "refitd_scale_from_amax_bits": (_f32, [_i64]),
    # x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, scale, clamp, begin, end
    "refitd_fp8_per_tensor": (_i64, [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _f32, _int, _i64, _i64]),
    # x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, s, s_bstride, s_rstride, gs, begin, end
    "refitd_nvfp4": (
        _i64,
        [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _f32, _i64, _i64],
    ),
    "refitd_mxfp4": (_i64, [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64]),
    # ... s, s_bstride, s_rstride, group, scale_f32, begin, end
    "refitd_int4": (
        _i64,
        [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _int, _i64, _i64],
    ),
    "refitd_e4m3_from_f32": (None, [_ptr, _ptr, _i64]),
    "refitd_e4m3_from_f32_in_range": (None, [_ptr, _ptr, _i64]),
    # dst, src, begin, end (bytes), width, exponent mask: a passthrough copied, then checked
    "refitd_copy_check": (_i64, [_ptr, _ptr, _i64, _i64, _i64, _i64]),
    # members, first, begin, end, scales: scale groups as a pipeline (common.h's run_groups)
    "refitd_fp8_per_tensor_groups": (_i64, [_ptr, _ptr, _i64, _i64, _ptr]),
    "refitd_nvfp4_groups": (_i64, [_ptr, _ptr, _i64, _i64, _ptr]),
    # members, first, claim (an int64 counter the threads share), end, scales: the same, each thread
    # taking groups from the counter as it comes free
    "refitd_fp8_per_tensor_groups_claimed": (_i64, [_ptr, _ptr, _ptr, _i64, _ptr]),
    "refitd_nvfp4_groups_claimed": (_i64, [_ptr, _ptr, _ptr, _i64, _ptr]),
}
#: entry points a build of an older tree lacks (bench/quant.py --baseline-lib loads one): absent, the
#: callers take their other path (sidecar/numerics/native_calls.py's group_call)
OPTIONAL = frozenset(
    {
        "refitd_fp8_per_tensor_groups",
        "refitd_nvfp4_groups",
        "refitd_fp8_per_tensor_groups_claimed",
        "refitd_nvfp4_groups_claimed",
    }
)


class NativeBuildError(RuntimeError):
    """The native quantizers could not be built or loaded; the message says what failed."""


def compiler() -> list[str]:
    """The C compiler command: ``REFITD_CC`` split into words, else ``cc``."""
    return list(NativeBuild.from_env().compiler)


def cache_dir() -> Path:
    """``REFITD_NATIVE_DIR``, else ``$XDG_CACHE_HOME/refitd``, else ``~/.cache/refitd``."""
    return NativeBuild.from_env().cache_dir


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / arm64
                    return line.strip()
    except OSError:
        pass
    return ""


def _compiler_version(cc: list[str]) -> str:
    try:
        done = subprocess.run(
            [*cc, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeBuildError(f"C compiler {shlex.join(cc)!r} cannot run: {err}") from err
    if done.returncode != 0:
        raise NativeBuildError(
            f"C compiler {shlex.join(cc)!r} failed on --version (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[:300]}"
        )
    return done.stdout.strip()


def build_key(
    cc: list[str] | None = None, flags: tuple[str, ...] = FLAGS, *, version: str | None = None
) -> str:
    """Hash of what decides the built code: source, flags, compiler (and its version), CPU flags."""
    cc = compiler() if cc is None else cc
    version = _compiler_version(cc) if version is None else version
    h = hashlib.sha256()
    code = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (code, "\0".join(flags).encode(), "\0".join(cc).encode(), version.encode()):
        h.update(part)
        h.update(b"\1")
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:20]


def build(*, force: bool = False) -> Path:
    """Compile ``quant.c`` into the cache (unless that build is there already); return its path.

    Raises NativeBuildError naming the compiler and what it said.
    """
    cc = compiler()
    target = cache_dir() / f"refitd-quant-{build_key(cc)}.so"
    if target.exists() and not force:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".refitd-quant-", suffix=".so.tmp", dir=target.parent)
        os.close(fd)
    except OSError as err:
        raise NativeBuildError(f"cannot write to the native build cache {target.parent}: {err}") from err
    try:
        cmd = [*cc, *FLAGS, "-o", tmp, *(str(path) for path in SOURCES)]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise NativeBuildError(f"{shlex.join(cmd)} did not run: {err}") from err
        if done.returncode != 0:
            raise NativeBuildError(
                f"{shlex.join(cmd)} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[:500]}"
            )
        os.replace(tmp, target)  # atomic: a concurrent builder's file is as good as ours
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the native quantizers: %s", target)
    return target


def _open(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
        for fn, (restype, argtypes) in _SIGNATURES.items():
            if fn in OPTIONAL and not hasattr(lib, fn):
                continue
            getattr(lib, fn).restype = restype
            getattr(lib, fn).argtypes = argtypes
    except (OSError, AttributeError) as err:
        raise NativeBuildError(f"cannot load {path}: {err}") from err
    if lib.refitd_native_abi() != ABI:
        raise NativeBuildError(
            f"{path} has ABI {lib.refitd_native_abi()}, expected {ABI}: delete it to rebuild"
        )
    return lib


_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" (CDLL or None) and "reason" once load() ran


def _disabled() -> bool:
    return NativeBuild.from_env().disabled


def load() -> ctypes.CDLL | None:
    """The native library (building it first if needed), or None: then :func:`unavailable_reason`
    says why, logged once as a WARNING. Decided once per process (see :func:`reset`)."""
    with _lock:
        if "lib" not in _state:
            lib, reason = None, None
            if _disabled():
                reason = "REFITD_NATIVE=0"
            else:
                try:
                    lib = _open(build())
                except NativeBuildError as err:
                    reason = str(err)
            if reason is not None:
                log.warning(
                    "native CPU quantizers unavailable (%s); quantizing with the torch reference, which is slower",
                    reason,
                )
            _state.update(lib=lib, reason=reason)
        return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it loaded, or has not run yet)."""
    with _lock:
        return _state.get("reason")  # type: ignore[return-value]


def reset() -> None:
    """Forget what :func:`load` decided, so the next call looks at the environment again (tests)."""
    with _lock:
        _state.clear()
