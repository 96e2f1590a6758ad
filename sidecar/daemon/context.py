"""What a component of the serve loop may use of it: the narrow :class:`LoopContext`.

The daemon is composed, not inherited (sidecar.daemon.loop): trainer handling
(sidecar.daemon.trainers), engine and reader handling (sidecar.daemon.engines), the step's
pipeline (sidecar.daemon.pipeline), NIXL pulls (sidecar.daemon.pull) and inbound forwarding
(sidecar.forward.receiver) are plain classes built with this context. They read the shared state
below and act through its methods; none assigns the plan or ends a step on its own: ``adopt_plan``
and ``fail_step`` / ``publish`` are the one way each happens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from transport.wire import Kind

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.load_rounds import EngineState
    from sidecar.daemon.memory.generations import Arenas, Generation
    from sidecar.daemon.peers import Peers
    from sidecar.daemon.step import StepState
    from sidecar.daemon.worker import QuantWorker
    from sidecar.daemon.workers import QuantWorkers
    from sidecar.errors import RefitError
    from sidecar.plan.build import RefitPlan, RefitSpec


class LoopContext(Protocol):
    """The serve loop as its components see it (serve-loop thread only)."""

    config: DaemonConfig
    instance: str
    spec: RefitSpec
    observers: list[Any]  # sidecar.ops.observers.Observer (which reads this context)
    engines: dict[bytes, EngineState]  # attached engine workers
    peers: Peers
    last_step: int | None
    streams: Any  # sidecar.daemon.streams.Streams (which imports this): streamed refit
    fatal: str | None  # a sticky CUDA error stopped the daemon (sidecar.daemon.faults)

    @property
    def plan(self) -> RefitPlan | None: ...

    @property
    def arenas(self) -> Arenas: ...

    @property
    def step(self) -> StepState | None: ...

    @property
    def worker(self) -> QuantWorker | QuantWorkers | None: ...

    @property
    def draining(self) -> bool: ...

    def send(self, identity: bytes, kind: Kind, fields: dict[str, Any] | None = None, frames=()) -> bool:
        """Send a reply (with this start's ``instance``); False if the peer is gone."""

    def send_error(self, identity: bytes, err: RefitError, *, untagged: bool = False) -> None:
        """Answer ``identity`` with ``err`` (``untagged``: naming no attempt); never raises."""

    def request_stop(self) -> None:
        """Stop the serve loop (a second call: without draining)."""

    def fail_step(self, err: RefitError) -> None:
        """Fail the step in progress on every rank and drop it."""

    def begin_step(self, state: StepState) -> None:
        """Make ``state`` the step in progress."""

    def end_step(self) -> None:
        """Drop the step in progress (published or failed): the one way a step ends."""

    def start_pending(self) -> None:
        """Run the BEGINs kept for a later step again, once no step is in progress."""

    def publish(
        self,
        gen: Generation,
        record: dict[str, Any],
        state: StepState,
        trainers: list[bytes],
        reply: Kind = Kind.RESULT,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Flip ``gen`` live, answer ``trainers``, start the engines' load round."""

    def adopt_plan(self, plan: RefitPlan, *, invalidate: bool = False) -> None:
        """Carve the arenas for ``plan`` (ArenaTooSmall if they cannot hold it) and use it."""

    def next_event(self) -> int:
        """A number ordering HELLOs and failures."""

    def maybe_claim(self) -> None:
        """Claim the generation a waiting step (or inbound transfer) writes, if it is free now."""

    def tensor_complete(self, name: str) -> None:
        """Every byte of input ``name`` arrived: run the units it completes."""

    def tensors_complete(self, names: list[str]) -> None:
        """Every byte of each input of ``names`` arrived: run the units they complete, together."""
