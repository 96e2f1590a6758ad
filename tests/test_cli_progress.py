"""Progress of the CLI's long commands when stderr is not a terminal, and ``--quiet`` (issue 35).

``refitd demo`` (the real command, in a subprocess: its stderr a pipe) prints one line per long
phase and per step; ``--quiet`` none. (``refitd convert``'s lines: tests/test_convert_hostile.py.)
The terminal form is tqdm's bar: checked on a stream that says it is a terminal.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from sidecar.cli.progress import Progress

DEMO = [sys.executable, "-m", "sidecar.cli.main", "demo", "--steps", "1", "--layers", "2", "--json"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("quiet", [False, True])
def test_demo_prints_its_phases_and_steps_unless_quiet(quiet):
    out = subprocess.run(DEMO + ["--quiet"] * quiet, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("refitd demo: ")]
    if quiet:
        assert lines == [], lines
        return
    phases = [line for line in lines if " in)" in line]
    steps = [line for line in lines if " done (" in line]
    assert [p.split(": ", 1)[1].split(" ")[1] for p in phases] == ["the", "the", "2"], phases
    assert len(steps) == 1, lines
    for i, line in enumerate(steps):
        assert line.startswith(f"refitd demo: step {i + 1}/1 done (step {i}, verified): "), line
        assert "so far" in line and "left" in line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_demo_on_a_terminal_gets_a_bar_of_steps_and_its_phases_as_lines():
    term = _Terminal()
    with Progress("demo", 0, units=3, unit_name="step", stream=term) as progress:
        progress.phase("starting the daemon")
        progress.unit_done("step 0, verified")
    shown = term.getvalue()
    assert "refitd demo: starting the daemon" in shown and "1/3" in shown and "done (" not in shown
