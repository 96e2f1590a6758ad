"""One engine worker's side of a refit: attach with a manifest, load each generation, acknowledge.

Every engine adapter (reference, vLLM, TensorRT-LLM) is this class plus two engine-specific
functions: one that builds the manifest from the loaded model, one that copies a generation into
the engine's parameters. The driver side collects every worker's ``LoadResult`` with
``check_results``, which fails loudly when any worker failed, or when none answered.

    worker = EngineWorker(endpoint, name="vllm-tp0", manifest=build_manifest, load=load_into_model,
                          check=check_vllm_constraints)   # the adapter's own rules: required for vLLM
    worker.attach()                       # refused, listing every mismatch, if the plan disagrees
    result = worker.load_next(min_step=7) # wait, copy out, acknowledge, release
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from adapters.base import Generation, RefitReader
from adapters.stream import load_streamed, streams
from sidecar.errors import ErrorKind, HoldRevoked, RefitError
from sidecar.protocol.manifest import EngineKind, Manifest

__all__ = ["EngineWorker", "LoadResult", "check_results", "engine_problems"]

log = logging.getLogger("refitd.engine")


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one worker did with one generation; plain data so it survives any RPC."""

    worker: str
    step: int | None
    ok: bool
    seconds: float = 0.0
    error: str | None = None
    #: streamed refit: the step failed (or this engine failed part of it) after the engine had loaded
    #: part of it, and those parts were reloaded from the last good generation (``step``)
    rolled_back: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_any(cls, value: LoadResult | Mapping[str, Any]) -> LoadResult:
        if isinstance(value, LoadResult):
            return value
        if not isinstance(value, Mapping):
            return cls(
                worker="?",
                step=None,
                ok=False,
                error=f"a worker returned {type(value).__name__}, not a result",
            )
        return cls(
            worker=str(value.get("worker", "?")),
            step=value.get("step"),
            ok=bool(value.get("ok", False)),
            seconds=float(value.get("seconds", 0.0)),
            error=value.get("error"),
            rolled_back=value.get("rolled_back") is True,
        )


class EngineWorker:
    def __init__(
        self,
        endpoint: str,
        *,
        name: str,
        manifest: Manifest | Callable[[], Manifest],
        load: Callable[[Generation], None],
        timeout: float = 600.0,
        check: Callable[[Manifest], list[str]] | None = None,
        load_group: Callable[[Generation, Sequence[str]], None] | None = None,
        streaming: bool | None = None,
    ):
        """``check``: the adapter's own constraint check (``adapters.vllm.check_vllm_constraints``,
        ``adapters.trtllm.check_trtllm_constraints``), required for those engines' manifests and run
        on every attach before the daemon is contacted; any problem refuses the attach. Without one
        (the reference engine) the manifest's :class:`~sidecar.protocol.manifest.EngineConstraints` are run.

        ``load_group(gen, names)``: copy just the tensors ``names`` of ``gen`` into the engine (any
        subset, any number of times: a rollback reloads a subset from the previous generation); an
        optional ``load_group.finish(whole)`` is called once the groups of a step (or of a rollback)
        are all in, for engines that process weights per reload (``adapters.vllm.stream``), with the
        whole generation they complete, or None when a failed step is abandoned. With it the
        worker streams by default (``adapters.stream``: each layer group is loaded while later
        ones are still arriving); ``streaming=False`` turns that off and loads whole generations."""
        if streaming and load_group is None:
            raise ValueError(f"{name}: streaming=True needs the adapter's load_group (it loads a subset)")
        self.endpoint, self.name, self.timeout = endpoint, name, timeout
        self._manifest, self._load, self._check = manifest, load, check
        self._load_group = load_group
        self.streaming = load_group is not None if streaming is None else bool(streaming)
        self.reader: RefitReader | None = None
        self.attach_info: dict[str, Any] = {}
        self._loaded: tuple[str | None, int] | None = None  # (daemon instance, step) the engine holds whole
        self.stream_groups: tuple[Any, list[list[str]]] | None = None  # the daemon's groups, by key

    def manifest(self) -> Manifest:
        return self._manifest() if callable(self._manifest) else self._manifest

    def attach(self, timeout: float | None = None) -> dict[str, Any]:
        """Attach with this worker's manifest; RefitError listing every mismatch if refused (by the
        adapter's own check first, then by the daemon)."""
        if self.reader is None:
            manifest = self.manifest()
            problems = engine_problems(manifest, self._check)
            if problems:
                lines = "\n".join(f"  - {p}" for p in problems)
                raise RefitError(
                    f"{self.name}: this {manifest.engine.value} engine cannot take refitd's generations:\n{lines}",
                    kind=ErrorKind.ENGINE,
                )
            self.reader = RefitReader(
                self.endpoint,
                name=self.name,
                timeout=self.timeout,
                manifest=manifest,
                streaming=self.streaming,
            )
        self.attach_info = self.reader.attach(timeout=timeout)
        return self.attach_info

    def load_next(self, min_step: int | None = None, timeout: float | None = None) -> LoadResult:
        """Wait for a generation >= ``min_step``, load it, acknowledge and release it.

        Raises :class:`~sidecar.errors.HoldRevoked` when the load outlasted the daemon's
        ``reader_timeout_s`` and the daemon rewrote the generation meanwhile: the engine's weights
        may be torn (a mix of two steps). The daemon (and the trainer's LOADED report) is told
        ``ok=False`` with that error first; the engine must then load the next generation
        (``load_next`` again) before serving."""
        if self.reader is None:
            self.attach(timeout)
        self.reader._ensure_attached(time.monotonic() + (self.timeout if timeout is None else timeout))
        self.attach_info = self.reader.attach_info
        if streams(self.reader):
            return load_streamed(self, min_step, timeout)  # each layer group as it is written
        return self.load_whole(min_step, timeout)

    def load_whole(self, min_step: int | None = None, timeout: float | None = None) -> LoadResult:
        """``load_next`` without streaming: wait until the whole generation is published, load it."""
        gen = self.reader.wait(min_step=min_step, timeout=timeout)  # re-attaches if the daemon restarted
        self.attach_info = self.reader.attach_info
        return self.load_generation(gen)

    def load_generation(self, gen: Generation) -> LoadResult:
        """Load the published generation ``gen`` whole, check it intact, acknowledge and release it."""
        t0 = time.perf_counter()
        error = None
        self._loaded = None  # until this load is whole and intact, the engine holds no one step
        try:
            self._load(gen)
        except Exception as exc:  # reported to the daemon and the caller, never swallowed
            error = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # interrupted: acknowledged as failed (best effort), re-raised
            try:
                self.reader.release(gen, ok=False, error=f"interrupted: {type(exc).__name__}")
            except Exception:  # a revoked hold, a closed socket: the interrupt is the news
                log.exception("engine worker %s: acknowledging the interrupted load", self.name)
            raise
        seconds = time.perf_counter() - t0
        if not gen.intact():  # checked after the copies finished, before acknowledging
            torn = gen.revoked_error()
            log.error("engine worker %s: %s", self.name, torn)
            self.reader.release(gen, ok=False, error=str(torn), seconds=seconds)  # raises HoldRevoked
            raise torn  # (a release that did not raise: the epoch moved on after all; still torn)
        self.reader.release(gen, ok=error is None, error=error, seconds=seconds)
        if error is None:
            self.loaded(gen.step)
        return LoadResult(worker=self.name, step=gen.step, ok=error is None, seconds=seconds, error=error)

    # ---- what the engine holds (streamed refit streams only on top of a whole, known step)

    def result(
        self, step: int | None, ok: bool, seconds: float, error: str | None, *, rolled_back: bool = False
    ) -> LoadResult:
        return LoadResult(self.name, step, ok, seconds, error, rolled_back)

    def load_group(self, gen: Generation, names: Sequence[str]) -> None:
        """Copy the tensors ``names`` of ``gen`` into the engine (the adapter's ``load_group``)."""
        self._load_group(gen, names)

    def finish_groups(self, whole: Generation | None = None) -> None:
        """The groups loaded since the last call are all there will be for now (a streamed step was
        sealed, or a rollback begins or ended): the adapter's ``load_group.finish(whole)``, if it has
        one, runs the engine's processing of them (vLLM: ``finalize_layerwise_reload``) and whatever
        it derives from the whole generation (vLLM: the MTP drafter's reload). ``whole``: the
        generation now complete in the engine (the sealed step, or the live one a rollback
        reloaded); None when a rollback begins (the failed step's groups are abandoned)."""
        finish = getattr(self._load_group, "finish", None)
        if callable(finish):
            finish(whole)

    def loaded(self, step: int) -> None:
        self._loaded = (self.reader.instance if self.reader is not None else None, step)

    def forget_loaded(self) -> None:
        self._loaded = None

    def loaded_step(self) -> int | None:
        """The step this engine holds whole, loaded from the daemon start it is attached to (None:
        none, or from an earlier start): the daemon streams only on top of it."""
        if self._loaded is None or self.reader is None or self._loaded[0] != self.reader.instance:
            return None
        return self._loaded[1]

    def load_intact(
        self, min_step: int | None = None, timeout: float | None = None, *, attempts: int = 3
    ) -> LoadResult:
        """``load_next``, again (up to ``attempts`` in all) while a load is found torn: each
        HoldRevoked was acknowledged ok=False, and the next try gets the newest generation. For an
        engine loop that must end up serving intact weights of step >= ``min_step``."""
        if attempts < 1:
            raise ValueError(f"attempts={attempts}: give at least 1")
        for attempt in range(1, attempts):
            try:
                return self.load_next(min_step=min_step, timeout=timeout)
            except HoldRevoked as exc:
                log.warning(
                    "engine worker %s: loading the next generation (attempt %d): %s",
                    self.name,
                    attempt + 1,
                    exc,
                )
        return self.load_next(min_step=min_step, timeout=timeout)

    def detach(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


#: engines whose adapters carry rules beyond the shared constraints: their check must be passed
ADAPTER_CHECKS = {
    EngineKind.VLLM: "adapters.vllm.check_vllm_constraints",
    EngineKind.TRTLLM: "adapters.trtllm.check_trtllm_constraints",
    EngineKind.SGLANG: "adapters.sglang.check_sglang_constraints",
}


def engine_problems(manifest: Manifest, check: Callable[[Manifest], list[str]] | None) -> list[str]:
    """What refuses ``manifest`` before the daemon is asked: the adapter's ``check`` (which runs the
    shared :class:`~sidecar.protocol.manifest.EngineConstraints` rules too), else those rules alone. A vLLM or
    TRT-LLM manifest without its adapter's check is a programming error, not a pass."""
    if check is not None:
        return list(check(manifest))
    needed = ADAPTER_CHECKS.get(manifest.engine)
    if needed is not None:
        raise TypeError(
            f"a {manifest.engine.value} EngineWorker needs its adapter's check: pass check={needed.rsplit('.', 1)[1]} "
            f"(from {needed.rsplit('.', 1)[0]}); attaching without it skips the engine's own rules"
        )
    return manifest.constraints.problems()


def check_results(
    results: Sequence[LoadResult | Mapping[str, Any]], *, step: int | None = None
) -> list[LoadResult]:
    """Every worker's result, checked: RefitError naming each failed worker (and the others' state).

    An empty list is a failure, not a success: no worker loaded anything.
    """
    parsed = [LoadResult.from_any(r) for r in results]
    if not parsed:
        raise RefitError("no engine worker reported a load result", kind=ErrorKind.ENGINE, step=step)
    failed = [r for r in parsed if not r.ok or (step is not None and r.step is not None and r.step < step)]
    if failed:
        lines = [f"{r.worker}: {r.error or f'loaded step {r.step}, expected {step}'}" for r in failed]
        fine = [f"{r.worker} loaded step {r.step}" for r in parsed if r not in failed]
        message = f"{len(failed)} of {len(parsed)} engine workers failed: " + "; ".join(lines)
        if fine:
            message += " (" + ", ".join(fine) + ")"
        raise RefitError(message, kind=ErrorKind.ENGINE, step=step)
    return parsed
