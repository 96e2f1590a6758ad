"""The serve loop's set-up, once per start: its arenas sized from the config (or the plan), its
control endpoint bound (CURVE where keys are configured), and the record of its shared-memory
segments that lets the next start clean up after a crash.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import zmq

from sidecar.config.settings import ArenaKind, DaemonConfig, NodeRole, default_listen, tcp_host
from sidecar.daemon.memory.generations import Arenas
from sidecar.daemon.segments import SEGMENTS_FILE, remove_stale_segments
from sidecar.errors import ErrorKind, RefitError
from sidecar.forward.types import forward_keys
from sidecar.plan.build import RefitPlan, RefitSpec, with_checkpoint_scheme
from sidecar.plan.models import get_model
from transport.control import bind_control

log = logging.getLogger("refitd.daemon")


def check_gpus(config: DaemonConfig) -> list[int]:
    """Every GPU of ``gpus`` must be one this process sees (by index or UUID): a typo is a
    configuration error at start, not a failure the first time a step needs that GPU. Returns
    their CUDA indices in this process, each once (an index and the UUID of the same GPU are one)."""
    if config.arena is not ArenaKind.CUDA_IPC or not config.gpus:
        return []
    from transport.cuda_ipc import resolve_gpu

    devices: list[int] = []
    for gpu in config.gpus:
        try:
            device, _uuid = resolve_gpu(int(gpu) if gpu.isdigit() else gpu)
        except (LookupError, ValueError) as exc:
            raise RefitError(f"gpus = {list(config.gpus)}: {gpu!r}: {exc}", kind=ErrorKind.INVALID) from None
        if device not in devices:
            devices.append(device)
    return devices


def work_gpus(config: DaemonConfig, devices: list[int], regions: int) -> list[int] | None:
    """The GPUs the layer groups are spread over (docs/multi_gpu.md, "Per-GPU work"): every GPU of
    ``gpus`` when it names several, ``gpu`` does not pin the arenas to one, the generations are in
    host memory and a staging ring streams the step; else None (one GPU, as before)."""
    if len(devices) < 2 or config.gpu is not None or not config.host_generations or not regions:
        if len(devices) > 1:
            why = (
                f"gpu = {config.gpu!r} pins the arenas"
                if config.gpu is not None
                else "generation_residency = 'device' keeps both generations on one GPU"
                if not config.host_generations
                else "whole-step staging (no staging ring) stages on one GPU"
            )
            log.info("gpus = %s: one GPU does the work: %s", list(config.gpus), why)
        return None
    log.info("layer groups spread over GPUs %s (gpus = %s)", devices, list(config.gpus))
    return devices


def make_arenas(prefix: str, config: DaemonConfig, plan: RefitPlan | None) -> Arenas:
    """Staging and the generations: sized for ``plan``, or by the configured byte counts."""
    devices = check_gpus(config)
    regions = 0 if config.role is NodeRole.INFERENCE else config.ring_regions  # no trainers there
    gpus = work_gpus(config, devices, regions)
    if plan is not None:
        return Arenas.for_plan(
            prefix,
            plan,
            staging_bytes=config.staging_bytes,
            publish_bytes=config.publish_bytes,
            kind=config.arena,
            gpu=config.arena_gpu,
            staging_regions=regions,
            host_generations=config.host_generations,
            budget=config.device_budget,
            gpus=gpus,
        )
    if config.publish_bytes is not None and (
        config.staging_bytes is not None or config.role is NodeRole.INFERENCE
    ):
        return Arenas(
            prefix,
            staging_bytes=config.staging_bytes or 4096,
            publish_bytes=config.publish_bytes,
            kind=config.arena,
            gpu=config.arena_gpu,
            staging_regions=regions,
            host_generations=config.host_generations,
            budget=config.device_budget,
            gpus=gpus,
        )
    raise RefitError(
        "the daemon cannot size its arenas: give hf_config (the model's config.json) so it plans at "
        "start, or both staging_bytes and publish_bytes (an inference node of a disaggregated "
        "layout needs only publish_bytes)",
        kind=ErrorKind.CAPACITY,
    )


def bind(router: zmq.Socket, ctx: zmq.Context, config: DaemonConfig):
    """Bind the control endpoint: CURVE with the allow-list on tcp:// when keys are configured, and,
    beside a tcp:// endpoint, ``ipc://<runtime_dir>/control.sock`` for this node's engines.
    Returns ``(authenticator or None, the local ipc:// endpoint or None, the keys that may forward)``."""
    from transport import curve

    cfg, auth, local_listen, keys = config, None, None, frozenset()
    tcp = tcp_host(cfg.listen) is not None
    if tcp and cfg.curve_secret_key is not None:
        try:
            public, secret = curve.own_keypair(cfg.curve_secret_key, cfg.curve_public_key)
            allowed = curve.allowed_keys(cfg.curve_allowed_keys)
            keys = forward_keys(cfg, allowed)
        except (OSError, ValueError) as exc:
            raise RefitError(f"CURVE keys: {exc}", kind=ErrorKind.INVALID) from None
        auth = curve.start_authenticator(ctx, allowed)
        curve.set_server(router, public, secret)
        router.bind(cfg.listen)
        curve.unset_server(router)
        log.info("CURVE on %s: %d allowed client key(s)", cfg.listen, len(allowed))
    else:
        try:
            bind_control(router, cfg.listen)  # an ipc:// socket file: 0600 whatever the umask
        except OSError as exc:
            raise RefitError(str(exc), kind=ErrorKind.INVALID) from None
    if tcp:
        local = default_listen(cfg.runtime_dir)
        try:
            bind_control(router, local)
            local_listen = local
        except (zmq.ZMQError, OSError) as exc:
            log.warning("no local endpoint %s beside %s: %s", local, cfg.listen, exc)
    return auth, local_listen, keys


def segments_file(config: DaemonConfig) -> Path:
    return Path(config.runtime_dir) / SEGMENTS_FILE


def record_segments(config: DaemonConfig, names: list[str]) -> None:
    """Write our segment names, after unlinking those a crashed predecessor left behind."""
    for name in remove_stale_segments(config.runtime_dir):
        log.warning("removed shared-memory segment %s left by a crashed daemon", name)
    segments_file(config).write_text(json.dumps({"pid": os.getpid(), "segments": names}))


def refit_spec(config: DaemonConfig, hf_config: dict[str, Any] | None = None) -> RefitSpec:
    """The daemon's RefitSpec; the model type comes from the config, else from ``hf_config``."""
    model_type = config.model_type
    if model_type is None and hf_config is not None:
        model_type = hf_config.get("model_type")
    if model_type is None:
        raise RefitError("the daemon needs a model type: set model_type or hf_config", kind=ErrorKind.INVALID)
    get_model(model_type)
    spec = RefitSpec(
        model_type=model_type,
        fmt=config.format,
        num_hidden_layers=config.num_hidden_layers,
        num_first_layers_in_bf16=config.num_first_layers_in_bf16,
        num_last_layers_in_bf16=config.num_last_layers_in_bf16,
        ignore_patterns=tuple(config.ignore_patterns),
        params=config.format_params,  # until an engine's manifest says otherwise
    )
    # a block-FP8 checkpoint (DeepSeek-V3) quantizes its linears too: every plan of this daemon follows it
    return spec if hf_config is None else with_checkpoint_scheme(spec, hf_config)
