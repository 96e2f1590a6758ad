"""The native quantizers built for another x86-64 level than this machine's ``-march=native``, for the
tests that check each build gives the reference's bytes (the code paths differ by what the build's
``-march`` has: AVX2 block maxima, AVX-512 conversions, VBMI byte tables)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from sidecar.numerics import native

#: the x86-64 levels the tests build for, and the /proc/cpuinfo flags a CPU needs to run each build
LEVELS = {
    "x86-64": frozenset(),  # SSE2: no AVX2
    "x86-64-v3": frozenset({"avx2"}),  # AVX2, no AVX-512
    # AVX-512 without VBMI (Skylake-X, Cascade Lake): fp8_vec.h once failed to compile there
    "x86-64-v4": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}


def build_for(march: str, tmp_path: Path) -> ctypes.CDLL:
    """refitd's native library compiled with refitd's flags but ``-march=<march>``, loaded; skips where this
    CPU cannot run that build."""
    lacking = LEVELS[march] - set(Path("/proc/cpuinfo").read_text().split())
    if lacking:
        pytest.skip(f"this CPU lacks {sorted(lacking)} for a {march} build")
    lib_path = tmp_path / f"refitd-quant-{march}.so"
    flags = [f for f in native.FLAGS if f != "-march=native"]
    cmd = [*native.compiler(), *flags, f"-march={march}", "-o", str(lib_path), *map(str, native.SOURCES)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{march} build failed: {done.stderr[-2000:]}"
    return native._open(lib_path)
