"""``refitd serve`` and ``refitd status``.

Exit codes of ``refitd serve`` (the unit file's ``RestartPreventExitStatus=`` uses the first):

====  ==========================================================================================
78    configuration error (EX_CONFIG): bad flags, variables or file; fix them, restarting won't help
1     runtime failure: the daemon could not start (e.g. no shared memory) or failed while serving
0     clean shutdown (SIGTERM / SIGINT): every segment unlinked, every in-flight step answered
2     command-line usage error (argparse)
====  ==========================================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator

from sidecar.config.settings import EXIT_CONFIG, ConfigError, prepare_runtime_dir
from sidecar.config.sources import add_serve_arguments, config_from_args
from sidecar.errors import ErrorKind, RefitError
from sidecar.ops.logs import setup_logging

log = logging.getLogger("refitd.serve")

DUPLICATE_SIGNAL_S = 1.0  # a second stop signal sooner than this is the same request
EXIT_OK = 0
EXIT_FAILURE = 1


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)
    status = sub.add_parser("status", help="ask a running daemon how it is doing")
    status.add_argument(
        "--listen", "--endpoint", dest="endpoint", default=None, help="the daemon's control endpoint"
    )
    status.add_argument("--runtime-dir", default=None, help="find the endpoint in this runtime directory")
    status.add_argument("--json", action="store_true", help="print the raw status object")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(run=run_status)
    return serve


class Signals:
    """What the process was asked by signal, kept as flags; the serve loop acts on them.

    The handlers only set flags (as uvicorn's ``should_exit`` / ``force_exit``; gunicorn's arbiter
    queues signals for its loop): raising from a handler would unwind whatever the loop was doing at
    that instant. :meth:`poll` runs on the loop after every tick and turns the flags into requests.

    - SIGTERM / SIGINT: ``should_exit`` (stop, draining the step in flight as ``drain`` says);
    - the same again, more than ``DUPLICATE_SIGNAL_S`` after the first (Slurm may deliver two at
      once): ``force_exit`` (stop draining now, exit 1);
    - SIGHUP: ``reload`` (re-read the configuration; apply what may change safely).

    Usage::

        signals = Signals(lambda: config_from_args(args))
        with signals.installed():
            daemon.serve_forever(signals.poll)
    """

    STOP = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, load_config=None, *, clock=time.monotonic):
        self.should_exit = False
        self.force_exit = False
        self.reload = False
        self._load_config, self._clock = load_config, clock
        self._first: float | None = None  # when the first stop signal came
        self._stop_sent = self._force_sent = False

    # ---- the handlers: flags only

    def on_stop(self, signum: int, frame: object = None) -> None:
        now = self._clock()
        if self._first is None:
            self._first, self.should_exit = now, True
        elif now - self._first > DUPLICATE_SIGNAL_S:
            self.force_exit = True

    def on_reload(self, signum: int, frame: object = None) -> None:
        self.reload = True

    @contextlib.contextmanager
    def installed(self, *, until_exit: bool = False) -> Iterator[Signals]:
        """The handlers installed for the block; the previous ones restored after it, but for the
        stop signals with ``until_exit`` (``refitd serve``, whose process ends after the block): those
        are ignored from then on. Slurm signals every process of a step twice a few milliseconds
        apart, and an idle daemon stops cleanly in less; the duplicate must not find the default
        action, which would kill the exiting daemon and turn its status 0 into 143 (a failed job).
        Keeping the Python handler is not enough: interpreter shutdown puts SIG_DFL back wherever a
        Python handler is set (CPython's ``_PySignal_Fini``), but leaves SIG_IGN alone; a stop that
        hangs after this is still ended by SIGKILL, which Slurm and systemd send after their
        timeouts."""
        previous = {s: signal.signal(s, self.on_stop) for s in self.STOP}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.on_reload)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, signal.SIG_IGN if until_exit and s in self.STOP else h)

    # ---- the loop's side

    def poll(self, daemon) -> None:
        """Act on the flags (on the serve loop, after each tick): each request is made once."""
        if self.reload:
            self.reload = False
            if self._load_config is not None:
                daemon.request_reload(self._load_config)
        if self.should_exit and not self._stop_sent:
            self._stop_sent = True
            log.info("stop requested by signal")
            daemon.request_stop()
        if self.force_exit and not self._force_sent:
            self._force_sent = True
            log.error("second stop signal: stopping at once, without draining")
            daemon.request_stop()  # a second request: no draining


def make_observers(config) -> list:
    """The operations features watching this daemon (systemd notify, metrics, timelines)."""
    from sidecar.ops.systemd import SystemdNotifier

    observers: list = []
    notifier = SystemdNotifier(os.environ)  # the one read of $NOTIFY_SOCKET / $WATCHDOG_*
    if notifier.enabled:  # under systemd only; otherwise nothing is sent
        observers.append(notifier)
    if config.metrics_listen is not None:
        from sidecar.ops.metrics import MetricsObserver  # prometheus_client loads only when asked for

        observers.append(MetricsObserver.from_config(config))
    if config.timeline_dir is not None:
        from sidecar.ops.timeline import TimelineObserver

        observers.append(TimelineObserver(config.timeline_dir))
    return observers


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        prepare_runtime_dir(config.runtime_dir)
    except ConfigError as exc:
        print(f"refitd: configuration error:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log_format.value, config.log_level.level)
    from sidecar.daemon.loop import Daemon  # torch and zmq load only for a valid config

    try:
        daemon = Daemon(config, observers=make_observers(config))
    except (RefitError, ValueError) as exc:
        kind = getattr(exc, "kind", None)
        print(f"refitd: cannot start: {exc}", file=sys.stderr)
        return (
            EXIT_CONFIG
            if kind in (ErrorKind.INVALID, ErrorKind.CAPACITY) or isinstance(exc, ValueError)
            else EXIT_FAILURE
        )
    except OSError as exc:
        print(f"refitd: cannot allocate shared memory: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    signals = Signals(lambda: config_from_args(args))
    try:
        with signals.installed(until_exit=True):
            daemon.start()
            daemon.serve_forever(signals.poll)
    except Exception:
        log.exception("refitd failed while serving")
        return EXIT_FAILURE
    finally:
        daemon.close()
    if daemon.fatal is not None:  # a sticky CUDA error: exit 1 so systemd, Slurm or Ray restarts it
        log.critical("refitd stopped: %s; exiting with status %d for a restart", daemon.fatal, EXIT_FAILURE)
        return EXIT_FAILURE
    if signals.force_exit:
        log.warning("refitd stopped without draining (a second stop signal)")
        return EXIT_FAILURE
    log.info("refitd stopped cleanly")
    return EXIT_OK


def run_status(args: argparse.Namespace) -> int:
    from sidecar.config.settings import default_listen, default_runtime_dir

    endpoint = args.endpoint
    if endpoint is None:
        runtime = args.runtime_dir or default_runtime_dir(os.environ)
        endpoint = default_listen(runtime)
    try:
        status = query_status(endpoint, timeout=args.timeout)
    except RefitError as exc:
        print(f"refitd status: no daemon answered at {endpoint}: {exc.message}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    print(render_status(status))
    return EXIT_OK


#: what ``adapters.base.RefitReader`` accepts from the daemon (a status with many steps is large)
_STATUS_HEADER_BYTES = 256 << 20


def query_status(endpoint: str, timeout: float) -> dict:
    """The daemon's STATUS_REPLY fields: what ``adapters.base.RefitReader(endpoint).status(timeout)``
    returns, with the same messages on the wire, but importing only pyzmq and ``transport.wire``.
    The reader imports torch and the arena code, seconds that ``refitd status`` (polled by readiness
    checks) must not spend. Raises ``RefitError`` (``TIMEOUT``) when nothing answers in time."""
    import zmq

    from transport.wire import Kind, Limits, Message, decode, encode

    limits = Limits(max_header_bytes=_STATUS_HEADER_BYTES)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def courtesy(kind: Kind, fields: dict) -> None:  # never blocks: dropped if no connection came up
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            sock.send_multipart(encode(Message(kind, fields)), zmq.NOBLOCK)

    try:
        deadline = time.monotonic() + timeout
        sock.send_multipart(encode(Message(Kind.STATUS, {})))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                courtesy(Kind.WAIT, {"cancel": True})
                raise RefitError(
                    f"no answer from {endpoint} within the timeout while waiting for STATUS_REPLY",
                    kind=ErrorKind.TIMEOUT,
                )
            if sock.poll(int(min(left, 1.0) * 1000)):
                msg = decode(sock.recv_multipart(copy=False), limits)
                if msg.kind is Kind.STATUS_REPLY:
                    return msg.fields
    finally:
        courtesy(Kind.DETACH, {})
        sock.close(linger=100)
        ctx.term()


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def format_label(fmt: str, params: dict | None) -> str:
    """``int4_w4a16 (group 128, float32 scales)``: a format with the parameters that apply to it
    (SPEC §1.7, §2.3); the bare format where none do or the status (an older daemon's) has none."""
    from sidecar.numerics.formats import Format, FormatParams

    try:
        described = FormatParams.from_wire(params).describe(Format.parse(fmt)) if params else ""
    except ValueError:
        described = f"format parameters {params!r:.120}"
    return f"{fmt} ({described})" if described else fmt


def render_status(s: dict) -> str:
    lines = [
        f"refitd {s['instance']} pid {s['pid']} on {s['host']}, listening on {s['listen']}",
        f"format {format_label(s['format'], s.get('format_params'))}, world_size {s['world_size']}, "
        f"last published step {s['last_step']}",
    ]
    if q := s.get("quantizer"):
        how = (
            f"triton kernels on {q['device']} ({q['compiled']} specialisations compiled in {q['seconds']:.1f} s)"
            if q["impl"] == "triton"
            else f"native kernels on {q['device']} (loaded in {q['seconds']:.1f} s)"
            if q["impl"] == "native"
            else f"torch reference on {q['device']} ({q['reason']})"
        )
        lines.append(f"quantizer: {how}")
    if s.get("step_in_progress"):
        p = s["step_in_progress"]
        lines.append(f"step {p['step']} in progress: begun {p['begun']}, committed {p['committed']}")
    if share := (s.get("plan") or {}).get("share"):
        lines.append(
            f"node share: node {share['node_rank']} of {share['nodes']} (engine EP {share['engine_ep']}, TP "
            f"{share['engine_tp']}); {share['dropped_inputs']} inputs of other nodes' experts skipped"
        )
    lines.append(f"{'generation':<12}{'step':>8}{'holders':>9}  segment")
    for g in s.get("generations", []):
        live = " (live)" if s.get("live") and s["live"]["generation"] == g["generation"] else ""
        lines.append(f"{g['generation']:<12}{g['step']!s:>8}{g['holders']:>9}  {g['segment']}{live}")
    if s.get("revoked_holds"):
        lines.append(
            f"holds revoked after reader_timeout_s: {s['revoked_holds']} (those readers were told; "
            "a copy still in progress may have been torn)"
        )
    staging = s.get("staging") or {}
    ring = staging.get("ring")
    if ring:
        held = ", ".join(ring.get("held") or []) or "none"
        lines.append(
            f"staging: ring of {ring['regions']} x {_mib(ring['region_bytes'])} for {ring['groups']} layer "
            f"groups ({_mib(staging['bytes'])}); held now: {held}"
        )
    elif staging:
        lines.append(f"staging: whole steps ({_mib(staging['bytes'])})")
    tiers = s.get("tiers") or {}
    if tiers.get("device_budget"):  # GPU arenas: the device tier within its budget (docs/multi_gpu.md)
        where = (
            f"host memory ({_mib(tiers['pinned_bytes'])} page-locked)"
            if tiers["generations"] == "shm"
            else "GPU memory"
        )
        rings = tiers.get("rings") or []
        budget = _mib(tiers["device_budget"])
        within = (
            f"on {len(rings)} GPUs, each within a {budget} budget"
            if len(rings) > 1
            else f"of a {budget} budget"
        )
        lines.append(f"device memory: {_mib(tiers['device_bytes'])} {within}; generations in {where}")
        for r in rings if len(rings) > 1 else ():  # several GPUs: each one's rings (docs/multi_gpu.md)
            publish = f" + publish {_mib(r['publish_bytes'])}" if r.get("publish_bytes") else ""
            lines.append(
                f"  cuda:{r['device']} ({r['gpu']}): staging {_mib(r['staging_bytes'])}{publish}, "
                f"{_mib(r['device_bytes'])} of the budget; {r['groups']} groups; "
                f"held now: {', '.join(r['held']) or 'none'}"
            )
    lines.append(f"trainer ranks connected: {s.get('trainers')}; readers: {s.get('readers')}")
    for e in s.get("engines", []):
        lines.append(
            f"  engine {e['name']}: {e['engine']} {e['version']}, MoE backend {e['moe_backend']}, "
            f"experts {format_label(e['expert_format'], e.get('format_params'))}"
        )
    for name, peer in (s.get("peers") or {}).items():
        lines.append(f"  peer {name}: {peer}")
    for h in s.get("history", [])[-5:]:
        secs = " ".join(f"{k}={v:.3f}s" for k, v in h["seconds"].items())
        lines.append(f"  step {h['step']}: {h['bytes_in']} B in, {h['bytes_out']} B out; {secs}")
    from transport.gpus import GpuInfo, render_gpus

    gpus = [GpuInfo.from_wire(g) for g in s.get("gpus", [])]
    lines.append(render_gpus(gpus, s.get("arenas", []), reason=s.get("gpus_reason")))
    return "\n".join(lines)
