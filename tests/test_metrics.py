"""Health and metrics over HTTP (sidecar.ops.metrics): the observer against a fake daemon, then
``refitd serve --metrics-listen`` in a subprocess, scraped before and after a real push."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.net import free_port

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.config.settings import ConfigError
from sidecar.daemon.memory.staging import RingStaging, region_size, ring_groups
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.formats import Format
from sidecar.ops.metrics import PHASES, MetricsObserver, sqnr_db
from sidecar.plan.build import RefitPlan, RefitSpec, Role
from sidecar.plan.run import convert
from transport.layout import nbytes_of

REPO = Path(__file__).resolve().parent.parent
MODEL = "qwen3_5_moe"
SIZES: dict[str, Any] = {"num_layers": 2, "num_experts": 4, "unaligned": True}
START_TIMEOUT_S = 60.0
#: FP8 e4m3 on N(0, 0.02) weights measures about 31.5 dB in every format
SQNR_RANGE_DB = (25.0, 40.0)


# --------------------------------------------------------------------------------------------------
# helpers


def http_get(url: str, path: str, timeout: float = 10.0, **headers: str) -> tuple[int, str, str]:
    """(status, body, content type) of GET ``path``; loopback only."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(), resp.getheader("Content-Type", "")
    finally:
        conn.close()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text exposition, by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(observer: MetricsObserver, name: str, **labels: str) -> float | None:
    return observer.registry.get_sample_value(name, labels)


def record(step: int, generation: int = 0, **seconds: float) -> dict[str, Any]:
    secs = dict.fromkeys(PHASES, 0.01) | seconds
    return {"step": step, "generation": generation, "bytes_in": 1000, "bytes_out": 600, "seconds": secs}


class FakeDaemon(SimpleNamespace):
    """What the observer reads of a daemon: plan, spec, engines, staging and the live generation,
    here backed by a state dict and its in-process conversion."""

    @classmethod
    def converted(cls, fmt: str, seed: int = 1) -> FakeDaemon:
        sd = make_state_dict(MODEL, seed=seed, **SIZES)
        spec = RefitSpec(model_type=MODEL, fmt=fmt)
        outputs = convert(sd, spec)
        live = SimpleNamespace(index=0, step=0, arena=SimpleNamespace(tensor=outputs.__getitem__))
        arenas = SimpleNamespace(
            staging=SimpleNamespace(tensor=sd.__getitem__), live_generation=lambda: live, ring=None
        )
        plan = RefitPlan.build(list(sd.items()), spec)
        return cls(plan=plan, spec=spec, engines={}, arenas=arenas, outputs=outputs, sd=sd)

    def stream_through_ring(self, regions: int) -> None:
        """Stage the step through a ring of ``regions`` as the daemon does: each group written into
        its region when granted, then released; the last ``regions`` groups stay resident."""
        ring = RingStaging(self.plan, regions=regions, capacity=regions * region_size(ring_groups(self.plan)))
        memory = torch.zeros(ring.size, dtype=torch.uint8)
        staging = SimpleNamespace(
            view=lambda offset, dtype, shape: (
                memory[offset : offset + nbytes_of(dtype, shape)].view(dtype).view(shape)
            )
        )
        grants = ring.start()
        while grants:
            gi, _ = grants.pop(0)
            for name in ring.groups[gi].inputs:
                ring.view(staging, name).copy_(self.sd[name])
                ring.tensor_complete(name)
            for unit in ring.groups[gi].units:
                ring.unit_submitted(unit)
                grants += ring.unit_done(unit)
        self.arenas.staging, self.arenas.ring = staging, ring


@pytest.fixture
def observers():
    """MetricsObservers on 127.0.0.1:0, closed after the test."""
    made: list[MetricsObserver] = []

    def make(**kw: Any) -> MetricsObserver:
        made.append(MetricsObserver("127.0.0.1:0", **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


# --------------------------------------------------------------------------------------------------
# the observer, in process


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "fp8_per_tensor"])
def test_sqnr_compares_a_live_weight_with_its_staging_source(observers, fmt):
    """A published step samples one quantized expert weight: FP8 on Gaussian weights gives ~31 dB.
    Zeroing the live weights (a broken publish) drops the next sample to 0 dB."""
    m = observers(sqnr_every=1)
    daemon = FakeDaemon.converted(fmt)
    m.on_step_published(daemon, record(0), None)
    db = value(m, "refitd_quant_sqnr_db", format=fmt)
    assert SQNR_RANGE_DB[0] < db < SQNR_RANGE_DB[1]
    for o in daemon.plan.outputs:
        if o.role is Role.WEIGHT:
            daemon.outputs[o.name].zero_()
    m.on_step_published(daemon, record(1), None)
    assert value(m, "refitd_quant_sqnr_db", format=fmt) == pytest.approx(0.0)


def test_sqnr_with_a_staging_ring_samples_only_groups_still_staged(observers):
    """With a ring only the step's last groups are still in staging (the MTP layer here): every
    sample comes from those, and is a real ~31 dB comparison, never bytes of another group."""
    m = observers(sqnr_every=1)
    daemon = FakeDaemon.converted("block_fp8")
    daemon.stream_through_ring(regions=4)
    ring = daemon.arenas.ring
    resident = [g.label for g in ring.groups if ring.resident(g.inputs[0])]
    assert resident == ["layer mtp.0", *(g.label for g in ring.groups[7:])]
    for step in range(12):
        m.on_step_published(daemon, record(step), None)
        db = value(m, "refitd_quant_sqnr_db", format="block_fp8")
        assert SQNR_RANGE_DB[0] < db < SQNR_RANGE_DB[1], step


def test_sqnr_sampled_every_n_steps_only(observers):
    """With sqnr_every=3, steps 0 and 3 are sampled, 1 and 2 are not: a corruption after step 0
    shows only at step 3."""
    m = observers(sqnr_every=3)
    daemon = FakeDaemon.converted("block_fp8")
    m.on_step_published(daemon, record(0), None)
    good = value(m, "refitd_quant_sqnr_db", format="block_fp8")
    for t in daemon.outputs.values():
        if t.dtype == torch.float8_e4m3fn:
            t.zero_()
    for step in (1, 2):
        m.on_step_published(daemon, record(step), None)
        assert value(m, "refitd_quant_sqnr_db", format="block_fp8") == good
    m.on_step_published(daemon, record(3), None)
    assert value(m, "refitd_quant_sqnr_db", format="block_fp8") == pytest.approx(0.0)


def test_no_sqnr_for_a_forwarded_step(observers):
    """On the inference node of a disaggregated layout a published step was forwarded whole: its
    staging arena never held the source, so nothing is sampled; the step still counts."""
    m = observers(sqnr_every=1)
    m.on_step_published(FakeDaemon.converted("mxfp8"), record(0) | {"forwarded_from": "node-a"}, None)
    assert value(m, "refitd_quant_sqnr_db", format="mxfp8") is None
    assert value(m, "refitd_steps_published_total") == 1


def test_no_sqnr_without_quantized_outputs(observers):
    """Format bf16 publishes nothing quantized: no SQNR series appears, and nothing fails."""
    m = observers(sqnr_every=1)
    m.on_step_published(FakeDaemon.converted("bf16"), record(0), None)
    assert value(m, "refitd_quant_sqnr_db", format="bf16") is None
    assert value(m, "refitd_steps_published_total") == 1


def test_sqnr_db_edges():
    x = torch.ones(4, 4)
    assert sqnr_db(x, x * 0.9) == pytest.approx(20.0)
    assert sqnr_db(x, x) == math.inf
    assert math.isnan(sqnr_db(torch.zeros(2), torch.zeros(2)))
    assert sqnr_db(torch.zeros(2), torch.ones(2)) == -math.inf


def test_step_records_failures_and_loads_become_metrics(observers):
    """Every phase of a record lands in its histogram; bytes add up; the gauges follow the live
    generation; failures count by kind (every kind present from 0); engine loads and failures count."""
    m = observers()
    daemon = FakeDaemon.converted("bf16")
    m.on_step_published(daemon, record(4, generation=1, total=2.0, receive=0.5), None)
    m.on_step_published(daemon, record(5, generation=0, total=3.0), None)
    for phase in PHASES:
        assert value(m, "refitd_step_phase_seconds_count", phase=phase) == 2
    assert value(m, "refitd_step_phase_seconds_sum", phase="total") == pytest.approx(5.0)
    assert value(m, "refitd_step_phase_seconds_bucket", phase="total", le="2.5") == 1
    assert value(m, "refitd_received_bytes_total") == 2000
    assert value(m, "refitd_published_bytes_total") == 1200
    assert value(m, "refitd_last_published_step") == 5 and value(m, "refitd_generation") == 0
    assert value(m, "refitd_last_publish_timestamp_seconds") == pytest.approx(time.time(), abs=60)

    for kind in ErrorKind:
        assert value(m, "refitd_step_failures_total", kind=kind.value) == 0
    m.on_step_failed(daemon, RefitError("bad", kind=ErrorKind.NON_FINITE, step=6))
    m.on_step_failed(daemon, RefitError("gone", kind=ErrorKind.RANK_DIED, rank=1, step=6))
    m.on_step_failed(daemon, RefitError("gone", kind=ErrorKind.RANK_DIED, rank=1, step=7))
    assert value(m, "refitd_step_failures_total", kind="non_finite") == 1
    assert value(m, "refitd_step_failures_total", kind="rank_died") == 2

    results = [
        {"worker": "a", "ok": True, "error": None, "seconds": 0.3},
        {"worker": "b", "ok": False, "error": "OOM", "seconds": 0.1},
        {"worker": "c", "ok": False, "error": "did not acknowledge", "seconds": None},
    ]
    m.on_step_loaded(daemon, {"step": 5, "ok": False, "results": results})
    m.on_step_loaded(daemon, {"step": 6, "ok": False, "results": []})  # no engine attached: no load
    assert value(m, "refitd_engine_loads_total") == 3
    assert value(m, "refitd_engine_load_failures_total") == 2
    assert value(m, "refitd_engine_load_seconds_count") == 2

    daemon.engines = {b"x": object(), b"y": object()}
    m.on_tick(daemon, 0.0)
    assert value(m, "refitd_engines_attached") == 2


def test_messages_answered_with_errors_count_by_kind_and_bugs_apart(observers):
    """Every kind has a refitd_message_errors_total series from 0; an internal error (a bug met
    handling a message) also counts in refitd_internal_errors_total."""
    m = observers()
    daemon = FakeDaemon.converted("bf16")
    for kind in ErrorKind:
        assert value(m, "refitd_message_errors_total", kind=kind.value) == 0
    assert value(m, "refitd_internal_errors_total") == 0
    m.on_message_error(daemon, ErrorKind.PROTOCOL)
    m.on_message_error(daemon, ErrorKind.PROTOCOL)
    m.on_message_error(daemon, ErrorKind.INTERNAL)
    assert value(m, "refitd_message_errors_total", kind="protocol") == 2
    assert value(m, "refitd_message_errors_total", kind="internal") == 1
    assert value(m, "refitd_internal_errors_total") == 1


def test_health_follows_the_serve_loop_and_readiness_the_lifecycle(observers):
    """/healthz turns 503 once the loop has not ticked for 5 heartbeats (2 s at least) and 200 at
    the next tick; /readyz is 503 until on_ready and again from on_stopping. A fake clock: no sleeps."""
    now = [100.0]
    m = observers(heartbeat_interval_s=1.0, clock=lambda: now[0])
    daemon = FakeDaemon.converted("bf16")
    assert m.readiness()[0] == 503 and "starting" in m.readiness()[1]
    m.on_ready(daemon)
    assert m.readiness() == (200, "ready\n") and m.health() == (200, "ok\n")
    now[0] += 4.9
    assert m.health()[0] == 200
    now[0] += 0.2
    code, text = m.health()
    assert code == 503 and "serve loop silent for 5.1 s (limit 5.0 s)" in text
    m.on_tick(daemon, now[0])
    assert m.health()[0] == 200
    m.on_stopping(daemon)
    assert m.readiness() == (503, "shutting down\n")
    assert observers(heartbeat_interval_s=0.1).stale_after_s == 2.0


def test_http_endpoints_in_process(observers):
    """The server answers from on_ready: /healthz, /readyz, /metrics (Prometheus text), 404
    elsewhere; on_stopping closes the port."""
    m = observers()
    assert m.url.startswith("http://127.0.0.1:")
    m.on_ready(FakeDaemon.converted("bf16"))
    assert http_get(m.url, "/healthz")[:2] == (200, "ok\n")
    assert http_get(m.url, "/readyz?verbose=1")[:2] == (200, "ready\n")
    code, body, ctype = http_get(m.url, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=")
    got = samples(body)
    assert got[("refitd_steps_published_total", frozenset())] == 0
    assert got[("refitd_last_published_step", frozenset())] == -1
    assert got[("process_resident_memory_bytes", frozenset())] > 0
    code, body, ctype = http_get(m.url, "/metrics", Accept="application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text") and body.endswith("# EOF\n")
    assert http_get(m.url, "/")[0] == 404
    m.on_stopping(None)
    m.close()  # idempotent
    with pytest.raises(OSError):
        http_get(m.url, "/healthz", timeout=2)


def test_close_before_ready_does_not_hang(observers):
    """A daemon that fails between make_observers and on_ready still frees the port."""
    m = observers()
    m.close()
    m.close()


def test_a_taken_port_is_a_config_error_naming_the_setting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        listen = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ConfigError, match=r"metrics_listen = '127.0.0.1:\d+': cannot listen there"):
            MetricsObserver(listen)


# --------------------------------------------------------------------------------------------------
# refitd serve in a subprocess


@contextlib.contextmanager
def serve(tmp_path: Path, *extra: str):
    """``refitd serve`` with one rank and the small model; yields (process, control endpoint, log)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_hf_config(MODEL, **SIZES)))
    log = tmp_path / "serve.log"
    argv = [
        sys.executable, "-m", "sidecar.cli", "serve",
        "--runtime-dir", str(tmp_path / "run"),
        "--hf-config", str(config),
        "--world-size", "1",
        "--heartbeat-interval", "0.2",
        *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        yield proc, f"ipc://{tmp_path / 'run' / 'control.sock'}", log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def wait_ready(proc: subprocess.Popen, endpoint: str, log: Path) -> None:
    """Until the daemon answers STATUS on its control socket (on_ready ran before its first tick)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with RefitReader(endpoint, name="readiness") as probe:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"refitd serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                probe.status(timeout=0.5)
                return
            except RefitError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"refitd serve not ready:\n{log.read_text()}") from None


def test_serve_exposes_health_and_metrics_that_move_with_a_step(tmp_path):
    """``refitd serve --metrics-listen 127.0.0.1:PORT``: /healthz and /readyz answer 200 once the
    control socket answers; /metrics shows no step. One rank pushes a step: the phase histograms,
    byte counters, step gauges and the block-FP8 SQNR gauge move."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve(tmp_path, "--metrics-listen", f"127.0.0.1:{port}") as (proc, endpoint, log):
        wait_ready(proc, endpoint, log)
        assert http_get(url, "/healthz")[:2] == (200, "ok\n")
        assert http_get(url, "/readyz")[:2] == (200, "ready\n")
        before = samples(http_get(url, "/metrics")[1])
        assert before[("refitd_steps_published_total", frozenset())] == 0
        assert before[("refitd_last_published_step", frozenset())] == -1
        assert before[("refitd_step_phase_seconds_count", frozenset({("phase", "total")}))] == 0

        weights = make_state_dict(MODEL, seed=7, **SIZES)
        with RefitClient(endpoint, 0, 1, timeout=60) as client:
            result = client.push_step(3, weights, timeout=60)
        with RefitReader(endpoint, name="barrier") as probe:
            probe.status(timeout=10)  # the serve loop finished the publish (and its hooks) first

        after = samples(http_get(url, "/metrics")[1])
        assert after[("refitd_steps_published_total", frozenset())] == 1
        assert after[("refitd_last_published_step", frozenset())] == 3
        assert after[("refitd_generation", frozenset())] == result.generation
        assert after[("refitd_received_bytes_total", frozenset())] == sum(t.nbytes for t in weights.values())
        assert after[("refitd_published_bytes_total", frozenset())] > 0
        for phase in PHASES:
            assert after[("refitd_step_phase_seconds_count", frozenset({("phase", phase)}))] == 1
        sqnr = after[("refitd_quant_sqnr_db", frozenset({("format", "block_fp8")}))]
        assert SQNR_RANGE_DB[0] < sqnr < SQNR_RANGE_DB[1]
        assert after[("refitd_step_failures_total", frozenset({("kind", "timeout")}))] == 0
        assert http_get(url, "/healthz")[0] == 200

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    with pytest.raises(OSError):
        http_get(url, "/healthz", timeout=2)


def test_serve_with_a_taken_metrics_port_exits_78(tmp_path):
    """A metrics port already in use is a configuration error: exit 78 (systemd does not restart),
    the message names the setting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with serve(tmp_path, "--metrics-listen", f"127.0.0.1:{port}", "--format", Format.MXFP8.value) as (
            proc,
            _,
            log,
        ):
            assert proc.wait(START_TIMEOUT_S) == 78
    assert f"metrics_listen = '127.0.0.1:{port}': cannot listen there" in log.read_text()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4_w4a16"])
def test_sqnr_of_a_packed_four_bit_weight(observers, fmt):
    """The 4-bit formats' packed weights (and NVFP4's global scale) are decoded for the sample: about
    19-21 dB on Gaussian weights (4 bits: some 10 dB under FP8)."""
    m = observers(sqnr_every=1)
    daemon = FakeDaemon.converted(fmt)
    m.on_step_published(daemon, record(0), None)
    db = value(m, "refitd_quant_sqnr_db", format=fmt)
    assert 15.0 < db < 25.0, db
