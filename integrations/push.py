"""What every framework backend's trainer side does: push a framework's stream of gathered tensors.

RL frameworks hand a weight-sync backend ``(name, tensor)`` pairs that every trainer rank computes
alike (FSDP's ``full_tensor()``, Megatron-Bridge's export: collectives, so every rank iterates). A
:class:`GatheredPush` declares the step from the model's config, casts each tensor to the dtype the
checkpoint holds (the frameworks' masters are often FP32) and pushes with ``replicated=True``: refitd's
client sends each tensor from exactly one rank, so the bytes are spread and nothing is sent twice.
Framework-free: imports refitd's client and plan only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sidecar.client import RefitClient, RefitError
from sidecar.config.runtime_dir import default_listen, default_runtime_dir
from sidecar.plan.build import meta_state_dict

WAITS = ("published", "committed", "loaded")


def default_endpoint() -> str:
    """``$REFITD_ENDPOINT``, else the control socket of a daemon started with default settings."""
    return os.environ.get("REFITD_ENDPOINT") or default_listen(default_runtime_dir(os.environ))


def read_hf_config(hf_config: str | os.PathLike | Mapping[str, Any] | None, *, where: str) -> dict[str, Any]:
    """The model's ``config.json`` (a dict, the file or its directory); ``where`` names the setting."""
    if hf_config is None:
        raise ValueError(
            f"refitd needs the model's Hugging Face config to declare each step's tensors: set {where} to its "
            "config.json (or the model directory)"
        )
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"refitd: cannot read the model's config {path} ({where}): {exc}") from exc


def as_declared(
    weights: Iterable[tuple[str, torch.Tensor]], declared: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor in the dtype ``declared`` gives its name. Names not declared pass unchanged: the
    step then fails naming them."""
    for name, tensor in weights:
        want = declared.get(name)
        if want is not None and tensor.dtype != want.dtype:
            tensor = tensor.to(want.dtype)
        yield name, tensor


class GatheredPush:
    """One trainer rank's pushes of gathered streams, one client kept across steps."""

    def __init__(
        self,
        hf_config: Mapping[str, Any],
        *,
        endpoint: str | None = None,
        wait: str = "published",
        timeout: float = 600.0,
    ) -> None:
        if wait not in WAITS:
            raise ValueError(f"refitd: wait={wait!r}: choose one of {', '.join(WAITS)}")
        self.hf_config = dict(hf_config)
        self.endpoint = endpoint or default_endpoint()
        self.wait, self.timeout = wait, float(timeout)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.client: RefitClient | None = None
        self.last_step = -1
        self._declared: dict[str, torch.Tensor] | None = None

    def set_rank(self, rank: int, world_size: int) -> None:
        if self.client is not None and (rank, world_size) != (self.rank, self.world_size):
            self.close()
        self.rank, self.world_size = rank, world_size

    def connect(self) -> RefitClient:
        if self.rank is None:  # the framework never said: torch.distributed's ranks
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RefitError(
                    "refitd: this trainer rank's number is unknown (no rank given and torch.distributed is "
                    "not initialized)"
                )
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.client is None:
            self.client = RefitClient(
                self.endpoint, rank=self.rank, world_size=self.world_size, timeout=self.timeout
            )
        return self.client

    def declared(self) -> dict[str, torch.Tensor]:
        """Every tensor of a step (meta tensors), named as Hugging Face checkpoints name them."""
        if self._declared is None:
            self._declared = meta_state_dict(self.hf_config)
        return self._declared

    def step_of(self, step: int | None) -> int:
        """The framework's step number; none (or one not above the last) takes the next number."""
        if step is None or step <= self.last_step:
            return self.last_step + 1
        return int(step)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], step: int | None = None) -> dict[str, Any]:
        """Read ``weights`` on this thread (their gathers are collectives every rank runs) and push
        them; returns metrics (``refitd/step``, ``refitd/generation``, the phases' seconds)."""
        client = self.connect()
        number = self.step_of(step)
        declared = self.declared()
        t0 = time.perf_counter()
        result = client.push_step(
            number, as_declared(weights, declared), declare=declared, replicated=True, wait=self.wait
        )
        self.last_step = number
        metrics: dict[str, Any] = {"refitd/step": number, "refitd/push_s": time.perf_counter() - t0}
        if hasattr(result, "generation"):
            metrics["refitd/generation"] = result.generation
            metrics.update({f"refitd/{k}_s": v for k, v in result.seconds.items()})
        return metrics

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
