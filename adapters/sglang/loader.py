"""Inside SGLang's scheduler processes: the custom weight loader that loads refitd's generation.

SGLang 0.5.23's ``WeightUpdater.update_weights_from_tensor(named_tensors, load_format=LOADER)`` calls
``dynamic_import(LOADER)(model, named_tensors)`` in every TP scheduler process, when LOADER is listed
in ``--custom-weight-loader``. The request carries only :data:`CONTROL_NAME`, a few hundred bytes of
JSON (the daemon's endpoint, the step to wait for, where to report): the weights never travel through
SGLang's (pickling) request path; each process maps the daemon's generation read-only and hands it
to SGLang's own ``DefaultModelLoader.load_weights_only``.

The loader never raises: an exception there ends SGLang's scheduler (``run_scheduler_process`` sends
SIGQUIT to the server). Each outcome, success or failure, is acknowledged to the daemon (which tells
the trainer) and sent as a :class:`~adapters.engine.LoadResult` to the driver's ``reply`` socket.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import zmq

from adapters.engine import EngineWorker, LoadResult
from adapters.sglang.checkpoint import build_manifest, check_sglang_constraints
from adapters.sglang.quant import CONTROL_NAME
from sidecar.errors import ErrorKind, RefitError
from sidecar.protocol.manifest import Manifest

log = logging.getLogger("adapters.sglang")

#: the largest control payload accepted (it holds an endpoint, a name and a few numbers)
MAX_CONTROL_BYTES = 64 << 10
#: how long a result may wait to leave for the driver's reply socket
REPLY_LINGER_MS = 5000

_workers: dict[tuple[str, str], EngineWorker] = {}
_lock = threading.Lock()


def control_tensors(
    endpoint: str,
    *,
    min_step: int | None = None,
    timeout: float = 600.0,
    name: str = "sglang",
    reply: str | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` for ``update_weights_from_tensor``: one small uint8 tensor of JSON."""
    payload = {
        "endpoint": endpoint,
        "min_step": min_step,
        "timeout": float(timeout),
        "name": name,
        "reply": reply,
    }
    data = json.dumps(payload).encode()
    return [(CONTROL_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def parse_control(named_tensors: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The control payload from ``named_tensors``; ValueError saying what is wrong."""
    found = [t for n, t in named_tensors if n == CONTROL_NAME]
    others = [n for n, _ in named_tensors if n != CONTROL_NAME]
    if len(found) != 1 or others:
        raise ValueError(
            f"refitd's SGLang loader takes exactly one {CONTROL_NAME!r} tensor (adapters.sglang.control_tensors), "
            f"got {len(found)} and {len(others)} other tensors (e.g. {others[:3]}): weights come from the daemon"
        )
    t = found[0]
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.uint8
        or t.dim() != 1
        or t.numel() > MAX_CONTROL_BYTES
    ):
        raise ValueError(f"{CONTROL_NAME!r} must be a 1-D uint8 tensor of at most {MAX_CONTROL_BYTES} bytes")
    data = json.loads(bytes(t.cpu().numpy().tobytes()).decode())
    if not isinstance(data, dict) or not isinstance(data.get("endpoint"), str):
        raise ValueError(f"{CONTROL_NAME!r} must be a JSON object with an 'endpoint'")
    step = data.get("min_step")
    if step is not None and (type(step) is not int or step < 0):
        raise ValueError(f"min_step must be a step number or null, got {step!r}")
    return data


def engine_parameters(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Every parameter as SGLang's loader sees it (inside a weight-update session the loader's
    parameters are in place: ``begin_weight_update`` restored them)."""
    return [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]


def _parallel() -> dict[str, int]:
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    out = {}
    for key, attr in (
        ("tp_rank", "tp_rank"),
        ("tp_size", "tp_size"),
        ("ep_size", "moe_ep_size"),
        ("dp_size", "dp_size"),
    ):
        try:
            out[key] = int(getattr(par, attr))
        except Exception:  # an SGLang without that field: the default below
            out[key] = 0 if key == "tp_rank" else 1
    return out


def _deepgemm_ue8m0() -> bool | None:
    try:
        from sglang.srt.layers import deep_gemm_wrapper
    except Exception:
        return None
    return bool(getattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", False)) and bool(
        getattr(deep_gemm_wrapper, "DEEPGEMM_SCALE_UE8M0", False)
    )


def _expert_params_without_loader(model: torch.nn.Module) -> list[str]:
    """Routed-expert parameters a refit loads that have no ``weight_loader``: processing replaced them
    (SGLang's NVFP4 Marlin and INT4 Triton preparations), so no update can load them again."""
    from adapters.sglang.fourbit import LOADED_LEAVES

    out = []
    for name, p in model.named_parameters():
        _, sep, tail = name.rpartition(".mlp.experts.")
        w, _, leaf = tail.partition("_")
        if sep and w in ("w13", "w2") and leaf in LOADED_LEAVES and not hasattr(p, "weight_loader"):
            out.append(name)
    return out


def _moe_backend_and_capability() -> tuple[str | None, int | None]:
    """SGLang's ``--moe-runner-backend`` and the CUDA capability (``major * 10 + minor``), for messages."""
    backend = cap = None
    try:
        from sglang.srt.layers.moe.utils import get_moe_runner_backend

        backend = str(getattr(get_moe_runner_backend(), "value", get_moe_runner_backend()))
    except Exception:  # not initialised (a test's bare model): unknown
        backend = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cap = major * 10 + minor
    return backend, cap


def sglang_manifest(model: torch.nn.Module) -> Manifest:
    """The manifest of this SGLang process's model, built from its own parameters and config."""
    import sglang

    par = _parallel()
    backend, capability = _moe_backend_and_capability()
    return build_manifest(
        engine_parameters(model),
        model.config.to_dict(),
        getattr(model, "quant_config", None),
        tp_size=par["tp_size"],
        ep_size=par["ep_size"],
        dp_size=par["dp_size"],
        engine_version=sglang.__version__,
        deepgemm_scale_ue8m0=_deepgemm_ue8m0(),
        no_loader=_expert_params_without_loader(model),
        moe_runner_backend=backend,
        device_capability=capability,
    )


def load_generation(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Hand a generation to SGLang's ``DefaultModelLoader.load_weights_only`` in one call (DeepSeek's
    fused ``q_a_proj`` + ``kv_a_proj_with_mqa`` loader needs both in the same call; MXFP8's
    ``.weight_scale`` is renamed there). Only the manifest's names are passed, and every one of them
    must be present: SGLang skips unknown names silently, so refitd checks them itself."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    wanted = manifest.by_name()
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise RefitError(
            f"the generation lacks {len(missing)} tensors the engine holds (e.g. {missing[:3]}); nothing was "
            "loaded: the daemon's plan and this engine disagree (re-attach)",
            kind=ErrorKind.ENGINE,
        )
    device = next(model.parameters()).device
    weights = [(n, t) for n, t in tensors.items() if n in wanted]
    DefaultModelLoader.load_weights_only(model, iter(weights), device)


def _worker(model: torch.nn.Module, control: Mapping[str, Any]) -> EngineWorker:
    name = worker_name(control)
    key = (str(control["endpoint"]), name)
    with _lock:
        worker = _workers.get(key)
        if worker is None:
            manifest = sglang_manifest(model)
            hf_config = model.config.to_dict()
            worker = EngineWorker(
                key[0],
                name=name,
                manifest=manifest,
                load=lambda gen: load_generation(model, gen.tensors, manifest),
                timeout=float(control.get("timeout") or 600.0),
                check=lambda m: check_sglang_constraints(m, hf_config),
            )
            _workers[key] = worker
        return worker


def refit_loader(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (``load_format="adapters.sglang.loader.refit_loader"``): attach
    (first call), wait for the generation, load it, acknowledge; report to the driver. Never raises."""
    t0 = time.perf_counter()
    control: dict[str, Any] = {}
    result: dict[str, Any]
    try:
        control = parse_control(named_tensors)
        worker = _worker(model, control)
        if worker.reader is None:
            worker.attach(timeout=control.get("timeout"))
        result = worker.load_next(min_step=control.get("min_step"), timeout=control.get("timeout")).to_dict()
    except Exception as exc:  # reported, never raised: SGLang's scheduler dies on an exception here
        log.exception("refitd: loading a generation into SGLang failed")
        result = LoadResult(
            worker=worker_name(control),
            step=None,
            ok=False,
            seconds=time.perf_counter() - t0,
            error=f"{type(exc).__name__}: {exc}",
        ).to_dict()
    _reply(control.get("reply"), result)


def worker_name(control: Mapping[str, Any]) -> str:
    """``{name}-{host}-pid{scheduler pid}-tp{rank}``: unique per scheduler process, so two SGLang
    engines on one node (or one restarted) never take each other's place at the daemon."""
    try:
        rank: int | str = _parallel()["tp_rank"]
    except Exception:  # SGLang's parallel state not set up: still name the failure
        rank = "?"
    return f"{control.get('name') or 'sglang'}-{socket.gethostname()}-pid{os.getpid()}-tp{rank}"


def _reply(endpoint: Any, result: Mapping[str, Any]) -> None:
    """Send ``result`` (JSON) to the driver's PULL socket, if it gave one."""
    if not isinstance(endpoint, str) or not endpoint:
        return
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(dict(result)).encode())
    except zmq.ZMQError:
        log.exception("refitd: could not report the load result to %s", endpoint)
    finally:
        sock.close()


def detach_all() -> None:
    """Detach every reader this process holds (engine shutdown, tests)."""
    with _lock:
        for worker in _workers.values():
            worker.detach()
        _workers.clear()
