"""Engine workers as the daemon sees them: their manifests, and who loaded which step.

An engine worker attaches with a manifest; the daemon checks its plan against it (sidecar.plan.attach)
and, where the engine holds routed experts in BF16, re-plans so that they are published in BF16.
After each publish a ``LoadRound`` waits for every engine worker attached at that moment to
acknowledge the step (``RELEASE`` with ``ok``/``error``), or times it out; the round's report goes to
the step's trainer ranks as ``LOADED``, naming every worker that failed and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.protocol.manifest import Manifest


@dataclass(slots=True)
class EngineState:
    identity: bytes
    name: str
    manifest: Manifest
    keep_bf16: frozenset[str]


@dataclass(slots=True)
class LoadRound:
    """One published step's acknowledgements from the engine workers attached when it went live."""

    step: int
    expected: dict[bytes, str]  # identity -> worker name
    trainers: list[bytes]
    deadline: float
    results: dict[bytes, dict[str, Any]] = field(default_factory=dict)

    def record(self, identity: bytes, ok: bool, error: str | None, seconds: float | None) -> None:
        if identity in self.expected and identity not in self.results:
            self.results[identity] = {
                "worker": self.expected[identity],
                "ok": bool(ok),
                "error": error,
                "seconds": seconds,
            }

    def forget(self, identity: bytes, why: str) -> None:
        """A worker that detached or was replaced before acknowledging: a failure, with the reason."""
        if identity in self.expected and identity not in self.results:
            self.results[identity] = {
                "worker": self.expected[identity],
                "ok": False,
                "error": why,
                "seconds": None,
            }

    def complete(self, now: float) -> bool:
        return len(self.results) == len(self.expected) or now >= self.deadline

    def report(self) -> dict[str, Any]:
        rows = list(self.results.values())
        for identity, name in self.expected.items():
            if identity not in self.results:
                rows.append(
                    {
                        "worker": name,
                        "ok": False,
                        "error": "did not acknowledge the step in time",
                        "seconds": None,
                    }
                )
        failed = [r for r in rows if not r["ok"]]
        if not rows:
            message = f"no engine worker was attached to load step {self.step}"
        elif failed:
            parts = [f"{r['worker']}: {r['error']}" for r in failed]
            fine = [r["worker"] for r in rows if r["ok"]]
            message = (
                f"{len(failed)} of {len(rows)} engine workers failed to load step {self.step}: "
                + "; ".join(parts)
            )
            if fine:
                message += f" (loaded it: {', '.join(fine)})"
        else:
            message = f"step {self.step} loaded by {', '.join(r['worker'] for r in rows)}"
        return {"step": self.step, "ok": bool(rows) and not failed, "results": rows, "message": message}


def new_round(
    step: int, engines: dict[bytes, EngineState], trainers: list[bytes], timeout_s: float
) -> LoadRound:
    return LoadRound(
        step=step,
        expected={i: e.name for i, e in engines.items()},
        trainers=list(trainers),
        deadline=time.monotonic() + timeout_s,
    )
