"""The child processes of bench/first_contact.py (a second "process" for IPC, a kernel fault that
must not take the checking process down): ``python3 bench/first_contact_children.py NAME ARGS.json``
prints one JSON line per report and reads commands, one a line, on stdin. :class:`Child` runs one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
CHILD_TIMEOUT_S = 120

# --------------------------------------------------------------------------------------------------
# children: `first_contact_children.py NAME ARGS.json`, one JSON line per report, commands on stdin


class Child:
    def __init__(self, name: str, args: dict, env: dict | None = None):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(args, f)
        self.argfile = f
        self.proc = subprocess.Popen(
            [sys.executable, __file__, name, self.argfile.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def report(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:]
            return {"error": f"child exited ({self.proc.wait(CHILD_TIMEOUT_S)}) without a report: {err}"}
        return json.loads(line)

    def tell(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            return self.proc.wait(CHILD_TIMEOUT_S)
        finally:
            os.unlink(self.argfile.name)


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _handle(raw: str) -> dict:
    return {
        k: (bytes.fromhex(v[4:]) if isinstance(v, str) and v.startswith("hex:") else v)
        for k, v in json.loads(raw).items()
    }


def _wire(handle: dict) -> str:
    return json.dumps({k: ("hex:" + v.hex() if isinstance(v, bytes) else v) for k, v in handle.items()})


def child_map_staging(args: dict) -> None:
    import torch

    from sidecar.client.local import StagingWriter

    writer = StagingWriter(link=None)
    writer.open(_handle(args["handle"]))
    writer.arena.tensor("w").fill_(3.0)
    torch.cuda.synchronize()
    _say(device=writer.arena.device, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), pid=os.getpid())
    sys.stdin.readline()  # the parent asked nvidia-smi meanwhile
    writer.close()


def child_fault(args: dict) -> None:
    import torch
    import triton
    import triton.language as tl

    from transport.cuda_driver import default_driver, sticky_cuda_error

    @triton.jit
    def out_of_bounds(ptr):
        tl.store(ptr + (1 << 40), 1.0)  # 4 TiB past a 4-byte tensor: an illegal address

    x = torch.zeros(1, device="cuda")
    out = {}
    for what, call in (
        ("kernel", lambda: (out_of_bounds[(1,)](x), torch.cuda.synchronize())),
        ("torch after", lambda: torch.ones(4, device="cuda").sum().item()),
        ("cudaMalloc after", lambda: default_driver().malloc(0, 2 * MiB)),
    ):
        try:
            call()
            out[what] = {"failed": False}
        except Exception as exc:
            out[what] = {
                "failed": True,
                "error": f"{type(exc).__name__}: {exc}"[:300],
                "sticky": sticky_cuda_error(exc),
            }
    _say(**out)


def child_late_write(args: dict) -> None:
    import torch

    from transport.cuda_driver import default_driver

    driver = default_driver()
    ptr = driver.ipc_open(0, bytes.fromhex(args["ipc"]))
    view = driver.tensor(ptr, args["nbytes"], 0, None)
    view.fill_(0x11)
    torch.cuda.synchronize()
    _say(mapped=True)
    sys.stdin.readline()  # the parent freed it and allocated again
    try:
        view.fill_(0x5A)
        torch.cuda.synchronize()
        _say(wrote=True)
    except Exception as exc:
        _say(wrote=False, error=f"{type(exc).__name__}: {exc}"[:300])
    sys.stdin.readline()
    driver.ipc_close(0, ptr)


def child_ping(args: dict) -> None:
    _say(ok=True, args=args, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


CHILDREN = {
    "map_staging": child_map_staging,
    "fault": child_fault,
    "late_write": child_late_write,
    "ping": child_ping,
}


if __name__ == "__main__":
    CHILDREN[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
