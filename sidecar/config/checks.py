"""The checks that run after every setting converted: ranges, files, and settings that must agree.

Each problem names its settings and what to do; :func:`value_problems` yields them all.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sidecar.config.values import (
    CONTROL_SOCKET,
    MAX_IPC_PATH_BYTES,
    NodeLayout,
    NodeRole,
    Problem,
    is_loopback_host,
    tcp_host,
)

_PLAN_SIZED = "too small; give a size such as 2GiB, or leave it unset to size it from the plan"


def value_problems(c: Any, bad: set[str]) -> Iterable[Problem]:
    """The problems of DaemonConfig ``c`` that span fields or touch the file system, each naming its
    settings and what to do; names in ``bad`` (already refused) are skipped. ``c`` is typed ``Any``:
    settings.py imports this module to validate itself, so this one cannot import the class back."""

    def ok(*names: str) -> bool:
        return not bad.intersection(names)

    if ok("runtime_dir") and not c.runtime_dir.is_absolute():
        bad.add("runtime_dir")
        yield Problem(f"runtime_dir = '{c.runtime_dir}' is relative: give an absolute path", ("runtime_dir",))
    if ok("runtime_dir", "listen") and c.listen is not None:
        yield from _listen_problems(c.listen, c.runtime_dir)
    if ok("model_type") and c.model_type is not None:
        from sidecar.plan.models import get_model  # the registry; imported late, it is only needed here

        try:
            get_model(c.model_type)
        except ValueError as exc:
            yield Problem(f"model_type = {c.model_type!r}: {exc}", ("model_type",))
    timelines = c.timeline_dir
    if ok("timeline_dir") and timelines is not None and timelines.exists() and not timelines.is_dir():
        yield Problem(
            f"timeline_dir = '{timelines}' is not a directory: give a directory (it is created if missing)",
            ("timeline_dir",),
        )
    if ok("hf_config") and c.hf_config is not None and not c.hf_config.is_file():
        path = c.hf_config
        yield Problem(f"hf_config = '{path}' is not a file: give the model's config.json", ("hf_config",))
    minimums = {
        "num_first_layers_in_bf16": (0, "give a layer count >= 0"),
        "num_last_layers_in_bf16": (0, "give a layer count >= 0"),
        "num_hidden_layers": (1, "give a positive count, or leave it unset to take it from the config"),
        "world_size": (1, "give the number of trainer ranks, at least 1"),
        "engine_ep": (1, "give the engine's expert-parallel size, at least 1 (1: no expert parallelism)"),
        "engine_tp": (1, "give the engine's tensor-parallel size, at least 1"),
        "nodes": (1, "give the number of nodes the engine spans, at least 1"),
        "node_rank": (0, "give this node's index among the engine's nodes, from 0"),
        "staging_bytes": (1, _PLAN_SIZED),
        "publish_bytes": (1, _PLAN_SIZED),
        "staging_regions": (0, "give 0 to stage whole steps, or a number of regions such as 4"),
        "max_frame_bytes": (1, "too small; give a size such as 64MiB"),
        "max_header_bytes": (1, "too small; give a size such as 1MiB"),
        "credit_frames": (1, "give at least 1 frame in flight"),
        "max_step_pieces": (1, "give at least 1; a real model needs up to ~1M (a piece per expert per rank)"),
    }
    for name, (least, hint) in minimums.items():
        value = getattr(c, name)
        if ok(name) and value is not None and value < least:
            bad.add(name)
            yield Problem(f"{name} = {value}: {hint}", (name,))
    for name in tuple(f.name for f in dataclasses.fields(c) if f.name.endswith("_s")):
        value = getattr(c, name)
        if ok(name) and not (math.isfinite(value) and value > 0):
            bad.add(name)
            yield Problem(f"{name} = {value}: give a positive, finite number of seconds", (name,))
    first, last, layers = c.num_first_layers_in_bf16, c.num_last_layers_in_bf16, c.num_hidden_layers
    keys = ("num_first_layers_in_bf16", "num_last_layers_in_bf16", "num_hidden_layers")
    if ok(*keys) and layers is not None and first + last > layers:
        yield Problem(
            f"num_first_layers_in_bf16 ({first}) + num_last_layers_in_bf16 ({last}) exceeds "
            f"num_hidden_layers ({layers}): lower one of them, or use format = 'bf16'",
            keys,
        )
    keys = ("format", "int4_group", "int4_scale_dtype", "nvfp4_names")
    if ok(*keys):
        try:
            c.format_params.check_for(c.format)
        except ValueError as exc:
            yield Problem(f"{exc} (int4_group, int4_scale_dtype, nvfp4_names)", keys)
    yield from _layout_problems(c, ok)
    yield from _share_problems(c, ok)
    yield from _tier_problems(c, ok)
    keys = ("heartbeat_interval_s", "rank_timeout_s")
    if ok(*keys) and c.heartbeat_interval_s >= c.rank_timeout_s:
        yield Problem(
            f"heartbeat_interval_s ({c.heartbeat_interval_s:g}) must be less than rank_timeout_s "
            f"({c.rank_timeout_s:g}), or live ranks are declared dead between pings: lower the first "
            f"or raise the second",
            keys,
        )


#: the least device budget that can hold anything: one 2 MiB CUDA allocation granule per ring
MIN_DEVICE_BUDGET = 4 << 20


def _tier_problems(c: Any, ok: Callable[..., bool]) -> Iterable[Problem]:
    """The memory tiers' settings: a budget that can hold rings, GPUs that agree, and a ring to
    stream through when the generations are in host memory and the arenas on a GPU."""
    from sidecar.config.values import Residency
    from transport.arena import ArenaKind

    if ok("device_budget") and c.device_budget < MIN_DEVICE_BUDGET:
        yield Problem(
            f"device_budget = {c.device_budget}: too small to hold a staging and a publish ring; give a "
            "size such as 4GiB (the device memory the daemon may use per GPU)",
            ("device_budget",),
        )
    cuda = c.arena is ArenaKind.CUDA_IPC
    if ok("arena", "generation_residency") and not cuda and c.generation_residency is Residency.DEVICE:
        yield Problem(
            "generation_residency = 'device' needs arena = 'cuda': with arena = 'shm' everything is in "
            "host memory; set arena = 'cuda', or drop generation_residency",
            ("arena", "generation_residency"),
        )
    if ok("gpu", "gpus") and c.gpu is not None and c.gpus and c.gpu not in c.gpus:
        yield Problem(
            f"gpu = {c.gpu!r} is not among gpus = {list(c.gpus)}: the arenas' GPU must be one the daemon "
            "may use; add it to gpus, or drop gpu (the first of gpus is used)",
            ("gpu", "gpus"),
        )
    keys = ("arena", "generation_residency", "staging_regions", "role")
    trainer_side = c.role is not NodeRole.INFERENCE
    if (
        ok(*keys)
        and cuda
        and trainer_side
        and c.generation_residency is Residency.HOST
        and c.staging_regions == 0
    ):
        yield Problem(
            "staging_regions = 0 stages whole steps on the GPU, but generation_residency = 'host' streams "
            "each layer group through a device ring into host memory: give staging_regions >= 1 (or "
            "leave it unset: 4), or set generation_residency = 'device'",
            keys[:3],
        )


_SHARE_KEYS = ("engine_ep", "engine_tp", "nodes", "node_rank")


def _share_problems(c: Any, ok: Callable[..., bool]) -> Iterable[Problem]:
    """A node's share: a layout :class:`EngineLayout` accepts, and this node's index inside it."""
    if not ok(*_SHARE_KEYS) or (c.nodes == 1 and c.node_rank in (None, 0)):
        return
    from sidecar.plan.build import EngineLayout  # the planner; imported late, it is only needed here

    try:
        EngineLayout(ep=c.engine_ep, tp=c.engine_tp, nodes=c.nodes)
    except ValueError as exc:
        yield Problem(
            f"engine_ep = {c.engine_ep}, engine_tp = {c.engine_tp}, nodes = {c.nodes}: {exc}", _SHARE_KEYS[:3]
        )
    if c.node_rank is None:
        yield Problem(
            f"nodes = {c.nodes} needs node_rank: this node's index, 0 to {c.nodes - 1} (under Slurm "
            "REFITD_NODE_RANK=$SLURM_NODEID), so the daemon publishes that node's share",
            ("nodes", "node_rank"),
        )
    elif c.node_rank >= c.nodes:
        yield Problem(
            f"node_rank = {c.node_rank} is outside the engine's {c.nodes} node(s): give 0 to {c.nodes - 1}",
            ("nodes", "node_rank"),
        )
    if c.nodes > 1 and c.layout is NodeLayout.DISAGGREGATED:
        yield Problem(
            "nodes > 1 (a node's share) applies to layout = 'colocated': a disaggregated trainer node "
            "forwards whole generations; set nodes = 1 there",
            ("nodes", "layout"),
        )


_KEYGEN_HINT = (
    "make keys with `refitd keygen NAME` and give curve_secret_key = NAME.key and curve_allowed_keys "
    "(the clients' *.key.pub files, or a folder of them)"
)


def _layout_problems(c: Any, ok: Callable[..., bool]) -> Iterable[Problem]:
    """The disaggregated layout's settings, and CURVE wherever a TCP endpoint leaves the machine."""
    disaggregated = c.layout is NodeLayout.DISAGGREGATED
    if ok("layout", "role") and disaggregated and c.role is None:
        yield Problem("layout = 'disaggregated' needs role = 'trainer' or 'inference'", ("layout", "role"))
    if ok("layout", "role") and not disaggregated and c.role is not None:
        yield Problem(
            f"role = {c.role.value!r} only applies to layout = 'disaggregated'; set it, or drop role",
            ("layout", "role"),
        )
    trainer = disaggregated and c.role is NodeRole.TRAINER
    if ok("peers", "role") and trainer and not c.peers:
        yield Problem(
            "role = 'trainer' needs peers: the inference daemons' endpoints, e.g. tcp://10.0.0.6:5555",
            ("peers", "role"),
        )
    if ok("peers", "role") and c.peers and not trainer:
        yield Problem("peers are only for layout = 'disaggregated' with role = 'trainer'", ("peers", "role"))
    inference = disaggregated and c.role is NodeRole.INFERENCE
    curve = ("listen", "curve_secret_key", "curve_allowed_keys")
    if ok("role", *curve) and inference and not (tcp_host(c.listen or "") and c.curve_secret_key):
        yield Problem(
            "role = 'inference' takes forwarded generations only from trainer daemons identified by their "
            "CURVE key: listen on tcp://HOST:PORT with curve_secret_key and curve_allowed_keys (the trainer "
            f"daemons' *.key.pub); {_KEYGEN_HINT}",
            ("role", *curve),
        )
    if ok("role", "curve_trainer_keys") and c.curve_trainer_keys is not None and not inference:
        yield Problem(
            "curve_trainer_keys is only for layout = 'disaggregated' with role = 'inference'",
            ("role", "curve_trainer_keys"),
        )
    keys = ("forward_timeout_s", "reader_timeout_s")
    if ok(*keys) and trainer and c.forward_timeout_s >= c.reader_timeout_s:
        yield Problem(
            f"forward_timeout_s ({c.forward_timeout_s:g}) must be less than reader_timeout_s "
            f"({c.reader_timeout_s:g}): a forwarder holds a generation while it sends it, and that hold "
            "must never be dropped under it",
            keys,
        )
    for name in (
        "curve_secret_key",
        "curve_public_key",
        "curve_allowed_keys",
        "curve_server_key",
        "curve_trainer_keys",
    ):
        path = getattr(c, name)
        if ok(name) and path is not None and not path.exists():
            yield Problem(f"{name} = '{path}' does not exist; {_KEYGEN_HINT}", (name,))
    host = tcp_host(c.listen or "")
    port = (c.listen or "").rpartition(":")[2]
    if not (host and port.isdigit() and 1 <= int(port) <= 65535):
        host = None  # not a well-formed tcp:// endpoint: _listen_problems says so
    if ok("listen") and host is not None and not is_loopback_host(host) and c.curve_secret_key is None:
        yield Problem(
            f"listen = {c.listen!r} is reachable from other machines, and refitd refuses to listen there "
            f"without CURVE (authentication and encryption): {_KEYGEN_HINT}",
            ("listen", "curve_secret_key"),
        )
    if (
        ok("listen", "curve_secret_key")
        and host is not None
        and c.curve_secret_key
        and not c.curve_allowed_keys
    ):
        yield Problem(
            "curve_secret_key is set but curve_allowed_keys is not: without an allow-list any key gets in; "
            "give the clients' public keys (a NAME.key.pub file, or a folder of them)",
            ("curve_allowed_keys",),
        )
    remote = [p for p in c.peers if not is_loopback_host(tcp_host(p) or "")]
    if ok("peers") and remote and (c.curve_server_key is None or c.curve_secret_key is None):
        yield Problem(
            f"peers {remote} are on other machines: forwarding to them needs CURVE, curve_server_key (the "
            f"inference daemons' NAME.key.pub) and curve_secret_key (this daemon's keypair); {_KEYGEN_HINT}",
            ("peers", "curve_server_key", "curve_secret_key"),
        )
    if ok("curve_server_key", "curve_secret_key") and c.curve_server_key and not c.curve_secret_key:
        yield Problem(
            "curve_server_key needs curve_secret_key too (the keypair this daemon presents to its peers)",
            ("curve_server_key", "curve_secret_key"),
        )


def _listen_problems(listen: str, runtime_dir: Path) -> Iterable[Problem]:
    keys = ("listen", "runtime_dir")
    scheme, sep, rest = listen.partition("://")
    if scheme == "ipc" and sep:
        root, path = os.path.normpath(runtime_dir), os.path.normpath(rest) if rest else ""
        if not os.path.isabs(path) or os.path.commonpath([path, root]) != root or path == root:
            yield Problem(
                f"listen = {listen!r} is outside runtime_dir {root}, whose mode 0700 keeps other users "
                f"off the socket: use ipc://{root}/{CONTROL_SOCKET}, or change runtime_dir",
                keys,
            )
        elif len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            yield Problem(
                f"listen = {listen!r}: a socket path may be at most {MAX_IPC_PATH_BYTES} bytes, this one "
                f"is {len(os.fsencode(path))}; choose a shorter runtime_dir",
                keys,
            )
    elif scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if not (colon and host and port.isdigit() and 1 <= int(port) <= 65535):
            yield Problem(
                f"listen = {listen!r}: expected tcp://HOST:PORT with a port from 1 to 65535, "
                f"e.g. tcp://10.0.0.5:5555 or tcp://*:5555",
                ("listen",),
            )
    else:
        yield Problem(
            f"listen = {listen!r}: use ipc://PATH inside runtime_dir (the default), or tcp://HOST:PORT "
            f"for clients on other nodes",
            ("listen",),
        )
