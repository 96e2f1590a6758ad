"""verl's actor worker group as ``RefitdCheckpointEngineManager`` sees it, for tests/test_integration_verl.py
and tests/test_live_verl.py: verl's DP_COMPUTE dispatch of ``execute_checkpoint_engine`` and
``update_weights`` over refitd backends built by verl's registry, the ranks as threads (verl runs them
as Ray workers), every rank handed the same gathered weights, as verl's FSDP ranks hand them."""

from __future__ import annotations

import asyncio
import threading


class ActorGroup:
    """verl's actor worker group as the manager sees it: ``update_weights(global_steps, mode)`` runs
    each rank's ``send_weights`` (the real refitd backend, built by verl's registry) with the same
    gathered weights, as verl's FSDP ranks hand them."""

    def __init__(self, engines, events: list[str], weights_of):
        self.engines, self.events, self.weights_of = engines, events, weights_of
        self.world_size = len(engines)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list):
        """verl's DP_COMPUTE dispatch: entry i of each list goes to worker i."""
        self.events.append(f"{method[0]}:")
        return [
            getattr(e, method[i])(**{k: v[i] for k, v in kwargs.items()}) for i, e in enumerate(self.engines)
        ]

    def update_weights(self, global_steps=None, mode="auto"):
        assert mode == "refitd"
        self.events.append(f"push:{global_steps}")
        weights = self.weights_of(global_steps)
        out: list = [None] * len(self.engines)

        def rank(r):
            stream = ((n, t.float()) for n, t in weights.items())
            try:
                out[r] = asyncio.run(self.engines[r].send_weights(stream, global_steps=global_steps))
            except BaseException as exc:
                out[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(self.engines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.events.append(f"pushed:{global_steps}")
        for r in out:
            if isinstance(r, BaseException):
                raise r
        return out
