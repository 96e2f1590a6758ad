"""Health and Prometheus metrics over HTTP: ``refitd serve --metrics-listen 127.0.0.1:9464``.

A small threaded HTTP server (stdlib, in daemon threads) answers:

============  ===================================================================================
``/healthz``  200 while the serve loop turns (its last tick is under :data:`STALE_AFTER_HEARTBEATS`
              heartbeats old, at least :data:`MIN_STALE_S`), else 503: a liveness probe
``/readyz``   200 once the arenas are allocated and the control socket listens, until shutdown
              begins; 503 otherwise: a readiness probe
``/metrics``  Prometheus text format, from this daemon's own ``CollectorRegistry``
============  ===================================================================================

The metrics (all prefixed ``refitd_``): ``step_phase_seconds{phase}`` (histogram of each phase of
every published step: wait_ranks, validate, receive, quantize, quantize_tail, publish, total),
``steps_published_total``, ``received_bytes_total`` / ``published_bytes_total``, ``generation`` and
``last_published_step`` (the live generation), ``last_publish_timestamp_seconds``,
``engines_attached``, ``quant_sqnr_db{format}`` (see below), ``step_failures_total{kind}`` (one
series per ErrorKind, from 0), ``message_errors_total{kind}`` (messages answered with an error, one
series per ErrorKind) and ``internal_errors_total`` (bugs met handling a message), ``holds_revoked_total`` (reader holds a
step dropped after ``reader_timeout_s``), ``engine_loads_total``, ``engine_load_failures_total`` and
``engine_load_seconds``; and the standard ``process_*`` series (CPU, memory, open files).

Quantization quality is sampled, not measured: every :data:`SQNR_EVERY_STEPS` published steps
(the first one included) one tile (at most :data:`SQNR_TILE`) of one quantized expert weight of the
live generation, both picked at random, is dequantized and compared with its BF16 source still in
the staging arena (not on the inference node of a disaggregated layout, which only receives
generations): ``SQNR = 10 log10(sum x^2 / sum (x - dequant(q))^2)`` in dB. FP8 e4m3 gives about
30 dB on Gaussian weights; a drop means scales or values went wrong.

Threads: the hooks run on the serve loop and are the only code that reads the daemon; the HTTP
threads read only what the hooks stored (prometheus_client's metrics lock themselves, the health
marks sit behind a lock). Usage::

    metrics = MetricsObserver.from_config(config)       # binds the port now: ConfigError if taken
    Daemon(config, observers=[metrics])                 # serves from on_ready, stops on_stopping
"""

from __future__ import annotations

import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder

from sidecar.config.settings import ConfigError, Problem, split_host_port
from sidecar.errors import ErrorKind
from sidecar.numerics.formats import BLOCK, DEFAULT_FORMAT_PARAMS, MX_BLOCK, Format, FormatParams, Nvfp4Names
from sidecar.numerics.reference import dequantize
from sidecar.ops.observers import Observer
from sidecar.plan.build import OutputSpec, RefitPlan, Role

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.context import LoopContext as Daemon  # the serve loop, as it lends itself
    from sidecar.daemon.step import StepState
    from sidecar.errors import RefitError

log = logging.getLogger("refitd.metrics")

#: /healthz turns 503 when the serve loop has not ticked for this many heartbeats...
STALE_AFTER_HEARTBEATS = 5
#: ... and never sooner than this many seconds
MIN_STALE_S = 2.0
#: one SQNR sample every this many published steps (the first published step is sampled)
SQNR_EVERY_STEPS = 10
#: the (rows, cols) tile of the sampled weight compared, at most: a few ms on one CPU core
SQNR_TILE = (128, 2048)
#: tile corners sit on multiples of this: the block-FP8 tile edge, itself a multiple of the MX block
SQNR_ALIGN = 128
#: the phases of a step record's "seconds", in pipeline order
PHASES = ("wait_ranks", "validate", "receive", "quantize", "quantize_tail", "publish", "total")
#: step and engine-load times span milliseconds (a toy model) to minutes (a large one over TCP)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)  # fmt: skip
SERVER_POLL_S = 0.1  # how often the HTTP thread checks for shutdown
NOT_FOUND = b"not found: try /healthz, /readyz or /metrics\n"


class MetricsObserver(Observer):
    """Keeps the daemon's metrics and health, and serves them over HTTP from ``on_ready`` to
    ``on_stopping``. The port is bound at construction, so a taken port fails at start."""

    def __init__(
        self,
        listen: str,
        *,
        heartbeat_interval_s: float = 1.0,
        sqnr_every: int = SQNR_EVERY_STEPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sqnr_every < 1:
            raise ValueError(f"sqnr_every = {sqnr_every}: sample at least every step (1) or more rarely")
        self.clock = clock
        self.stale_after_s = max(MIN_STALE_S, STALE_AFTER_HEARTBEATS * heartbeat_interval_s)
        self.sqnr_every = sqnr_every
        self.registry = CollectorRegistry(auto_describe=True)
        self._define_metrics()
        self._lock = threading.Lock()
        self._ready = False
        self._stopping = False
        self._last_tick = clock()
        self._published = 0
        self._rng = random.Random(0)
        self._candidates: tuple[RefitPlan | None, list[OutputSpec]] = (None, [])
        self._thread: threading.Thread | None = None
        self._closed = False
        self.server = _bind(listen, self)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> MetricsObserver:
        return cls(config.metrics_listen, heartbeat_interval_s=config.heartbeat_interval_s)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _define_metrics(self) -> None:
        r = self.registry
        self.phase_seconds = Histogram(
            "refitd_step_phase_seconds",
            "Seconds each phase of a published step took",
            ["phase"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        for phase in PHASES:
            self.phase_seconds.labels(phase=phase)
        self.steps = Counter("refitd_steps_published", "Steps published", registry=r)
        self.bytes_in = Counter("refitd_received_bytes", "Bytes the trainer ranks pushed", registry=r)
        self.bytes_out = Counter(
            "refitd_published_bytes", "Bytes written into published generations", registry=r
        )
        self.generation = Gauge("refitd_generation", "Index of the live generation (-1: none)", registry=r)
        self.generation.set(-1)
        self.last_step = Gauge(
            "refitd_last_published_step", "Step of the live generation (-1: none)", registry=r
        )
        self.last_step.set(-1)
        self.last_publish = Gauge(
            "refitd_last_publish_timestamp_seconds", "Unix time of the last publish (0: none)", registry=r
        )
        self.engines = Gauge("refitd_engines_attached", "Engine workers attached", registry=r)
        self.sqnr = Gauge(
            "refitd_quant_sqnr_db",
            f"SQNR in dB of one sampled quantized expert weight against its BF16 source, "
            f"every {self.sqnr_every} published steps",
            ["format"],
            registry=r,
        )
        self._quantizer_shown: Any = None
        self.quantizer = Gauge(
            "refitd_quantizer",
            "1 for the quantizer in use (impl: triton kernels, or the torch reference when they cannot "
            "run; reason: why not) on the daemon's device",
            ["impl", "device", "reason"],
            registry=r,
        )
        self.failures = Counter("refitd_step_failures", "Steps failed, by error kind", ["kind"], registry=r)
        for kind in ErrorKind:
            self.failures.labels(kind=kind.value)
        self.message_errors = Counter(
            "refitd_message_errors",
            "Messages answered with an error, by error kind (protocol: malformed; internal: a bug)",
            ["kind"],
            registry=r,
        )
        for kind in ErrorKind:
            self.message_errors.labels(kind=kind.value)
        self.internal_errors = Counter(
            "refitd_internal_errors",
            "Bugs met while handling a message (each logged with its traceback; the daemon serves on)",
            registry=r,
        )
        self.holds_revoked = Counter(
            "refitd_holds_revoked",
            "Reader holds dropped after reader_timeout_s because a step needed the generation (the reader "
            "is told; a copy it was still making may be torn)",
            registry=r,
        )
        self.loads = Counter("refitd_engine_loads", "Engine worker acknowledgements of a step", registry=r)
        self.load_failures = Counter(
            "refitd_engine_load_failures",
            "Engine workers that failed to load a step, or timed out",
            registry=r,
        )
        self.load_seconds = Histogram(
            "refitd_engine_load_seconds",
            "Seconds an engine worker took to load a step",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    # ------------------------------------------------------------------------------------------
    # health, read by the HTTP threads

    def health(self) -> tuple[int, str]:
        """(HTTP status, text) for /healthz: is the serve loop still turning?"""
        with self._lock:
            silent = self.clock() - self._last_tick
        if silent > self.stale_after_s:
            return 503, f"serve loop silent for {silent:.1f} s (limit {self.stale_after_s:.1f} s)\n"
        return 200, "ok\n"

    def readiness(self) -> tuple[int, str]:
        """(HTTP status, text) for /readyz: can the daemon take a push?"""
        with self._lock:
            ready, stopping = self._ready, self._stopping
        if stopping:
            return 503, "shutting down\n"
        if not ready:
            return 503, "starting: arenas or control socket not ready\n"
        return 200, "ready\n"

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type) of the metrics, in the format ``accept`` (an Accept header) asks
        for: OpenMetrics or, by default, the Prometheus text format."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    # ------------------------------------------------------------------------------------------
    # hooks, on the serve loop

    def _show_quantizer(self, daemon: Daemon) -> None:
        """The gauge names the daemon's quantizer; a new one (an engine's format parameters probed
        when the plan was adopted) replaces the old labels."""
        quantizer = getattr(daemon, "quantizer", None)
        if quantizer is None or quantizer is self._quantizer_shown:
            return
        self.quantizer.clear()
        self.quantizer.labels(
            impl=quantizer.impl, device=quantizer.device, reason=quantizer.reason or ""
        ).set(1)
        self._quantizer_shown = quantizer

    def on_ready(self, daemon: Daemon) -> None:
        self._show_quantizer(daemon)
        with self._lock:
            self._ready, self._last_tick = True, self.clock()
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self.server.serve_forever,
                kwargs={"poll_interval": SERVER_POLL_S},
                name="refitd-metrics",
                daemon=True,
            )
            self._thread.start()
            log.info("health and metrics on %s (/healthz, /readyz, /metrics)", self.url)

    def on_tick(self, daemon: Daemon, now: float) -> None:
        with self._lock:
            self._last_tick = self.clock()
        self.engines.set(len(daemon.engines))
        self._show_quantizer(daemon)

    def on_step_published(self, daemon: Daemon, record: dict[str, Any], state: StepState) -> None:
        seconds = record["seconds"]
        for phase in PHASES:
            if phase in seconds:
                self.phase_seconds.labels(phase=phase).observe(seconds[phase])
        self.steps.inc()
        self.bytes_in.inc(record["bytes_in"])
        self.bytes_out.inc(record["bytes_out"])
        self.generation.set(record["generation"])
        self.last_step.set(record["step"])
        self.last_publish.set(time.time())
        if "forwarded_from" in record:
            return  # a disaggregated inference node: its staging arena never held this step's source
        if self._published % self.sqnr_every == 0:
            self._sample_sqnr(daemon)
        self._published += 1

    def on_step_failed(self, daemon: Daemon, err: RefitError) -> None:
        self.failures.labels(kind=err.kind.value).inc()

    def on_message_error(self, daemon: Daemon, kind: ErrorKind) -> None:
        self.message_errors.labels(kind=kind.value).inc()
        if kind is ErrorKind.INTERNAL:
            self.internal_errors.inc()

    def on_hold_revoked(self, daemon: Daemon, reader: str, generation: int, step: int | None) -> None:
        self.holds_revoked.inc()

    def on_step_loaded(self, daemon: Daemon, report: dict[str, Any]) -> None:
        for row in report["results"]:
            self.loads.inc()
            if not row["ok"]:
                self.load_failures.inc()
            if row.get("seconds") is not None:
                self.load_seconds.observe(row["seconds"])

    def on_stopping(self, daemon: Daemon) -> None:
        with self._lock:
            self._stopping = True
        self.close()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:  # shutdown() waits for serve_forever: only once it ran
            self.server.shutdown()
            self._thread.join(timeout=5)
        self.server.server_close()

    # ------------------------------------------------------------------------------------------
    # quantization quality

    def _sample_sqnr(self, daemon: Daemon) -> None:
        """SQNR of one quantized weight of the live generation against staging (a few ms at most).

        With a staging ring only the groups the ring's regions still hold are candidates (the last
        ``staging_regions`` groups of the step: the final layers, the norm, lm_head)."""
        plan, live = daemon.plan, daemon.arenas.live_generation()
        if plan is None or live is None:
            return
        if self._candidates[0] is not plan:  # the plan changes when an engine needs a re-plan
            self._candidates = (plan, [o for o in plan.outputs if o.role is Role.WEIGHT])
        weights, ring = self._candidates[1], daemon.arenas.ring
        if ring is not None:  # a staging ring keeps only the step's last groups: sample among those
            weights = [o for o in weights if ring.resident(o.source)]
        if not weights:
            return  # format bf16, or every routed expert kept in BF16
        out = self._rng.choice(weights)
        fmt, params = daemon.spec.fmt, plan.spec.params
        t0 = time.perf_counter()
        arenas = daemon.arenas
        if ring is None:
            src = arenas.staging.tensor(out.source)
        else:  # several GPUs: in the staging arena of the GPU its group was placed on
            src = ring.resident_view(arenas.stagings if ring.lanes > 1 else arenas.staging, out.source)
        src = out.source_view(src)
        q, scale = live.arena.tensor(out.name), live.arena.tensor(out.scale_name)
        extra = None if out.extra_name is None else live.arena.tensor(out.extra_name)
        align = max(SQNR_ALIGN, params.k_multiple(fmt) or 1)  # an INT4 group over 128: whole groups
        rows, cols = (self._window(n, edge, align) for n, edge in zip(src.shape[-2:], SQNR_TILE))
        db = sqnr_db(
            src[rows, cols].to(q.device), dequantize_tile(q, scale, fmt, rows, cols, extra, params)
        )  # host tier: q on host
        if math.isnan(db):
            return
        self.sqnr.labels(format=fmt.value).set(db)
        log.debug(
            "SQNR of %s [%d:%d, %d:%d]: %.2f dB (%.2f ms)",
            out.name,
            rows.start,
            rows.stop,
            cols.start,
            cols.stop,
            db,
            1e3 * (time.perf_counter() - t0),
        )

    def _window(self, n: int, edge: int, align: int = SQNR_ALIGN) -> slice:
        """A random ``slice`` of at most ``edge`` of ``range(n)``, starting on a multiple of ``align``."""
        start = self._rng.randrange(0, n - edge + 1, align) if n > edge else 0
        return slice(start, min(n, start + edge))


def dequantize_tile(
    q: torch.Tensor,
    scale: torch.Tensor,
    fmt: Format,
    rows: slice,
    cols: slice,
    extra: torch.Tensor | None = None,
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
) -> torch.Tensor:
    """Float32 values of ``q[rows, cols]`` (a 2-D weight) without dequantizing the rest. Both slices
    start on a multiple of the format's block (128 covers them all, but an INT4 group over 128);
    ``cols`` ends on one, or at the last column. ``cols`` count unpacked elements for the 4-bit
    formats; ``extra`` is NVFP4's global scale (``weight_scale_2``, or compressed-tensors'
    ``weight_global_scale``, its reciprocal, under ``params.nvfp4_names``)."""
    if fmt.four_bit:
        per_value = {Format.NVFP4: 2, Format.MXFP4: 2, Format.INT4_W4A16: 8}[fmt]
        block = params.k_multiple(fmt) or 1
        packed = q[rows, cols.start // per_value : -(-cols.stop // per_value)]
        scales = scale[rows, cols.start // block : -(-cols.stop // block)]
        if fmt is Format.NVFP4 and extra is not None and params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS:
            extra = torch.reciprocal(extra.reshape(()))  # gs back: 1 / float32(1 / gs) may differ by an ulp
        return dequantize(packed, scales, fmt, global_scale=extra)
    if fmt is Format.BLOCK_FP8:
        scale = scale[
            rows.start // BLOCK : -(-rows.stop // BLOCK), cols.start // BLOCK : -(-cols.stop // BLOCK)
        ]
    elif fmt is Format.MXFP8:
        scale = scale[rows, cols.start // MX_BLOCK : -(-cols.stop // MX_BLOCK)]
    return dequantize(q[rows, cols], scale, fmt)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (ref - approx)^2)``: inf when exact, nan when both are zero."""
    ref = reference.float()
    signal = float(ref.square().sum())
    noise = float((ref - approx.float()).square().sum())
    if noise == 0.0:
        return math.nan if signal == 0.0 else math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


# --------------------------------------------------------------------------------------------------
# the HTTP side


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "refitd"

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        observer = self.server.observer
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = observer.exposition(self.headers.get("Accept"))
            code = 200
        elif path in ("/healthz", "/readyz"):
            code, text = observer.health() if path == "/healthz" else observer.readiness()
            ctype, body = "text/plain; charset=utf-8", text.encode()
        else:
            code, ctype, body = 404, "text/plain; charset=utf-8", NOT_FOUND
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    observer: MetricsObserver


class _Server6(_Server):
    address_family = socket.AF_INET6


def _bind(listen: str, observer: MetricsObserver) -> _Server:
    """A server bound and listening on ``listen`` (HOST:PORT); ConfigError naming the setting if not."""
    host, port = split_host_port(listen)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server = (_Server6 if family == socket.AF_INET6 else _Server)((host, port), _Handler)
    except OSError as exc:
        raise ConfigError(
            [
                Problem(
                    f"metrics_listen = {listen!r}: cannot listen there: {exc.strerror or exc}; choose "
                    "another HOST:PORT with --metrics-listen, or leave it unset",
                    ("metrics_listen",),
                )
            ]
        ) from None
    server.observer = observer
    return server
