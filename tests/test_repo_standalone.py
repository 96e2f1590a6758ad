"""The repository stands on its own: no tracked file points at a file outside it.

Someone who clones refitd gets docs/spec.md (the byte contract) and docs/design.md (the decisions);
a reference to a sibling folder (``../shared/SPEC.md``, ``research/*.md``) or to a path of the
machine a file was written on (``/work/...``, ``/root/...``, a helper's ``/tmp/p26n``) is a
reference the reader cannot follow. Absolute paths that mean the same on every machine (``/dev/shm``,
``/proc``, ``/usr/bin/env``, the runtime directory's ``/tmp/refitd-<uid>`` default, ...) are not
matched, or allowed below by their exact spelling.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).relative_to(ROOT).as_posix()

#: a sibling folder of the checkout, or the background notes that lived there
OUTSIDE = re.compile(
    r"\.\./shared\b|\bshared/(?:research|SPEC|DESIGN|STYLE)\b|\bresearch/[\w-]+\.md|\b(?:SPEC|DESIGN|STYLE)\.md\b"
    r"|file:///(?:work|root|home|opt|tmp)\b"
)
#: an absolute path under a root that only exists on some build machine; /tmp is listed so that a
#: scratch path of one run is caught, and the few /tmp names the docs use on purpose are allowed
MACHINE = re.compile(
    r"(?<![\w.:/~$-])/(?:work|root|home|Users|mnt|scratch|lustre|gpfs|fsx|nfs|opt/pypi[\w-]*|tmp)"
    r"(?:/[^\s`'\")\],;:]*)?"
)
#: the absolute paths a user or test names on purpose, by exact spelling
ALLOWED = {
    "/tmp",  # a directory in a shell example, systemd's PrivateTmp, a test's fake value
    "/tmp/refitd",  # examples: a runtime directory chosen on the command line
    "/tmp/refitd-<uid>",  # the runtime directory's documented default
    "/tmp/refitd-{uid}",  # ... as the code formats it
    "/tmp/refitd-7",  # tests/test_config.py: that default for uid 7
    "/tmp/qwen3-moe",  # examples/fsdp2_trainer.py: where its --write-config example writes
    "/tmp/site",  # bench/gpu_run.sh: its default install folder on the GPU machine
    "/tmp/base",  # bench/daemon_quant.py: a `git worktree add` example
    "/tmp/x",  # tests/test_native_quant.py: a fake REFITD_NATIVE_DIR
    "/root",  # tests/test_config.py: a fake HOME
}


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    files = []
    for rel in filter(None, out.split("\0")):
        path = ROOT / rel
        if rel == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        files.append(path)
    return files


def _offences(text: str) -> list[str]:
    found = [m.group(0) for m in OUTSIDE.finditer(text)]
    found += [m.group(0) for m in MACHINE.finditer(text) if not _allowed(m.group(0).rstrip("."))]
    return found


def _allowed(path: str) -> bool:
    """An allowed path, or a file in an allowed folder (not in /tmp or /root themselves)."""
    return path in ALLOWED or any(path.startswith(a + "/") for a in ALLOWED if a not in ("/tmp", "/root"))


def test_no_tracked_file_points_outside_the_repository():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    problems = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            for hit in _offences(line):
                problems.append(f"{path.relative_to(ROOT)}:{lineno}: {hit}")
    assert not problems, (
        "tracked files name paths outside the repository (cite docs/spec.md, docs/design.md or a "
        "file in the repository instead; write machine paths as placeholders):\n  " + "\n  ".join(problems)
    )


@pytest.mark.parametrize(
    "line",
    [
        '"""FP8 quantizers: the pure-torch reference of ../shared/SPEC.md §1, exact to the byte.',
        "Two rules (../shared/DESIGN.md decision 2):",
        "# ---- the real models (research/fp8_formats.md §7)",
        "# Recipe and pitfalls: shared/research/slurm.md.",
        "(the packing unit). /work/shared/SPEC.md is not edited here.",
        '    "baseline_lib": "/tmp/p26n/quant_base.so"',
        "# Python (3.12; see /work/.library/device/KINDS.md)",
        "pip install --index-url file:///opt/pypi-more/simple x",
        "cp out.txt /home/alice/",
        "as SPEC.md demands;",
        "cat /tmp/refitdx/log /root/.cache/x",
    ],
)
def test_the_check_catches_what_it_is_for(line: str):
    assert _offences(line), line


@pytest.mark.parametrize(
    "line",
    [
        "A tensor lives in /dev/shm/refitd-gen0 until it is released.",
        "`$XDG_RUNTIME_DIR/refitd` or `/tmp/refitd-<uid>`",
        "#!/usr/bin/env bash",
        "see docs/spec.md §1.4 and SPEC §1.7",
        "https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/layers/fused_moe/layer.py",
        "python3 -m venv /opt/refitd",
        "open('/proc/self/status')",
        "--runtime-dir /tmp/refitd &",
        "refitd serve --hf-config /tmp/qwen3-moe/config.json",
    ],
)
def test_the_check_leaves_legitimate_paths_alone(line: str):
    assert not _offences(line), line
