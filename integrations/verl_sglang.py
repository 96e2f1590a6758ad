"""The rollout side of refitd's verl backend for SGLang replicas (verl 0.9.1, SGLang 0.5.23).

verl's SGLang replica (``SGLangReplica``) is an HTTP server: SGLang's tokenizer manager inside a Ray
actor (``SGLangHttpServer``), its TP schedulers in processes of their own. verl loads weights into it
from outside, over that HTTP API: its ``ServerAdapter`` posts ``/update_weights_from_tensor`` with a
``load_format`` naming a custom weight loader registered at launch through
``rollout.engine_kwargs.sglang.custom_weight_loader`` (its ``delta_sharded`` backend's
``delta_loader.apply_delta``); SGLang then calls ``loader(model, named_tensors)`` in every TP
scheduler process. refitd takes the same road with its own loader::

    +actor_rollout_ref.rollout.engine_kwargs.sglang.custom_weight_loader=[adapters.sglang.loader.refit_loader]

:func:`load_sglang_replica` (called by ``RefitdCheckpointEngineManager`` for each SGLang replica)
runs ``adapters.sglang.refit_engine`` over :class:`SGLangHttpEngine`, the replica's server address:
``/begin_weight_update`` -> ``/update_weights_from_tensor`` (a few hundred bytes of control JSON,
``load_format=adapters.sglang.loader.refit_loader``) -> ``/end_weight_update``, the session SGLang
0.5.23 requires. Each TP scheduler maps the daemon's generation and loads it with SGLang's own
``load_weights``; each reports to a socket the manager binds (``ipc://`` when the replica runs on
this node, else ``tcp://`` on this node's address). The manager's abort and verl's ``clear_kv_cache``
/ ``resume_generation`` do the pause, the flush and the resume.

Imports SGLang (its serializer) and verl only inside the functions that need them.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from adapters.engine import LoadResult
from adapters.sglang import LOADER, refit_engine
from sidecar.errors import ErrorKind, RefitError

#: the verl setting that registers refitd's loader in SGLang's TP schedulers
LOADER_SETTING = "actor_rollout_ref.rollout.engine_kwargs.sglang.custom_weight_loader"


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """A field of verl's config dataclasses or of an OmegaConf / plain mapping."""
    if obj is None:
        return default
    if hasattr(obj, "get") and not hasattr(obj, "__dataclass_fields__"):
        return obj.get(key, default)
    return getattr(obj, key, default)


class SGLangHttpEngine:
    """``refit_engine``'s engine over an SGLang server's HTTP API: the endpoints SGLang's own
    ``HttpServerEngineAdapter`` and verl's ``HttpServerAdapter`` post to. ``tp_size`` copies of the
    control payload travel, one per TP rank (SGLang's ``serialized_named_tensors``)."""

    def __init__(self, address: str, tp_size: int, *, timeout: float = 600.0) -> None:
        from types import SimpleNamespace

        self.url = address if address.startswith(("http://", "https://")) else f"http://{address}"
        self.timeout = timeout
        self.server_args = SimpleNamespace(tp_size=tp_size, pp_size=1)

    def _post(self, endpoint: str, payload: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/{endpoint}",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            if exc.code in (404, 405):
                raise RefitError(
                    f"the SGLang server at {self.url} has no /{endpoint} (HTTP {exc.code}): refitd's SGLang "
                    "load needs the weight-update session of SGLang 0.5.23 (/begin_weight_update, "
                    "/update_weights_from_tensor with a custom load_format, /end_weight_update); upgrade SGLang",
                    kind=ErrorKind.ENGINE,
                ) from exc
            try:  # SGLang answers a refusal as {"success": false, "message": ...} with HTTP 400
                answer = json.loads(body)
            except ValueError:
                answer = {"success": False, "message": f"HTTP {exc.code}: {body[:500]}"}
            return answer if isinstance(answer, dict) else {"success": False, "message": str(answer)}
        except (urllib.error.URLError, OSError) as exc:
            raise RefitError(
                f"the SGLang server at {self.url} did not answer /{endpoint}: {exc}", kind=ErrorKind.ENGINE
            ) from exc

    def begin_weight_update(self, selector: str = "all") -> dict[str, Any]:
        return self._post("begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> dict[str, Any]:
        return self._post("end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True) -> dict[str, Any]:
        from sglang.srt.utils import MultiprocessingSerializer

        tp = int(self.server_args.tp_size)
        payload = MultiprocessingSerializer.serialize(named_tensors, output_str=True)
        return self._post(
            "update_weights_from_tensor",
            {
                "serialized_named_tensors": [payload] * tp,
                "load_format": load_format,
                "flush_cache": flush_cache,
            },
            # SGLang answers once every rank's loader returned: each may wait ``timeout`` to attach and
            # ``timeout`` for the generation, then reports (a failure too) to refit_engine's socket
            timeout=2 * self.timeout + 60,
        )


def check_sglang_replica(config: Any) -> None:
    """What verl's SGLang server must be launched with for refitd to load it; ValueError naming the
    setting otherwise (before any request: an unlisted ``load_format`` ends SGLang's schedulers)."""
    sglang = _get(_get(config, "engine_kwargs"), "sglang") or {}
    loaders = _get(sglang, "custom_weight_loader") or []
    if isinstance(loaders, str):  # verl launches with list(custom_weight_loader): a string's characters
        raise ValueError(
            f"{LOADER_SETTING} is the string {loaders!r}; verl needs a list: set +{LOADER_SETTING}=[{LOADER}]"
        )
    if LOADER not in list(loaders):
        raise ValueError(
            f"the SGLang replicas were launched without refitd's loader: set "
            f"+{LOADER_SETTING}=[{LOADER}] (SGLang runs a load_format only when --custom-weight-loader lists it)"
        )
    dp = int(_get(config, "data_parallel_size", 1) or 1)
    if dp != 1:
        raise ValueError(
            f"rollout.data_parallel_size={dp}: SGLang 0.5.23's update_weights_from_tensor refuses dp_size > 1 "
            "(tokenizer_control_mixin asserts it); use one replica per data-parallel rank instead"
        )
    if _get(config, "quantization") is not None:
        raise ValueError(
            f"rollout.quantization={_get(config, 'quantization')!r}: verl would quantize again what refitd's daemon "
            "quantized; leave it null and give SGLang the daemon's format "
            "(engine_kwargs.sglang.json_model_override_args: adapters.sglang.sglang_quantization_config)"
        )


def _node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # no Ray here: the host's own address
        return socket.gethostbyname(socket.gethostname())


def reply_address(replica: Any) -> str | None:
    """Where the TP schedulers report: None (``refit_engine``'s ipc:// socket) when the whole replica
    runs on this node, else a TCP port on this node's address."""
    host = str(replica.server_address).rsplit(":", 1)[0].strip("[]")
    here = _node_address()
    if int(getattr(replica, "nnodes", 1) or 1) == 1 and host in (here, "127.0.0.1", "localhost", "::1"):
        return None
    return f"tcp://{here}:*"


async def load_sglang_replica(
    replica: Any, step: int | None, endpoint: str, timeout: float
) -> list[LoadResult]:
    """Load the generation >= ``step`` into every TP rank of verl's SGLang ``replica`` (its server
    already paused by the manager's abort). Raises RefitError naming each failed rank."""
    import asyncio

    config = replica.config
    check_sglang_replica(config)
    address = replica.server_address
    if not address:
        raise RefitError(
            f"SGLang replica {replica.replica_rank} has no server address (not launched)",
            kind=ErrorKind.ENGINE,
        )
    tp = int(_get(config, "tensor_model_parallel_size", 1) or 1)
    pp = int(_get(config, "pipeline_model_parallel_size", 1) or 1)
    engine = SGLangHttpEngine(address, tp, timeout=timeout)
    return await asyncio.to_thread(
        refit_engine,
        engine,
        endpoint,
        min_step=step,
        timeout=timeout,
        name=f"verl-sglang{replica.replica_rank}",
        workers=tp * pp,
        reply=reply_address(replica),
        pause=False,
    )
