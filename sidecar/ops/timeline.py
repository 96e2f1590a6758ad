"""Per-step timelines: ``refitd serve --timeline-dir DIR`` writes one trace file per step.

Each file is Chrome's Trace Event Format (the JSON object form), which chrome://tracing and
https://ui.perfetto.dev open as they are::

    DIR/step-000012.json          a published step, written once its engine loads are acknowledged
    DIR/step-000013-failed.json   a failed step, as far as it got (an instant event "failed" says why)

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"step": 12, "generation": 1, "bytes_in": ..., "bytes_out": ..., "seconds": {...},
                   "format": "block_fp8", "started_at": "2025-01-01T12:00:00.123456+00:00"}}

Events are complete events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds from the step's first
BEGIN) in one process ("refitd step 12") on these tracks (threads):

=========  =============================================================================================
step       ``step 12``: first BEGIN to live, its args the step's record (seconds per phase, bytes)
phases     ``wait_ranks`` (first BEGIN to the last), ``validate``, ``receive`` (READY to the last byte),
           ``publish`` (the last unit to live)
worker     ``quantize`` (first unit submitted to the last one done), and inside it one event per plan
           unit, named after its input(s), ``cat`` its kind (slab, expert, passthrough), args the unit
engine X   ``load``: one per engine worker attached at publish, from the publish for the seconds the
           worker reported (a worker that failed or timed out: ``load failed``, up to the report)
=========  =============================================================================================

Receive and quantize overlap on purpose: a layer is quantized as soon as its last byte arrives.
The observer only reads what its hooks hand it, on the serve loop; writing a file is one
``json.dump`` and an atomic rename.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.config.settings import ConfigError, Problem
from sidecar.ops.observers import Observer

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext as Daemon  # the serve loop, as it lends itself
    from sidecar.daemon.step import StepState
    from sidecar.errors import RefitError
    from sidecar.plan.build import RefitPlan

log = logging.getLogger("refitd.timeline")

PID = 1
STEP_TID, PHASES_TID, WORKER_TID, FIRST_ENGINE_TID = 1, 2, 3, 10
#: steps whose unit events are kept while waiting to publish or fail (older ones are dropped)
MAX_BUFFERED_STEPS = 4
US = 1e6


def timeline_path(directory: Path, step: int, *, failed: bool = False) -> Path:
    return Path(directory) / f"step-{step:06d}{'-failed' if failed else ''}.json"


@dataclass(slots=True)
class _Trace:
    """One step's events, relative to ``origin`` (``time.monotonic()`` of its first BEGIN)."""

    step: int
    origin: float
    other: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    published: float = 0.0

    def span(
        self, name: str, tid: int, start: float, end: float, *, cat: str = "refitd", **args: Any
    ) -> None:
        if end < start:
            return
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": round((start - self.origin) * US, 3),
            "dur": round((end - start) * US, 3),
            "pid": PID,
            "tid": tid,
        }
        if args:
            event["args"] = args
        self.events.append(event)

    def instant(self, name: str, tid: int, at: float, **args: Any) -> None:
        ts = round((at - self.origin) * US, 3)
        self.events.append(
            {"name": name, "ph": "i", "s": "t", "ts": ts, "pid": PID, "tid": tid, "args": args}
        )

    def document(self, engines: list[str]) -> dict[str, Any]:
        tracks = {STEP_TID: "step", PHASES_TID: "phases", WORKER_TID: "worker"}
        tracks |= {FIRST_ENGINE_TID + i: f"engine {name}" for i, name in enumerate(engines)}
        meta: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": PID,
                "tid": 0,
                "args": {"name": f"refitd step {self.step}"},
            }
        ]
        for tid, name in tracks.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "args": {"sort_index": tid}}
            )
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms", "otherData": self.other}


class TimelineObserver(Observer):
    """Writes ``step-NNNNNN.json`` into ``directory`` for every published (or failed) step. The
    directory is created here; ConfigError if it cannot be."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                [
                    Problem(
                        f"timeline_dir = '{self.directory}': cannot create it: {exc.strerror or exc}; give a "
                        "writable directory with --timeline-dir, or leave it unset",
                        ("timeline_dir",),
                    )
                ]
            ) from None
        self._units: dict[int, list[tuple[int, float, float]]] = {}  # step -> (unit, start, seconds)
        self._awaiting_loads: dict[int, tuple[_Trace, list[str]]] = {}  # published, engines not yet reported

    # ------------------------------------------------------------------------------------------
    # hooks

    def on_unit_done(self, daemon: Daemon, step: int, unit: int, start: float, seconds: float) -> None:
        self._units.setdefault(step, []).append((unit, start, seconds))
        while len(self._units) > MAX_BUFFERED_STEPS:
            self._units.pop(next(iter(self._units)))

    def on_step_published(self, daemon: Daemon, record: dict[str, Any], state: StepState) -> None:
        trace = self._trace(daemon, state, dict(record))
        self._awaiting_loads[state.step] = (trace, [])

    def on_step_loaded(self, daemon: Daemon, report: dict[str, Any]) -> None:
        pending = self._awaiting_loads.pop(report["step"], None)
        if pending is None:
            return
        trace, engines = pending
        now = time.monotonic()
        for row in report["results"]:
            tid = FIRST_ENGINE_TID + len(engines)
            engines.append(str(row["worker"]))
            args = {
                "worker": row["worker"],
                "ok": row["ok"],
                "error": row["error"],
                "seconds": row["seconds"],
            }
            if row["ok"] and row["seconds"] is not None:
                trace.span("load", tid, trace.published, trace.published + row["seconds"], cat="load", **args)
            else:
                end = trace.published + row["seconds"] if row["seconds"] is not None else now
                trace.span("load failed", tid, trace.published, end, cat="load", **args)
        trace.other["loads"] = {"ok": report["ok"], "message": report.get("message")}
        self._write(trace, engines, failed=False)

    def on_step_failed(self, daemon: Daemon, err: RefitError) -> None:
        state = daemon.step
        if state is None or state.step != err.step:
            return
        trace = self._trace(daemon, state, {"step": state.step, "error": err.to_wire()})
        trace.instant(
            "failed", STEP_TID, time.monotonic(), kind=err.kind.value, message=err.message, rank=err.rank
        )
        self._write(trace, [], failed=True)

    def on_stopping(self, daemon: Daemon) -> None:
        """Steps still waiting for their engines are written as they are."""
        for trace, engines in self._awaiting_loads.values():
            trace.other["loads"] = {"ok": None, "message": "the daemon stopped before every engine reported"}
            self._write(trace, engines, failed=False)
        self._awaiting_loads.clear()

    # ------------------------------------------------------------------------------------------
    # building and writing

    def _trace(self, daemon: Daemon, state: StepState, other: dict[str, Any]) -> _Trace:
        p, now = state.phases, time.monotonic()
        origin = p.first_begin or now
        wall = time.time() - (now - origin)
        other["format"] = daemon.spec.fmt.value
        other["started_at"] = datetime.fromtimestamp(wall, timezone.utc).isoformat()
        trace = _Trace(state.step, origin, other, published=p.published)
        end = p.published or now
        trace.span(f"step {state.step}", STEP_TID, origin, end, **other)
        if p.all_begun:
            trace.span("wait_ranks", PHASES_TID, origin, p.all_begun, ranks=state.world_size)
            ready = p.all_begun + p.validate
            trace.span("validate", PHASES_TID, p.all_begun, ready)
            if state.ready_sent or p.all_received:  # a forwarded step has no READY, only bytes
                trace.span("receive", PHASES_TID, ready, p.all_received or now, bytes=state.bytes_in)
        if p.published:
            trace.span("publish", PHASES_TID, max(p.quant_end, p.all_received), p.published)
        units = self._units.pop(state.step, [])
        if p.quant_start:
            trace.span(
                "quantize", WORKER_TID, p.quant_start, p.quant_end or now, busy_s=round(p.quant_busy, 6)
            )
        for index, start, seconds in units:
            self._unit_span(trace, daemon.plan, index, start, seconds)
        return trace

    @staticmethod
    def _unit_span(trace: _Trace, plan: RefitPlan | None, index: int, start: float, seconds: float) -> None:
        unit = plan.units[index] if plan is not None and index < len(plan.units) else None
        if unit is None:
            trace.span(f"unit {index}", WORKER_TID, start, start + seconds, cat="unit", unit=index)
            return
        layer = list(unit.layer) if isinstance(unit.layer, tuple) else unit.layer
        trace.span(
            " + ".join(unit.inputs),
            WORKER_TID,
            start,
            start + seconds,
            cat=unit.kind.value,
            unit=index,
            layer=layer,
            format=None if unit.fmt is None else unit.fmt.value,
            bytes_in=unit.bytes_in,
            bytes_out=unit.bytes_out,
            outputs=len(unit.outputs),
        )

    def _write(self, trace: _Trace, engines: list[str], *, failed: bool) -> None:
        path = timeline_path(self.directory, trace.step, failed=failed)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(trace.document(engines), f, separators=(",", ":"), default=str)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write the timeline of step %d to %s: %s", trace.step, path, exc)
            tmp.unlink(missing_ok=True)
            return
        log.debug(
            "timeline of step %d in %s", trace.step, path, extra={"step": trace.step, "phase": "timeline"}
        )
