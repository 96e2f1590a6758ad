"""tests/engine_venv.sh, the steps every tests/setup_*.sh takes, run in bash against .venv's python.

The whole setups run in `make test-engines` and `make test-sglang`; these check the helper's refusals
(which a working setup never reaches) and its pyproject reading, without a network or a new venv.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(script: str, site: Path) -> subprocess.CompletedProcess:
    prelude = (
        'source tests/engine_venv.sh; who=setup_probe venv=.venv-probe py="$PY" site="$SITE"; '
        'stamp="$SITE/.stamp"; '
    )
    return subprocess.run(
        ["bash", "-c", prelude + script],
        cwd=ROOT,
        env={"PY": sys.executable, "SITE": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_failed_import_check_stops_the_setup_naming_it(tmp_path: Path):
    done = _run(
        'engine_check_import "import refitd_no_such_module" "the probe\'s loader"; echo after', tmp_path
    )
    assert done.returncode == 1 and "after" not in done.stdout
    assert "setup_probe: the probe's loader does not import in .venv-probe" in done.stderr
    assert "No module named 'refitd_no_such_module'" in done.stderr  # the real error, shown once


def test_an_import_check_that_passes_goes_on_and_the_stamp_is_written(tmp_path: Path):
    done = _run('engine_check_import "import json"; engine_venv_done; echo after', tmp_path)
    assert done.returncode == 0 and "after" in done.stdout
    assert (tmp_path / ".stamp").exists()


def test_a_torch_in_the_venv_is_refused(tmp_path: Path):
    dist = tmp_path / "torch-2.14.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.1\n")
    done = _run("engine_refuse_cuda; echo after", tmp_path)
    assert done.returncode == 1 and "after" not in done.stdout
    assert "must use .venv's CPU torch" in done.stderr and "torch==2.14.1" in done.stderr
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: msgpack\nVersion: 1.0.0\n")
    dist.rename(tmp_path / "msgpack-1.0.0.dist-info")
    assert _run("engine_refuse_cuda; echo after", tmp_path).returncode == 0


def test_pyproject_lists_are_read_as_the_setups_read_them(tmp_path: Path):
    import tomllib

    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "sglang-test"
    ]
    done = _run("pyproject_list project optional-dependencies sglang-test", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == want
