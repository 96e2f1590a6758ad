"""Streamed refit on the engine side: load each layer group of a step as the daemon writes it, and
return to the last good generation if the step fails.

``EngineWorker.load_next`` runs :func:`load_streamed` when the worker streams (its adapter gave a
``load_group`` and ``streaming`` was not turned off) and the daemon agreed at ATTACH. The WAIT says
which step the engine holds whole (``loaded``); the daemon streams a later step only when that is the
live one, because the live generation is what a failure returns to (sidecar.daemon.streams):

* ``STREAM``: the step's generation (mapped read-only), its layer groups, and the live generation,
  held for this reader until it releases it;
* ``GROUP``: groups whose bytes are final: each is loaded at once (``load_group(gen, names)``), in
  the order they became readable, while later ones are still quantized and pushed;
* ``GENERATION`` of the streamed step: sealed; anything not yet loaded is loaded, the copy is checked
  intact (the epoch it was streamed at) and acknowledged as any load (``RELEASE``);
* ``STREAM_FAILED``, a daemon silent for ``reader_timeout_s`` (it died or hung), a daemon restart, a
  timeout, or this engine failing a group (told to the daemon, which fails the step everywhere):
  every group taken from the failed step is reloaded from the live generation, so the engine again
  holds exactly the step it held before. ``LoadResult.rolled_back`` says so.

An engine is never left on a mix of two steps without being told: a rollback that itself fails
(or finds the live generation rewritten) raises, and the next load is a whole one (what the failed
rollback began is closed first: ``finish_groups()``, vLLM's layerwise session).

Which adapters stream: the reference engines (``ReferenceEngine.load_part``) and vLLM
(``adapters.vllm.stream``: one layerwise-reload session per step; an MTP drafter is reloaded whole
from the sealed step in ``finish_groups(gen)``, before it is acknowledged). TensorRT-LLM does not: its
``model_loader.reload(model, weights, allow_partial_loading=True)`` does take a subset (the whole
path already sends one layer per call), but a reload is bracketed by model-wide steps,
``pre_reload_weights`` on every module before the first subset and ``process_weights_after_loading``
+ ``post_load_weights`` on every module after the last, under ``control_action`` (the executor
drained). Streaming would keep that executor drained while the trainer is still pushing, and a
rollback would run the model-wide processing a second time over modules it did not reload (whose
idempotence, e.g. per-tensor FP8's in-place requantization of w3/w1, is not established).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from adapters.base import Generation, RefitReader, _unknown_peer
from sidecar.errors import ErrorKind, HoldRevoked, RefitError
from transport.wire import STREAM_VERSION, Kind, Message

__all__ = ["StreamedStep", "load_streamed", "streams"]

log = logging.getLogger("refitd.engine")

#: how often the streaming loop looks at the clock while no message comes
POLL_S = 0.25
#: silence limit for a daemon that announced no reader_timeout_s
DEFAULT_SILENCE_S = 30.0


@dataclass(slots=True)
class StreamedStep:
    """A step being streamed into this engine: where it is, its groups, what was taken from it."""

    step: int
    index: int
    epoch: int | None
    target: Generation  # views of the generation being written (only readable groups are read)
    live: Generation  # the last good generation (held): what a failure returns to
    groups: list[list[str]]
    taken: list[int] = field(default_factory=list)  # groups loaded (or begun) from ``target``, in order
    seconds: float = 0.0  # time spent loading groups


def streams(reader: RefitReader) -> bool:
    """Whether the daemon agreed (ATTACHED ``stream``) to stream steps to ``reader``."""
    return reader.streaming and reader.attach_info.get("stream") == STREAM_VERSION


def load_streamed(worker: Any, min_step: int | None, timeout: float | None) -> Any:
    """``EngineWorker.load_next`` in streaming mode (see the module docstring): ``worker`` is the
    ``adapters.engine.EngineWorker`` calling (not imported here: it imports this module), and the
    result its ``LoadResult``.

    Whatever ends it, the engine never claims a step it does not hold whole: the first group of a
    step begun clears ``worker.loaded_step()`` (only a finished step or a completed rollback sets it
    again), so a ``BaseException`` (KeyboardInterrupt, CancelledError, SystemExit) that escapes
    halfway leaves a worker the daemon streams nothing to: its next load is whole. The exception
    is re-raised once the daemon was told the wait is over and the live generation let go."""
    held: list[StreamedStep | None] = [None]
    try:
        return _load_streamed(worker, min_step, timeout, held)
    except Exception:
        raise
    except BaseException:
        _abandon(worker, held[0])
        raise


def _abandon(worker: Any, stream: StreamedStep | None) -> None:
    """A BaseException ends a streamed load: cancel the wait (the daemon streams this reader nothing
    more of it) and release the live generation it held; best effort, the exception is the news."""
    if stream is not None and stream.taken:
        log.error(
            "engine worker %s: interrupted after %d groups of step %d: it holds no whole step; the next "
            "load is a whole one",
            worker.name,
            len(stream.taken),
            stream.step,
        )
        worker.forget_loaded()
    try:
        worker.reader._send(Kind.WAIT, {"cancel": True}, wait=False)
        if stream is not None:
            _release(worker.reader, stream.live)
    except Exception:  # the interrupt is what the caller must see
        log.exception("engine worker %s: telling the daemon the interrupted load is over", worker.name)


def _load_streamed(
    worker: Any, min_step: int | None, timeout: float | None, held: list[StreamedStep | None]
) -> Any:
    reader = worker.reader
    deadline = time.monotonic() + (worker.timeout if timeout is None else timeout)
    reader._send(Kind.WAIT, {"min_step": min_step, "loaded": worker.loaded_step()})
    stream: StreamedStep | None = None
    while True:
        held[0] = stream
        now = time.monotonic()
        if now >= deadline:
            reader._send(Kind.WAIT, {"cancel": True}, wait=False)
            why = f"no generation with step >= {min_step} from {reader.endpoint} within the timeout"
            if stream is not None:
                _rollback(worker, stream, why)
            raise RefitError(why, kind=ErrorKind.TIMEOUT, step=min_step)
        msg = reader.poll(min(deadline - now, POLL_S))
        if msg is None:
            if stream is not None and now - reader.last_heard > _silence_s(reader):
                why = (
                    f"the daemon at {reader.endpoint} said nothing for {_silence_s(reader):g} s while step "
                    f"{stream.step} streamed: it died or hung"
                )
                return _failed(worker, stream, why)
            continue
        if reader._from_new_instance(msg) or _unknown_peer(msg):  # the daemon restarted
            if stream is not None:
                _rollback(worker, stream, f"the daemon restarted while step {stream.step} streamed")
                stream = None
            reader._attached = False
            reader._ensure_attached(deadline)
            worker.attach_info = reader.attach_info
            if not streams(reader):
                return worker.load_whole(min_step, deadline - time.monotonic())
            reader._send(Kind.WAIT, {"min_step": min_step, "loaded": worker.loaded_step()}, deadline=deadline)
            continue
        if msg.kind is Kind.ERROR:
            if stream is not None:
                _rollback(worker, stream, f"the daemon answered an error while step {stream.step} streamed")
            raise RefitError.from_wire(msg.fields)
        if msg.kind is Kind.STREAM:
            if stream is not None:  # a new stream before the old one ended: the old step is over
                _rollback(worker, stream, f"step {msg.get('step')} streams before step {stream.step} ended")
            stream = _open(worker, msg, min_step)
        elif msg.kind is Kind.GROUP:
            if stream is None or msg.get("step") != stream.step or msg.get("generation") != stream.index:
                continue  # of a step this engine does not stream (it joined late, or it rolled back)
            failed = _load_groups(worker, stream, msg.get("ready"))
            if failed is not None:
                return failed
        elif msg.kind is Kind.STREAM_FAILED:
            if stream is None or msg.get("step") != stream.step:
                continue
            err = msg.get("error")
            text = err.get("message") if isinstance(err, dict) else None
            return _failed(
                worker, stream, f"step {stream.step} failed in the daemon: {text or 'no reason given'}"
            )
        elif msg.kind is Kind.GENERATION:
            gen = reader._generation(msg.fields)
            if min_step is not None and gen.step < min_step:  # answer to an earlier, abandoned wait
                _release(reader, gen)  # not loaded: a hold revoked meanwhile does not matter
                continue
            if stream is not None and (gen.index, gen.step) == (stream.index, stream.step):
                return _finish(worker, stream, gen)
            if stream is not None:
                _rollback(
                    worker, stream, f"step {gen.step} was handed out whole while {stream.step} streamed"
                )
            return worker.load_generation(gen)


def _silence_s(reader: RefitReader) -> float:
    limit = reader.attach_info.get("reader_timeout_s")
    ok = isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0
    return float(limit) if ok else DEFAULT_SILENCE_S


def _open(worker: Any, msg: Message, min_step: int | None) -> StreamedStep | None:
    """A STREAM: map the step's generation and the live one; None (the step is then loaded whole
    when it is published) if the message cannot be used, or if it is not one to stream on top of
    what this engine holds: a step below ``min_step`` (it answers a WAIT given up since), or a live
    generation other than the step the engine holds whole (a STREAM the daemon sent while an
    earlier WAIT still said the engine held it)."""
    reader = worker.reader
    try:
        step, index = msg.require("step", int), msg.require("generation", int)
        live_fields = msg.require("live", dict)
        key = msg.get("groups_key")
        if "groups" in msg.fields:
            groups = msg.require("groups", list)
            if not all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in groups):
                raise ValueError("STREAM groups are not lists of names")
            worker.stream_groups = (key, groups)
        elif worker.stream_groups is None or worker.stream_groups[0] != key:
            raise ValueError(f"STREAM names groups {key!r} this reader was never sent")
        groups = worker.stream_groups[1]
        target = reader._generation(
            {k: msg.fields.get(k) for k in ("generation", "step", "arena", "epoch", "epochs")}
        )
        reader._held.remove(target)  # not handed out: the daemon holds nothing for it, nothing to release
        live = reader._generation({**live_fields, "epochs": msg.fields.get("epochs")})
    except Exception as exc:  # a daemon of another version, or a garbled message: load it whole instead
        log.warning("engine worker %s: cannot stream this step (%s); it is loaded whole", worker.name, exc)
        return None
    unknown = [n for g in groups for n in g if n not in target.tensors]
    if unknown or target.index != index or target.step != step:
        log.warning(
            "engine worker %s: STREAM groups name tensors it does not publish: %s", worker.name, unknown[:3]
        )
        _release(reader, live)
        return None
    holds = worker.loaded_step()
    if (min_step is not None and step < min_step) or live.step is None or live.step != holds:
        log.info(
            "engine worker %s: not streaming step %d on top of step %s (it holds %s whole, waits for >= %s)",
            worker.name,
            step,
            live.step,
            holds,
            min_step,
        )
        _release(reader, live)
        return None
    return StreamedStep(step, index, target.epoch, target, live, groups)


def _load_groups(worker: Any, stream: StreamedStep, ready: Any) -> Any:
    """Load the readable groups ``ready``; on this engine's own failure tell the daemon (which fails
    the step everywhere), return to the live generation, and return the result."""
    if not isinstance(ready, list):
        return None
    for g in ready:
        if type(g) is not int or not 0 <= g < len(stream.groups) or g in stream.taken:
            continue
        _take(worker, stream, [g])  # before the copy: a copy that fails halfway is rolled back too
        t0 = time.perf_counter()
        try:
            worker.load_group(stream.target, stream.groups[g])
        except Exception as exc:
            error = f"group {g} of step {stream.step}: {type(exc).__name__}: {exc}"
            fields = {
                "generation": stream.index,
                "step": stream.step,
                "ok": False,
                "error": error,
                "stream": True,
            }
            worker.reader._send(Kind.RELEASE, fields, wait=False)
            return _failed(worker, stream, f"this engine failed to load {error}")
        stream.seconds += time.perf_counter() - t0
    return None


def _take(worker: Any, stream: StreamedStep, groups: list[int]) -> None:
    """Groups of ``stream`` about to be loaded: from the first one on, the engine holds no one whole
    step (``loaded_step()`` None) until the step is finished or rolled back."""
    if groups:
        worker.forget_loaded()
        stream.taken += groups


def _finish(worker: Any, stream: StreamedStep, gen: Generation) -> Any:
    """The streamed step was sealed and published: load what is left, check, acknowledge. A copy
    found torn, or a load that failed, returns the engine to the live generation first."""
    reader, error = worker.reader, None
    rest = [g for g in range(len(stream.groups)) if g not in stream.taken]
    _take(worker, stream, rest)
    t0 = time.perf_counter()
    try:
        if rest:
            worker.load_group(gen, [n for g in rest for n in stream.groups[g]])
        # the engine's per-step processing of what it loaded (vLLM: finalize, then the MTP drafter
        # reloaded from the whole step): acknowledged below only once that is done too
        worker.finish_groups(gen)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    seconds = stream.seconds + time.perf_counter() - t0
    if not (gen.intact() and (stream.epoch is None or gen.epoch == stream.epoch)):
        torn = gen.revoked_error()
        log.error("engine worker %s: %s", worker.name, torn)
        _rollback(worker, stream, str(torn))
        reader.release(gen, ok=False, error=str(torn), seconds=seconds)  # raises HoldRevoked
        raise torn
    if error is not None:  # part of the step is in the engine: return to the last good one
        _rollback(worker, stream, f"loading the rest of step {stream.step} failed: {error}")
        reader.release(gen, ok=False, error=error, seconds=seconds)
        return worker.result(stream.live.step, False, seconds, error, rolled_back=True)
    _release(reader, stream.live)
    reader.release(gen, ok=True, seconds=seconds)
    worker.loaded(gen.step)
    return worker.result(gen.step, True, seconds, None)


def _failed(worker: Any, stream: StreamedStep, why: str) -> Any:
    """The streamed step will not be sealed: return to the live generation; say so."""
    _rollback(worker, stream, why)
    worker.reader._send(Kind.WAIT, {"cancel": True}, wait=False)
    return worker.result(
        stream.live.step,
        False,
        stream.seconds,
        f"{why}; rolled back to step {stream.live.step} ({len(stream.taken)} groups reloaded)",
        rolled_back=True,
    )


def _rollback(worker: Any, stream: StreamedStep, why: str) -> None:
    """Reload every group taken from the failed step from the live generation (intact: a step never
    writes the live one, and this reader holds it), then let it go. RefitError if that fails: the
    engine then holds a mix and must load a whole generation before serving."""
    names = [n for g in stream.taken for n in stream.groups[g]]
    log.warning(
        "engine worker %s: %s; reloading %d groups from step %s",
        worker.name,
        why,
        len(stream.taken),
        stream.live.step,
    )
    problem = None
    try:
        worker.finish_groups()  # close what the failed step began (vLLM: its layerwise reload)
        if names:
            worker.load_group(stream.live, names)
            worker.finish_groups(stream.live)  # vLLM: the drafter too, from the live generation
        if not stream.live.intact():
            problem = f"generation {stream.live.index} (step {stream.live.step}) was rewritten while it was reloaded"
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
        _close_groups(worker)
    _release(worker.reader, stream.live)
    if problem is None:
        worker.loaded(stream.live.step)  # whole again: the step it held before this one streamed
    else:
        worker.forget_loaded()
        raise RefitError(
            f"engine worker {worker.name}: {why}, and reloading step {stream.live.step} failed ({problem}): "
            "its weights are a mix of two steps; load a whole generation (load_next) before serving",
            kind=ErrorKind.ENGINE,
            step=stream.step,
        )


def _close_groups(worker: Any) -> None:
    """Close what a failed rollback began (vLLM: the layerwise session its reload of a group opened),
    so that the next load -- whole -- and the next streamed step each begin their own."""
    try:
        worker.finish_groups()
    except Exception:  # the rollback's own error is the one to report
        log.exception("engine worker %s: closing the failed rollback", worker.name)


def _release(reader: RefitReader, gen: Generation) -> None:
    try:
        reader.release(gen)
    except HoldRevoked as exc:  # said by the caller's own check; nothing more to do with it here
        log.debug("release of the rollback generation: %s", exc)
