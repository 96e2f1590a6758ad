"""Make PyPI's torch wheel (a CUDA build) import on a CPU-only machine, for `make test-megatron`.

Megatron-Core 0.19 and Megatron-Bridge 0.6 ship for Python >= 3.12 only, and the only CPU build of
torch on this project's machines is a cp311 wheel; PyPI's cp312 wheel is a CUDA build whose
libraries need the CUDA runtime libraries (cuBLAS, cuDNN, NCCL, ...: several GB of nvidia-*
packages). Installed with ``--no-deps``, this writes for each CUDA library torch's libraries name
(DT_NEEDED) an empty stand-in with the same soname and symbol versions, into the directory torch's
RPATH searches first (``site-packages/nvidia/cu13/lib``). With lazy binding (``TORCH_USE_RTLD_GLOBAL=1``,
which tests/support/megatron_cpu.py sets) torch then imports and runs on the CPU; a CUDA function
is never called because ``torch.cuda.is_available()`` is False (the stand-in ``libcuda.so.1``'s
``cuInit``... is absent, and so is a device). Nothing here is refitd's: it only lets the real
Megatron code run in CI.

    python tests/support/cuda_stubs.py <site-packages>
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: the libraries that are CUDA's (stood in for), by soname prefix
CUDA_PREFIXES = ("libcu", "libnv", "libnccl")


def needed(elf: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", "-W", str(elf)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def versions(elf: Path) -> dict[str, set[str]]:
    """soname -> the symbol versions ``elf`` requires of it (its version-needs section)."""
    out = subprocess.run(["readelf", "-V", "-W", str(elf)], capture_output=True, text=True, check=True).stdout
    found: dict[str, set[str]] = {}
    current = None
    for line in out.splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = m.group(1)
            found.setdefault(current, set())
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current is not None and "Version needs" not in line:
            found[current].add(m.group(1))
    return found


def undefined(elf: Path) -> list[tuple[str, str | None]]:
    """(symbol, version or None) of every symbol ``elf`` leaves undefined."""
    out = subprocess.run(
        ["readelf", "--dyn-syms", "-W", str(elf)], capture_output=True, text=True, check=True
    )
    found = []
    for line in out.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[6] == "UND" and cols[7] != "":
            name, _, version = cols[7].partition("@")
            found.append((name, version.split(" ")[0] or None))
    return found


#: unversioned symbols of these prefixes are CUDA's (put in libcudart's stand-in)
CUDA_SYMBOLS = ("cu", "nccl", "nvrtc", "nvshmem", "nvtx", "CUPTI")


def listed(names: list[str]) -> str:
    return f"global: {' '.join(n + ';' for n in names)} " if names else ""


def main(site: Path) -> None:
    torch = site / "torch"
    elves = [*sorted((torch / "lib").glob("*.so*")), *sorted(torch.glob("_C*.so"))]
    wanted: dict[str, set[str]] = {}
    for elf in elves:
        for soname in needed(elf):
            if soname.startswith(CUDA_PREFIXES):
                wanted.setdefault(soname, set())
        for soname, names in versions(elf).items():
            if soname.startswith(CUDA_PREFIXES):
                wanted.setdefault(soname, set()).update(names)
    version_lib = {v: so for so, vs in wanted.items() for v in vs}
    symbols: dict[str, dict[str, str]] = {so: {} for so in wanted}  # soname -> symbol -> version node
    for elf in elves:
        for name, version in undefined(elf):
            if version in version_lib:
                symbols[version_lib[version]][name] = version
            elif version is None and name.startswith(CUDA_SYMBOLS) and "libcudart.so.13" in symbols:
                symbols["libcudart.so.13"].setdefault(name, "")
    out = site / "nvidia" / "cu13" / "lib"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for soname, names in sorted(wanted.items()):
            # every function returns 100 (cudaErrorNoDevice, CUDA_ERROR_NO_DEVICE): never called on a CPU
            syms = symbols[soname]
            src = Path(tmp) / f"{soname}.c"
            src.write_text(
                "".join(f"int {n}(void) {{ return 100; }}\n" for n in sorted(syms)) or "int refitd_stub;\n"
            )
            nodes = {v: sorted(n for n, sv in syms.items() if sv == v) for v in names}
            plain = sorted(n for n, sv in syms.items() if not sv)
            script = Path(tmp) / f"{soname}.map"
            text = "".join(f"{v} {{ {listed(ns)}}};\n" for v, ns in sorted(nodes.items()))
            text += f"REFITD_STUB {{ {listed(plain)}local: *; }};\n"
            script.write_text(text)
            subprocess.run(
                ["cc", "-shared", "-fPIC", "-o", str(out / soname), f"-Wl,-soname,{soname}",
                 f"-Wl,--version-script={script}", str(src)],
                check=True,
            )  # fmt: skip
    print(f"cuda_stubs: {len(wanted)} stand-ins in {out}: {' '.join(sorted(wanted))}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
