"""``integrations.megatron`` is imported by trainers: it imports refitd's client and plan only, never
the daemon, and Megatron lazily (the caller's); make test-megatron runs it against the real bridge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_importing_the_megatron_glue_loads_neither_the_daemon_nor_megatron():
    code = (
        "import json, sys; import integrations.megatron; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('sidecar.daemon', 'megatron', "
        "'transformer_engine', 'transformers')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
