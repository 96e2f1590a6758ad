"""Per-step timelines (sidecar.ops.timeline): a real serve loop in a thread of the test process, a
trainer rank and an engine worker; each step's file is read back as a Chrome trace."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from support.daemons import RunningDaemon

from adapters.engine import EngineWorker
from adapters.reference import ReferenceEngine
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.config.settings import ConfigError, DaemonConfig
from sidecar.daemon.step import StepState
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.formats import Format
from sidecar.ops.timeline import (
    FIRST_ENGINE_TID,
    PHASES_TID,
    STEP_TID,
    WORKER_TID,
    TimelineObserver,
    timeline_path,
)

pytestmark = pytest.mark.timeout(180)

MODEL = "qwen3_5_moe"
SIZES = {"num_layers": 2, "num_experts": 4, "unaligned": True}
CONFIG = make_hf_config(MODEL, **SIZES)
PHASE_EVENTS = {"wait_ranks", "validate", "receive", "publish"}


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_state_dict(MODEL, seed=200 + step, **SIZES)


class Serving(NamedTuple):
    """A RunningDaemon with a TimelineObserver writing into ``timelines``."""

    daemon: RunningDaemon
    timelines: Path

    @property
    def endpoint(self) -> str:
        return self.daemon.endpoint

    def barrier(self) -> None:
        self.daemon.barrier()


@pytest.fixture
def serving(tmp_path, daemons) -> Serving:
    timelines = tmp_path / "timelines"
    d = daemons(
        hf_config=CONFIG,
        format="block_fp8",
        reader_timeout_s=10.0,
        timeline_dir=timelines,
        observers=[TimelineObserver(timelines)],
    )
    return Serving(d, timelines)


def load_trace(path: Path) -> dict:
    doc = json.loads(path.read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M", "i") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["ts"] >= -1.0 and e["dur"] >= 0
    return doc


def spans(doc: dict, tid: int | None = None) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and (tid is None or e["tid"] == tid)]


def test_a_published_step_has_every_phase_every_unit_and_each_engine_load(serving):
    """One rank pushes step 0 and an engine worker loads it: step-000000.json holds the step, its
    phases in order, a quantize span enclosing one event per plan unit, and one load per worker,
    each on its named track."""
    engine = ReferenceEngine.from_config(CONFIG, expert_format="block_fp8")
    worker = EngineWorker(
        serving.endpoint, name="ref-0", manifest=engine.manifest(), load=lambda g: engine.load(g.tensors)
    )
    worker.attach(timeout=30)
    with ThreadPoolExecutor(1) as pool, RefitClient(serving.endpoint, 0, 1, timeout=60) as client:
        loading = pool.submit(worker.load_next, 0, 60)
        result = client.push_step(0, weights(0), wait="loaded", timeout=60)
        assert loading.result().ok
    serving.barrier()
    worker.detach()

    doc = load_trace(timeline_path(serving.timelines, 0))
    other = doc["otherData"]
    assert (other["step"], other["generation"], other["format"]) == (0, result.generation, "block_fp8")
    assert other["loads"]["ok"] is True and set(other["seconds"]) >= {"receive", "quantize", "total"}
    names = {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert names == {
        STEP_TID: "step",
        PHASES_TID: "phases",
        WORKER_TID: "worker",
        FIRST_ENGINE_TID: "engine ref-0",
    }

    (step,) = spans(doc, STEP_TID)
    assert step["name"] == "step 0" and step["ts"] == 0
    phases = {e["name"]: e for e in spans(doc, PHASES_TID)}
    assert set(phases) == PHASE_EVENTS
    order = [phases[n]["ts"] for n in ("wait_ranks", "validate", "receive", "publish")]
    assert order == sorted(order)
    assert phases["publish"]["ts"] + phases["publish"]["dur"] <= step["ts"] + step["dur"] + 1

    worker_spans = spans(doc, WORKER_TID)
    (quantize,) = [e for e in worker_spans if e["name"] == "quantize"]
    units = [e for e in worker_spans if e["name"] != "quantize"]
    plan = serving.daemon.daemon.plan
    assert sorted(e["args"]["unit"] for e in units) == list(range(len(plan.units)))
    for e in units:
        unit = plan.units[e["args"]["unit"]]
        assert e["name"] == " + ".join(unit.inputs) and e["cat"] == unit.kind.value
        assert quantize["ts"] <= e["ts"] + 1 and e["ts"] + e["dur"] <= quantize["ts"] + quantize["dur"] + 1
    assert {e["cat"] for e in units} == {"slab", "passthrough"}

    (load,) = spans(doc, FIRST_ENGINE_TID)
    assert load["name"] == "load" and load["args"]["worker"] == "ref-0" and load["args"]["ok"] is True
    assert load["ts"] == pytest.approx(phases["publish"]["ts"] + phases["publish"]["dur"], abs=1)


def test_a_failed_step_gets_its_own_file_and_the_next_step_without_engines_is_written_at_once(serving):
    """Step 1 carries a NaN and fails: step-000001-failed.json shows what ran and a "failed" event
    naming the kind. Step 2, with no engine attached, is written as soon as it is published."""
    bad = weights(1)
    bad["model.language_model.layers.1.mlp.experts.down_proj"][2, 0, 0] = float("nan")
    with RefitClient(serving.endpoint, 0, 1, timeout=60) as client:
        with pytest.raises(RefitError) as err:
            client.push_step(1, bad, timeout=60)
        assert err.value.kind is ErrorKind.NON_FINITE
        client.push_step(2, weights(2), timeout=60)
    serving.barrier()

    failed = load_trace(timeline_path(serving.timelines, 1, failed=True))
    assert failed["otherData"]["error"]["kind"] == "non_finite"
    (event,) = [e for e in failed["traceEvents"] if e["ph"] == "i"]
    assert event["name"] == "failed" and event["args"]["kind"] == "non_finite"
    assert {e["name"] for e in spans(failed, PHASES_TID)} == PHASE_EVENTS - {"publish"}
    assert not timeline_path(serving.timelines, 1).exists()

    done = load_trace(timeline_path(serving.timelines, 2))
    assert done["otherData"]["loads"]["ok"] is False  # nobody attached to load it
    assert spans(done, FIRST_ENGINE_TID) == []
    assert len([e for e in spans(done, WORKER_TID) if e["name"] != "quantize"]) == len(
        serving.daemon.daemon.plan.units
    )


def test_stopping_writes_steps_still_waiting_for_their_engines(tmp_path):
    """A published step whose engine round never finished is written when the daemon stops."""
    obs = TimelineObserver(tmp_path / "t")
    state = StepState(7, 1, deadline=0.0)
    p = state.phases
    p.first_begin, p.all_begun, p.all_received, p.quant_start, p.quant_end, p.published = (
        10,
        11,
        12,
        11.5,
        12.5,
        13,
    )
    state.ready_sent = True
    daemon = SimpleNamespace(spec=SimpleNamespace(fmt=Format.MXFP8), plan=None, step=None)
    obs.on_unit_done(daemon, 7, 0, 11.6, 0.5)
    obs.on_step_published(
        daemon, {"step": 7, "generation": 1, "bytes_in": 1, "bytes_out": 1, "seconds": {}}, state
    )
    assert not timeline_path(obs.directory, 7).exists()
    obs.on_stopping(daemon)
    doc = load_trace(timeline_path(obs.directory, 7))
    assert doc["otherData"]["loads"]["ok"] is None
    (unit,) = [e for e in spans(doc, WORKER_TID) if e["name"] == "unit 0"]
    assert unit["ts"] == pytest.approx(1.6e6) and unit["dur"] == pytest.approx(0.5e6)
    assert {e["name"]: e["dur"] for e in spans(doc, PHASES_TID)}["publish"] == pytest.approx(0.5e6)


def test_an_unusable_timeline_dir_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"timeline_dir = .*cannot create it"):
        TimelineObserver(tmp_path / "file" / "sub")
    with pytest.raises(ConfigError, match="is not a directory"):
        DaemonConfig(runtime_dir=tmp_path, timeline_dir=tmp_path / "file")
