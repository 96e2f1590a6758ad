"""``refitd status``, ``refitd --version`` / ``version`` and ``refitd --help`` never import torch.

Readiness checks (``systemd/refitd-slurm.sh``) run ``refitd status`` in a loop: each run must start
in a fraction of a second, not in the seconds importing torch takes. Each check runs the command in a
fresh interpreter, with an import hook that records who imported torch, and fails naming them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from sidecar.cli import main as cli
from transport.wire import Kind, Limits, Message, decode, encode

REPO = Path(__file__).resolve().parents[1]

#: runs ``refitd ARGV...`` (``sidecar.cli.main.main``) and prints one JSON line: exit code, whether torch
#: was imported and, if it was, the stack of its first import; ``--pre CODE`` runs CODE first
_WRAPPER = r"""
import json, sys, traceback

first_import = []

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first_import:
            first_import.append("".join(traceback.format_stack(limit=25)))
        return None  # let the real finders import it: only watch

sys.meta_path.insert(0, Watch())
argv = sys.argv[1:]
if argv[:1] == ["--pre"]:
    exec(argv[1])
    argv = argv[2:]
sys.argv = ["refitd", *argv]
from sidecar.cli.main import main
try:
    rc = main()
except SystemExit as exc:
    rc = exc.code
sys.stdout.flush()
print("\n" + json.dumps({"rc": rc, "torch": "torch" in sys.modules, "stack": "".join(first_import)}))
"""


def _refitd(*argv: str, timeout: float = 120) -> tuple[dict, str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.stdout.strip(), f"no result; stderr:\n{proc.stderr}"
    *out, last = proc.stdout.rstrip("\n").split("\n")
    return json.loads(last), "\n".join(out), proc.stderr


def _assert_no_torch(result: dict) -> None:
    assert not result["torch"], f"torch was imported, first here:\n{result['stack']}"


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path / 'control.sock'}"


def test_status_with_no_daemon_fails_without_importing_torch(endpoint: str):
    result, _, err = _refitd("status", "--endpoint", endpoint, "--timeout", "0.2")
    assert result["rc"] == cli.EXIT_FAILURE, err
    assert f"no daemon answered at {endpoint}" in err
    _assert_no_torch(result)


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["version"], ["--help"], [], ["status", "--help"], ["no-such-command"]],
    ids=["--version", "version", "--help", "no-command", "status-help", "bad-command"],
)
def test_version_and_help_do_not_import_torch(argv: list[str]):
    result, out, err = _refitd(*argv)
    _assert_no_torch(result)
    if argv in (["--version"], ["version"]):
        assert result["rc"] == 0 and out.strip() == f"refitd {cli.__version__}"
    if argv == ["--help"]:  # every subcommand listed, as the full parser lists it
        assert result["rc"] == 0 and out.rstrip("\n") == cli.build_parser().format_help().rstrip("\n")
    if argv == ["no-such-command"]:
        assert result["rc"] == 2 and "invalid choice" in err


def test_the_check_sees_torch_when_it_is_imported(endpoint: str):
    """The watch itself works: the same run, with torch imported first, is reported as importing it."""
    result, _, _ = _refitd("--pre", "import torch", "status", "--endpoint", endpoint, "--timeout", "0.1")
    assert result["torch"] and "<string>" in result["stack"]


class FakeDaemon:
    """A ROUTER on ``endpoint`` answering STATUS with ``status``; records the kinds it received."""

    def __init__(self, endpoint: str, status: dict):
        self.status, self.kinds = status, []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = decode(frames, Limits())
            self.kinds.append(msg.kind)
            if msg.kind is Kind.STATUS:
                self.sock.send_multipart([ident, *encode(Message(Kind.STATUS_REPLY, self.status))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


_STATUS = {
    "instance": "abc",
    "pid": 7,
    "host": "node1",
    "listen": "ipc:///run/refitd/control.sock",
    "format": "block_fp8",
    "world_size": 1,
    "last_step": 3,
    "live": {"generation": 0, "step": 3},
    "generations": [{"generation": 0, "step": 3, "holders": 1, "segment": "seg0", "bytes": 10}],
    "trainers": [0],
    "readers": ["vllm-tp0"],
    "engines": [],
    "history": [{"step": 3, "bytes_in": 100, "bytes_out": 50, "seconds": {"total": 1.0}}],
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-00000000-0000-0000-0000-000000000001",
            "name": "NVIDIA H200",
            "memory_total": 1 << 30,
            "memory_used": 1 << 20,
            "memory_free": (1 << 30) - (1 << 20),
        }
    ],
    "arenas": [{"name": "seg0", "bytes": 10, "gpu_uuid": None}],
}


def test_status_renders_a_daemons_answer_without_importing_torch(endpoint: str):
    daemon = FakeDaemon(endpoint, _STATUS)
    try:
        result, out, err = _refitd("status", "--endpoint", endpoint, "--timeout", "30")
        json_result, json_out, _ = _refitd("status", "--endpoint", endpoint, "--timeout", "30", "--json")
    finally:
        daemon.close()
    assert result["rc"] == 0, err
    _assert_no_torch(result)
    assert "refitd abc pid 7 on node1" in out and "NVIDIA H200" in out and "seg0 (live)" in out
    assert json_result["rc"] == 0 and json.loads(json_out) == _STATUS
    _assert_no_torch(json_result)
    # the messages RefitReader.status sends: STATUS, then DETACH on close
    assert daemon.kinds == [Kind.STATUS, Kind.DETACH] * 2


def test_subcommand_list_matches_the_modules_parsers():
    """``cli.SUBCOMMAND_HELP`` (what ``refitd --help`` lists without importing the subcommands'
    modules) names every subcommand those modules define, in order, with their own help text."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {a.dest: a.help for a in sub._choices_actions}
    assert listed == {"version": "print the version and exit", **cli.SUBCOMMAND_HELP}
    assert list(listed) == ["version", *cli.SUBCOMMAND_HELP]
    for name in cli.SUBCOMMAND_HELP:  # main imports SUBCOMMAND_MODULE[name] to run it
        assert sub.choices[name].get_default("run").__module__ == cli.SUBCOMMAND_MODULE[name], name


def test_refitd_spins_briefly_unless_told_otherwise(monkeypatch):
    """``refitd`` makes OpenMP threads spin only briefly before they sleep (GOMP_SPINCOUNT=1000, for
    itself and its children: spinning threads starve the node's trainers and engines), and leaves an
    explicit spin count or wait policy alone."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cli.main(["version"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "1000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "50000")
    assert cli.main(["version"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "50000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["version"]) == 0
    assert "GOMP_SPINCOUNT" not in os.environ
