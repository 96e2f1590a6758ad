"""The daemon's settings: one frozen :class:`DaemonConfig`, from a TOML file, ``REFITD_*``, then flags.

Later sources win: a command-line flag beats an environment variable, which beats the config file,
which beats the default. ``0`` is a value, never "unset": a source that does not mention a setting
leaves the one below it in place. Every problem in every source is collected and reported at once,
one per line, each naming where the bad value came from (``key 'world_size' in /etc/refitd.toml``,
``environment variable REFITD_WORLD_SIZE``, ``flag --world-size``) and what to give instead::

    config = load_config()          # sys.argv[1:] and os.environ; --config / REFITD_CONFIG names the file
    prepare_runtime_dir(config.runtime_dir)     # creates runtime_dir 0700, or refuses one others can enter

Each setting is declared once, as a field of :class:`DaemonConfig` whose metadata (a ``Knob``) carries
its flag, converter, help and example; flags (``sidecar.config.sources``) and the example file
(``sidecar.config.example``) are made from the fields. File key: the field name; variable: ``REFITD_``
+ the name in upper case (lists comma-separated); sizes: ``4096``, ``512MiB``, ``2GiB``, ``1.5G``.
Relative paths in the file are relative to its folder, elsewhere to the working directory. The
dataclass never reads ``os.environ``: :func:`default_runtime_dir` receives the environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.config import values as v
from sidecar.config.checks import value_problems
from sidecar.config.environment import NATIVE_CC_ENV, NATIVE_DIR_ENV, NATIVE_ENV
from sidecar.config.runtime_dir import default_listen
from sidecar.config.runtime_dir import default_runtime_dir as default_runtime_dir  # re-exported
from sidecar.config.runtime_dir import prepare_runtime_dir as prepare_runtime_dir  # re-exported
from sidecar.config.values import MAX_IPC_PATH_BYTES as MAX_IPC_PATH_BYTES  # re-exported
from sidecar.config.values import (
    ConfigError,
    DrainMode,
    ForwardMover,
    Knob,
    LogFormat,
    LogLevel,
    MiB,
    NodeLayout,
    NodeRole,
    Problem,
    Residency,
    knob,
    parse_size,
)
from sidecar.config.values import is_loopback_host as is_loopback_host  # re-exported
from sidecar.config.values import split_host_port as split_host_port  # re-exported
from sidecar.config.values import tcp_host as tcp_host  # re-exported
from sidecar.numerics.formats import INT4_GROUP, Format, FormatParams, Nvfp4Names
from transport.arena import ArenaKind

#: Settings SIGHUP may change in a running daemon; everything else needs a restart.
RELOADABLE = frozenset(
    {"log_level", "log_format", "drain", "step_timeout_s", "rank_timeout_s", "heartbeat_interval_s"}
    | {"reader_timeout_s", "shutdown_timeout_s", "forward_timeout_s"}
)

#: Exit status for a configuration error: ``EX_CONFIG`` from sysexits.h. The unit file lists it in
#: ``RestartPreventExitStatus=`` so systemd does not restart a daemon that would fail the same way.
EXIT_CONFIG = 78

ENV_PREFIX = "REFITD_"
#: The environment variable naming the config file (``--config`` beats it).
CONFIG_ENV = "REFITD_CONFIG"
#: ``REFITD_*`` variables that are not daemon settings; any other unknown one is an error.
#: (the Slurm launcher hands trainers and engines their endpoints in REFITD_ENDPOINT*)
NON_SETTING_ENV = frozenset(
    {CONFIG_ENV, "REFITD_ENDPOINT", "REFITD_ENDPOINTS", "REFITD_ENDPOINTS_FILE"}
    | {NATIVE_ENV, NATIVE_CC_ENV, NATIVE_DIR_ENV}
)
#: staging regions when ``arena = "cuda"`` and ``staging_regions`` is unset: a whole step of BF16
#: (67 GB for Qwen3.5-35B-A3B) does not belong on a GPU the engines share; four layer groups do.
DEFAULT_GPU_REGIONS = 4
#: device memory the daemon may allocate on each GPU it uses when ``device_budget`` is unset: the
#: staging and publish rings (and, with ``generation_residency = "device"``, both generations).
#: The peers' anchor: checkpoint-engine takes up to 3 buckets of 2.67-8 GiB per GPU.
DEFAULT_DEVICE_BUDGET = 4 << 30


_OPT_TEXT, _OPT_COUNT, _AUTO_SIZE = v.optional(v.text), v.optional(v.count), v.optional(parse_size, auto=True)
_OPT_PATH = v.optional(v.to_path)
_FORMATS = ", ".join(f.value for f in Format)


# --------------------------------------------------------------------------------------------------
# the config


# the config


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon reads at start. Validated on construction; :class:`ConfigError` lists
    every problem. Each field also accepts the text a file, variable or flag would give (``"2GiB"``,
    ``"mxfp8"``, ``"4"``); it is converted once, here.
    """

    """Where it listens. ``runtime_dir`` holds the sockets and the daemon's state and is made mode
    0700, which is what keeps other users off the sockets. ``listen`` is the control endpoint:
    ``ipc://PATH`` inside ``runtime_dir`` (default ``ipc://<runtime_dir>/control.sock``), or
    ``tcp://HOST:PORT`` for remote clients, only ever when given explicitly."""
    runtime_dir: Path = field(
        metadata=knob(
            "--runtime-dir",
            v.to_path,
            "DIR",
            "sockets and state (made mode 0700)",
            is_path=True,
            example='"/run/refitd"',
            note="default: $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/refitd, /tmp/refitd-<uid>",
        )
    )
    listen: str | None = field(
        default=None,
        metadata=knob(
            "--listen",
            _OPT_TEXT,
            "URL",
            "ipc://PATH in runtime_dir, or tcp://HOST:PORT",
            example='"tcp://*:5555"',
            note="default: ipc://<runtime_dir>/control.sock",
        ),
    )

    """What it publishes. ``model_type`` is a registry key (``qwen3_5_moe``, ``qwen3_moe``);
    ``hf_config`` a Hugging Face config.json (or the folder holding it) from which the plan and the
    arena sizes are made at start. ``format`` is the routed experts' target format. The layer counts
    and ``ignore_patterns`` (fnmatch over module names) keep routed experts in BF16; without
    ``num_hidden_layers`` the count comes from the config or the tensor names."""
    model_type: str | None = field(
        default=None,
        metadata=knob(
            "--model-type",
            _OPT_TEXT,
            "TYPE",
            "model family: qwen3_5_moe, qwen3_moe",
            example='"qwen3_5_moe"',
            commented=False,
        ),
    )
    hf_config: Path | None = field(
        default=None,
        metadata=knob(
            "--hf-config",
            v.optional(v.hf_config_path),
            "PATH",
            "Hugging Face config.json",
            is_path=True,
            example='"/models/qwen3.5-35b-a3b/config.json"',
        ),
    )
    format: Format = field(
        default=Format.BLOCK_FP8,
        metadata=knob("--format", v.fmt, "FMT", f"routed experts' format: {_FORMATS}", note=_FORMATS),
    )
    #: the format's parameters for a plan made before any engine attaches (and for what a forwarder
    #: sends to engines on other nodes): an engine's manifest decides at attach (SPEC §1.7, §2.3)
    int4_group: int = field(
        default=INT4_GROUP,
        metadata=knob(
            "--int4-group",
            v.count,
            "G",
            "int4_w4a16 group size along K (an attached engine's manifest decides)",
            note="32, 64 or 128; an attached engine's manifest decides",
        ),
    )
    int4_scale_dtype: str = field(
        default="bfloat16",
        metadata=knob(
            "--int4-scale-dtype",
            v.text,
            "DTYPE",
            "int4_w4a16 scale dtype: bfloat16 or float32 (an attached engine's manifest decides)",
            note="bfloat16 or float32; an attached engine's manifest decides",
        ),
    )
    nvfp4_names: Nvfp4Names = field(
        default=Nvfp4Names.MODELOPT,
        metadata=knob(
            "--nvfp4-names",
            v.choice(Nvfp4Names),
            "NAMES",
            "nvfp4 names: modelopt or compressed_tensors (an attached engine's manifest decides)",
            note="modelopt or compressed_tensors; an attached engine's manifest decides",
        ),
    )
    num_hidden_layers: int | None = field(
        default=None,
        metadata=knob(
            "--num-hidden-layers",
            _OPT_COUNT,
            "N",
            "decoder layers (default: inferred)",
            example="40",
            note="default: from hf_config or the tensor names",
        ),
    )
    num_first_layers_in_bf16: int = field(
        default=0, metadata=knob("--first-bf16", v.count, "N", "first N layers' experts stay BF16")
    )
    num_last_layers_in_bf16: int = field(
        default=0, metadata=knob("--last-bf16", v.count, "N", "last N layers' experts stay BF16")
    )
    ignore_patterns: tuple[str, ...] = field(
        default=(),
        metadata=knob(
            "--ignore",
            v.patterns,
            "PATTERN",
            "fnmatch of modules kept BF16 (repeatable)",
            note='fnmatch over module names, e.g. ["*.layers.0.mlp"]',
        ),
    )

    """The trainer: how many ranks push each step."""
    world_size: int = field(
        default=1, metadata=knob("--world-size", v.count, "N", "trainer ranks that push each step")
    )

    """A node's share of a multi-node inference engine (sidecar.plan.build.EngineLayout): the engine
    runs expert-parallel over ``engine_ep`` ranks (and ``engine_tp``-way tensor parallel within a
    node) on ``nodes`` nodes, and this daemon plans, allocates and publishes only what the engine's
    GPUs on node ``node_rank`` hold: routed experts outside its share are dropped (trainer ranks are
    told to skip them). ``nodes = 1`` (the default) publishes the whole model. A launcher sets
    ``node_rank`` per node: ``REFITD_NODE_RANK=$SLURM_NODEID`` under Slurm, the node's index among
    the engine's nodes under Ray."""
    engine_ep: int = field(
        default=1,
        metadata=knob(
            "--engine-ep",
            v.count,
            "N",
            "the engine's expert-parallel size (node share)",
            note="a node's share of a multi-node engine: its expert-parallel size,",
        ),
    )
    engine_tp: int = field(
        default=1,
        metadata=knob(
            "--engine-tp",
            v.count,
            "N",
            "the engine's tensor-parallel size (node share)",
            note="its tensor-parallel size (within a node),",
        ),
    )
    nodes: int = field(
        default=1,
        metadata=knob(
            "--nodes",
            v.count,
            "N",
            "nodes the engine spans; >1 publishes this node's share only",
            note="the nodes it spans (1: publish the whole model),",
        ),
    )
    node_rank: int | None = field(
        default=None,
        metadata=knob(
            "--node-rank",
            _OPT_COUNT,
            "N",
            "this node's index among --nodes (e.g. $SLURM_NODEID)",
            example="0",
            note="and this node's index (Slurm: REFITD_NODE_RANK=$SLURM_NODEID)",
        ),
    )

    """Arena sizes in bytes, allocated once at start. None sizes them from the plan.
    ``staging_regions``: 0 stages a whole step; N streams it through N regions the size of its
    largest layer group (sidecar.daemon.memory.staging). None: 0 for shm arenas, ``DEFAULT_GPU_REGIONS`` for cuda."""
    staging_bytes: int | None = field(
        default=None,
        metadata=knob(
            "--staging-bytes",
            _AUTO_SIZE,
            "SIZE",
            "staging arena (auto: from the plan)",
            example='"16GiB"',
            note="default: sized from the plan",
        ),
    )
    publish_bytes: int | None = field(
        default=None,
        metadata=knob(
            "--publish-bytes",
            _AUTO_SIZE,
            "SIZE",
            "publish arena (auto: from the plan)",
            example='"8GiB"',
            note="default: sized from the plan",
        ),
    )
    staging_regions: int | None = field(
        default=None,
        metadata=knob(
            "--staging-regions",
            _OPT_COUNT,
            "N",
            f"stream steps through N layer-sized staging regions; 0: whole step (default: 0 shm, "
            f"{DEFAULT_GPU_REGIONS} cuda)",
            example="4",
            note=f"stream a step through N layer-sized regions, 0: stage it whole;\n"
            f'default: 0 with arena = "shm", {DEFAULT_GPU_REGIONS} with arena = "cuda"',
        ),
    )

    """Timeouts in seconds. A step not sealed within ``step_timeout_s`` is aborted; a trainer rank silent
    for ``rank_timeout_s`` mid-step is declared dead (ranks ping every ``heartbeat_interval_s``, which
    must be shorter); a reader holding a generation the daemon needs is dropped after
    ``reader_timeout_s`` (a step whose timeout would come first fails at once, naming the reader), and
    an attached reader that stops pinging (it pings every ``heartbeat_interval_s`` or more often) is
    dropped after ``reader_timeout_s`` of silence; shutdown escalates after ``shutdown_timeout_s``."""
    step_timeout_s: float = field(
        default=300.0,
        metadata=knob("--step-timeout", v.seconds, "SECONDS", "abort a step not sealed by then"),
    )
    rank_timeout_s: float = field(
        default=10.0, metadata=knob("--rank-timeout", v.seconds, "SECONDS", "a rank silent this long is dead")
    )
    heartbeat_interval_s: float = field(
        default=1.0, metadata=knob("--heartbeat-interval", v.seconds, "SECONDS", "rank ping interval")
    )
    reader_timeout_s: float = field(
        default=30.0,
        metadata=knob("--reader-timeout", v.seconds, "SECONDS", "drop a silent reader, or its hold"),
    )
    shutdown_timeout_s: float = field(
        default=10.0,
        metadata=knob("--shutdown-timeout", v.seconds, "SECONDS", "escalate shutdown after this"),
    )
    drain: DrainMode = field(
        default=DrainMode.ABORT,
        metadata=knob(
            "--drain",
            v.choice(DrainMode),
            "MODE",
            "SIGTERM: abort the step in flight, or finish it",
            note="SIGTERM mid-step: abort it, or finish it (within shutdown_timeout_s)",
        ),
    )

    """Memory: ``arena`` is ``shm`` (POSIX shared memory, any machine) or ``cuda`` (``cudaMalloc`` on
    ``gpu``, a UUID or an index, shared with trainers and engines through CUDA IPC)."""
    arena: ArenaKind = field(
        default=ArenaKind.SHM,
        metadata=knob(
            "--arena",
            v.arena,
            "KIND",
            "shm (POSIX shared memory) or cuda (CUDA IPC)",
            note="shm, or cuda (arenas in GPU memory, CUDA IPC)",
        ),
    )
    gpu: str | None = field(
        default=None,
        metadata=knob(
            "--gpu",
            _OPT_TEXT,
            "UUID|INDEX",
            "arena=cuda: the GPU holding the arenas (default 0)",
            example='"GPU-5c1e..."',
            note="arena = cuda: UUID or index of the arenas' GPU",
        ),
    )

    """The memory tiers (docs/multi_gpu.md). With ``arena = "cuda"`` the daemon allocates at most
    ``device_budget`` bytes on each GPU it uses (``gpus``: CUDA indices or UUIDs; default: ``gpu``,
    else CUDA's current device): the staging ring and the publish ring, cut into layer groups (or
    parts of layers) small enough to fit. With several ``gpus`` (and ``gpu`` unset, generations in
    host memory, a staging ring) the groups are spread over all of them, each GPU with
    rings of its own under the budget (docs/multi_gpu.md, "Per-GPU work"). ``generation_residency`` puts the two generations in host
    memory (``host``, page-locked, the default) or on the GPU (``device``: only where both fit the
    budget too). A layout whose smallest group cannot fit the budget is refused at start."""
    device_budget: int = field(
        default=DEFAULT_DEVICE_BUDGET,
        metadata=knob(
            "--device-budget",
            parse_size,
            "SIZE",
            "arena=cuda: device memory the daemon may use per GPU (default 4GiB)",
            example='"4GiB"',
            note="arena = cuda: device memory per GPU for the rings (and device-resident generations)",
        ),
    )
    gpus: tuple[str, ...] = field(
        default=(),
        metadata=knob(
            "--gpus",
            v.gpu_list,
            "LIST",
            "arena=cuda: GPUs the daemon uses, indices or UUIDs; several: layer groups spread over them",
            example='["GPU-5c1e...", "1"]',
            note="arena = cuda: the GPUs it uses (indices or UUIDs); several: groups spread over them",
        ),
    )
    generation_residency: Residency = field(
        default=Residency.HOST,
        metadata=knob(
            "--generation-residency",
            v.choice(Residency),
            "WHERE",
            "arena=cuda: generations in host memory (page-locked) or on the device",
            note="arena = cuda: host (page-locked host memory) or device (must fit device_budget)",
        ),
    )

    """Wire limits: the largest data frame and header accepted, and the frames a remote client may have
    in flight before it waits for credit."""
    max_frame_bytes: int = field(
        default=64 * MiB,
        metadata=knob(
            "--max-frame-bytes",
            parse_size,
            "SIZE",
            "largest data frame accepted",
            example='"64MiB"',
            commented=False,
        ),
    )
    max_header_bytes: int = field(
        default=16 * MiB,
        metadata=knob(
            "--max-header-bytes",
            parse_size,
            "SIZE",
            "largest header accepted",
            example='"16MiB"',
            commented=False,
        ),
    )
    credit_frames: int = field(
        default=8, metadata=knob("--credit-frames", v.count, "N", "frames a remote client may have in flight")
    )
    max_step_pieces: int = field(
        default=1 << 20,
        metadata=knob(
            "--max-step-pieces",
            v.count,
            "N",
            "pieces all ranks may declare in one step",
            note="pieces all ranks may declare in one step",
        ),
    )

    """Logging: ``text`` or ``json`` lines, at ``debug`` / ``info`` / ``warning`` / ``error``."""
    log_format: LogFormat = field(
        default=LogFormat.TEXT,
        metadata=knob("--log-format", v.choice(LogFormat), "FMT", "text or json", note="text or json"),
    )
    log_level: LogLevel = field(
        default=LogLevel.INFO,
        metadata=knob(
            "--log-level",
            v.choice(LogLevel),
            "LEVEL",
            "debug, info, warning or error",
            note="debug, info, warning, error",
        ),
    )

    """Operations (sidecar.ops.metrics, sidecar.ops.timeline), off unless given: ``metrics_listen`` is the
    ``HOST:PORT`` of an HTTP server answering ``/healthz``, ``/readyz`` and ``/metrics`` (port 0:
    any free port); ``timeline_dir`` gets a Chrome-trace JSON file per step."""
    metrics_listen: str | None = field(
        default=None,
        metadata=knob(
            "--metrics-listen",
            v.optional(v.host_port),
            "HOST:PORT",
            "serve /healthz, /readyz, /metrics over HTTP",
            example='"127.0.0.1:9464"',
            note="HTTP /healthz, /readyz, /metrics; default: off",
        ),
    )
    timeline_dir: Path | None = field(
        default=None,
        metadata=knob(
            "--timeline-dir",
            _OPT_PATH,
            "DIR",
            "write a Chrome-trace JSON per step here",
            is_path=True,
            example='"/var/log/refitd/timelines"',
            note="a Chrome-trace JSON per step; default: off",
        ),
    )

    """Disaggregated layout (decision 8): ``layout = "disaggregated"`` and a ``role``. A ``trainer``
    daemon forwards every generation it publishes to the inference daemons in ``peers`` (their
    ``tcp://HOST:PORT`` control endpoints); an ``inference`` daemon publishes what it is forwarded
    (it plans nothing: size its arenas with ``publish_bytes``). ``forward_timeout_s`` bounds how long
    a forwarder waits on a peer, and how long it may hold a generation for one transfer (so it must
    be below ``reader_timeout_s``). ``forward_mover`` picks how the bytes move: ``auto`` uses NIXL
    where both sides have it and ZeroMQ frames otherwise, ``zmq`` never uses NIXL, ``nixl`` makes a
    forwarder fail rather than fall back (an inference daemon treats it as ``auto``)."""
    layout: NodeLayout = field(
        default=NodeLayout.COLOCATED,
        metadata=knob(
            "--layout",
            v.choice(NodeLayout),
            "LAYOUT",
            "colocated, or disaggregated (needs --role)",
            note="colocated, or disaggregated (then give role)",
        ),
    )
    role: NodeRole | None = field(
        default=None,
        metadata=knob(
            "--role",
            v.optional(v.choice(NodeRole)),
            "ROLE",
            "disaggregated: trainer or inference",
            example='"trainer"',
            note="disaggregated: trainer or inference",
        ),
    )
    peers: tuple[str, ...] = field(
        default=(),
        metadata=knob(
            "--peers",
            v.peer_endpoints,
            "URL[,URL]",
            "trainer role: inference daemons' tcp:// endpoints",
            example='["tcp://10.0.0.6:5555"]',
            commented=True,
            note="trainer role: the inference daemons' endpoints",
        ),
    )
    forward_timeout_s: float = field(
        default=20.0,
        metadata=knob(
            "--forward-timeout",
            v.seconds,
            "SECONDS",
            "give up on a peer after this",
            note="below reader_timeout_s",
        ),
    )
    forward_mover: ForwardMover = field(
        default=ForwardMover.AUTO,
        metadata=knob(
            "--forward-mover",
            v.choice(ForwardMover),
            "MOVER",
            "forwarded bytes: auto (NIXL, else zmq), nixl or zmq",
            note="auto (NIXL where both sides have it, else ZeroMQ frames), nixl, zmq",
        ),
    )

    """CURVE on TCP control channels (``refitd keygen NAME`` writes ``NAME.key`` and ``NAME.key.pub``).
    ``curve_secret_key`` is this daemon's keypair file (``curve_public_key`` defaults to the public
    key inside it); ``curve_allowed_keys`` a public-key file, or a folder of ``*.pub`` files, of the
    clients allowed in; ``curve_server_key`` the public key of the inference daemons a trainer
    daemon forwards to (one key for every peer). A daemon refuses to listen on a non-loopback TCP
    address, or to forward to a non-loopback peer, without them."""
    curve_secret_key: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-secret-key",
            _OPT_PATH,
            "PATH",
            "this daemon's CURVE keypair (NAME.key)",
            is_path=True,
            example='"/etc/refitd/node.key"',
            note="`refitd keygen node`; needed to listen on a non-loopback tcp://",
        ),
    )
    curve_public_key: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-public-key",
            _OPT_PATH,
            "PATH",
            "its public key (default: from NAME.key)",
            is_path=True,
            example='"/etc/refitd/node.key.pub"',
            note="default: read from curve_secret_key",
        ),
    )
    curve_allowed_keys: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-allowed-keys",
            _OPT_PATH,
            "PATH",
            "clients' public keys: file or dir",
            is_path=True,
            example='"/etc/refitd/clients"',
            note="a *.key.pub file or a folder of them",
        ),
    )
    curve_server_key: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-server-key",
            _OPT_PATH,
            "PATH",
            "the peers' public key (trainer role)",
            is_path=True,
            example='"/etc/refitd/inference.key.pub"',
            note="trainer role: the inference daemons' public key",
        ),
    )
    #: inference role: the trainer daemons' public keys (a file or a folder of ``*.pub``), the only
    #: clients whose FORWARD_* messages it takes; default: every key of ``curve_allowed_keys``
    curve_trainer_keys: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-trainer-keys",
            _OPT_PATH,
            "PATH",
            "inference role: the trainer daemons' public keys, file or dir (default: curve_allowed_keys)",
            is_path=True,
            example='"/etc/refitd/trainers"',
            note="inference role: who may forward; default: curve_allowed_keys",
        ),
    )

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        for name, spec in KNOBS.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, spec.convert(value))
            except (TypeError, ValueError) as exc:
                problems.append(Problem(f"{name} = {value!r}: {exc}", (name,)))
        bad = {p.keys[0] for p in problems}
        if not bad & {"runtime_dir", "listen"} and self.listen is None:
            object.__setattr__(self, "listen", default_listen(self.runtime_dir))
        problems.extend(value_problems(self, bad))
        if problems:
            raise ConfigError(problems)

    def replace(self, **changes: Any) -> DaemonConfig:
        """A copy with ``changes``, validated again. A default ``listen`` follows a new ``runtime_dir``."""
        unknown = [k for k in changes if k not in KNOBS]
        if unknown:
            raise ConfigError(v.unknown(f"setting {k!r}", k, list(KNOBS)) for k in unknown)
        if (
            "runtime_dir" in changes
            and "listen" not in changes
            and self.listen == default_listen(self.runtime_dir)
        ):
            changes["listen"] = None
        return dataclasses.replace(self, **changes)

    @property
    def share(self) -> tuple[Any, int] | None:
        """``(EngineLayout, node_rank)`` when this daemon publishes one node's share of a multi-node
        engine (``nodes > 1``), for ``RefitPlan.build(share=...)``; None: the whole model."""
        if self.nodes == 1:
            return None
        from sidecar.plan.build import EngineLayout

        return EngineLayout(ep=self.engine_ep, tp=self.engine_tp, nodes=self.nodes), int(self.node_rank or 0)

    @property
    def format_params(self) -> FormatParams:
        """The format's parameters these settings give (``int4_group``, ``int4_scale_dtype``,
        ``nvfp4_names``); the config checks made sure they are valid for ``format``."""
        return FormatParams(
            int4_group=self.int4_group, int4_scale_dtype=self.int4_scale_dtype, nvfp4_names=self.nvfp4_names
        )

    @property
    def ring_regions(self) -> int:
        """Staging regions in effect: ``staging_regions``, else 0 on shm and DEFAULT_GPU_REGIONS on cuda."""
        if self.staging_regions is not None:
            return self.staging_regions
        return DEFAULT_GPU_REGIONS if self.arena is ArenaKind.CUDA_IPC else 0

    @property
    def arena_gpu(self) -> str | None:
        """The GPU the arenas go on: ``gpu``, else the first of ``gpus``, else None (CUDA's current)."""
        return self.gpu if self.gpu is not None else (self.gpus[0] if self.gpus else None)

    @property
    def host_generations(self) -> bool:
        """Whether the generations live in host memory: always on shm, and on cuda unless
        ``generation_residency = "device"``."""
        return self.arena is ArenaKind.SHM or self.generation_residency is Residency.HOST

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (str, int, float, list, None) by field name; drop the Nones for TOML."""
        return {name: v.plain(getattr(self, name)) for name in KNOBS}


#: field name -> how it is spelled and converted; the file key is the name, the variable REFITD_<NAME>
KNOBS: dict[str, Knob] = {f.name: f.metadata["knob"] for f in dataclasses.fields(DaemonConfig)}
