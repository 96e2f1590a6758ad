"""Warming the quantizer up before READY: probe the kernels where the arenas live and compile the
plan's specialisations there, so no step pays for it (and status says which quantizer runs)."""

from __future__ import annotations

import logging

import torch

from sidecar.config.settings import ArenaKind
from sidecar.numerics import cpu, kernels
from sidecar.plan import launch

log = logging.getLogger("refitd.daemon")


def warm_up(plan, arenas) -> kernels.WarmUp:
    """Probe the kernels on the arenas' GPU (each GPU the groups are spread over) and compile
    ``plan``'s specialisations there; on host arenas the native CPU kernels (else the torch
    reference, as when the probe fails). Returns the first GPU's."""
    on_gpu = arenas is not None and arenas.kind is ArenaKind.CUDA_IPC
    device = torch.device("cuda", arenas.staging.device) if on_gpu else torch.device("cpu")
    done = launch.warm_up(plan, device)
    for staging in arenas.stagings[1:] if on_gpu else ():
        other = launch.warm_up(plan, torch.device("cuda", staging.device))
        log.info("quantizing with %s on cuda:%d", other.impl, staging.device)
    if device.type == "cpu":  # build + load the native CPU kernels now, never on a step
        done = cpu.warm_up()
    log.info("quantizing with %s on %s%s", done.impl, device, f" ({done.reason})" if done.reason else "")
    return done
