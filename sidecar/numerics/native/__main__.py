"""``python -m sidecar.numerics.native``: build the native CPU quantizers now (``make venv`` does),
so the first daemon start-up does not compile; prints the library's path.

Exits 1, saying what failed, when they cannot be built: the daemon then quantizes with the torch
reference (slower), so this is worth fixing but never fatal.
"""

from __future__ import annotations

import sys

from sidecar.numerics.native import NativeBuildError, build


def main() -> int:
    try:
        path = build()
    except NativeBuildError as err:
        print(f"refitd: native CPU quantizers not built: {err}", file=sys.stderr)
        print("refitd: the torch reference will quantize on CPU instead (slower)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
