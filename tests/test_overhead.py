"""The per-tensor fast paths: batched passthrough units in the worker, one foreach copy, the paused
garbage collector, the plan's cached unit lookups, the client's batched local copies. Behaviour only:
the same results and the same errors as the one-by-one paths (no timing assertions)."""

from __future__ import annotations

import gc
import queue
import weakref

import pytest
import torch
import zmq

from sidecar.client import RefitClient
from sidecar.client import local as local_mod
from sidecar.client import pieces as pieces_mod
from sidecar.daemon import worker as worker_mod
from sidecar.daemon.copyout import check_copied
from sidecar.daemon.step import StepState
from sidecar.daemon.worker import QuantWorker, all_finite, batches
from sidecar.errors import RefitError
from sidecar.numerics.reference import NonFiniteError
from sidecar.ops.gcpause import StepHold, freeze_long_lived, gc_paused
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from sidecar.plan.run import run_passthroughs, run_unit
from transport.wire import Kind

N = 40


def small_plan(n: int = N, numel: int = 64, fmt: str = "bf16") -> RefitPlan:
    specs = [TensorSpec(f"bench.small.{i}.weight", torch.bfloat16, (numel,)) for i in range(n)]
    return RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt=fmt))


# ---- the plan


def test_units_for_input_is_cached_and_unchanged():
    plan = small_plan()
    for inp in plan.inputs:
        units = plan.units_for_input(inp.name)
        assert units == tuple(plan.units[i] for i in plan._units_of_input[inp.name])
        assert plan.units_for_input(inp.name) is units
    with pytest.raises(ValueError, match="no input named 'nope' in this plan"):
        plan.units_for_input("nope")
    assert plan == small_plan()  # the cache takes no part in equality
    assert "_input_units" not in repr(plan)


# ---- batching in the worker


def job(unit, step=0, sync=False):
    return (step, unit, dict, dict, sync)


def test_batches_group_consecutive_small_passthroughs_of_one_step():
    units = small_plan(10).units
    jobs = [job(u) for u in units[:4]] + [job(units[4], step=1)] + [job(u, step=1) for u in units[5:7]]
    jobs += [job(units[7], sync=True), job(units[8]), job(units[9])]
    runs = batches(jobs)
    assert [[j[1].index for j in run] for run in runs] == [[0, 1, 2, 3], [4, 5, 6], [7], [8, 9]]
    assert [j for run in runs for j in run] == jobs  # order kept


def test_batches_respect_the_limits(monkeypatch):
    units = small_plan(10).units
    monkeypatch.setattr(worker_mod, "BATCH_MAX_UNITS", 3)
    assert [len(r) for r in batches([job(u) for u in units])] == [3, 3, 3, 1]
    monkeypatch.setattr(worker_mod, "BATCH_MAX_UNITS", 256)
    monkeypatch.setattr(worker_mod, "BATCH_MAX_BYTES", 2 * units[0].bytes_in)
    assert [len(r) for r in batches([job(u) for u in units])] == [2, 2, 2, 2, 2]
    monkeypatch.setattr(worker_mod, "BATCH_UNIT_BYTES", units[0].bytes_in - 1)
    assert [len(r) for r in batches([job(u) for u in units])] == [1] * 10


def expert_plan(fmt: str = "block_fp8", experts: int = 2) -> RefitPlan:
    specs = []
    for e in range(experts):
        for proj, shape in (("gate_proj", (256, 128)), ("up_proj", (256, 128)), ("down_proj", (128, 256))):
            specs.append(TensorSpec(f"model.layers.0.mlp.experts.{e}.{proj}.weight", torch.bfloat16, shape))
    specs += [
        TensorSpec("model.layers.0.input_layernorm.weight", torch.bfloat16, (128,)),
        TensorSpec("model.layers.0.post_attention_layernorm.weight", torch.bfloat16, (128,)),
    ]
    return RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt=fmt))


def cpu_job(unit, step=0, sync=False, device="cpu"):
    """A job whose output buffers are on ``device`` (only their device is looked at)."""
    outs = {o.name: torch.empty(0, device=device) for o in unit.outputs}
    return (step, unit, {}, outs, sync)


def test_batches_group_cpu_quantizations_of_one_step_and_format():
    """Quantizing units on the CPU queued back to back share a run (one split across the threads
    for all of them), apart from passthroughs, other steps, a unit closing a ring group (sync), and
    units on another device; at most BATCH_QUANT_BYTES of input a run."""
    plan = expert_plan(experts=4)
    quant = [u for u in plan.units if u.fmt is not None]
    small = [u for u in plan.units if u.fmt is None]
    assert len(quant) == 12 and small  # gate, up, down: a unit each in block_fp8
    jobs = [cpu_job(u) for u in quant[:3]] + [cpu_job(small[0])] + [cpu_job(u) for u in quant[3:5]]
    jobs += [cpu_job(quant[5], step=1), cpu_job(quant[6], step=1, sync=True), cpu_job(quant[7], step=1)]
    jobs += [cpu_job(u, step=1, device="meta") for u in quant[:2]]
    runs = batches(jobs)
    shape = [[(j[0], j[1].index) for j in run] for run in runs]
    i = [u.index for u in quant]
    assert shape == [
        [(0, i[0]), (0, i[1]), (0, i[2])],
        [(0, small[0].index)],
        [(0, i[3]), (0, i[4])],
        [(1, i[5])],
        [(1, i[6])],
        [(1, i[7])],
        [(1, i[0])],
        [(1, i[1])],
    ]
    assert [j for run in runs for j in run] == jobs  # order kept


def test_batches_of_quantizations_respect_the_byte_limit(monkeypatch):
    quant = [u for u in expert_plan(experts=4).units if u.fmt is not None]
    monkeypatch.setattr(worker_mod, "BATCH_QUANT_BYTES", quant[0].bytes_in + quant[1].bytes_in)
    assert [len(r) for r in batches([cpu_job(u) for u in quant])] == [2] * 6
    monkeypatch.setattr(worker_mod, "BATCH_QUANT_BYTES", 64 << 20)
    other = expert_plan("mxfp8", experts=1)
    mixed = [cpu_job(quant[0]), *(cpu_job(u) for u in other.units if u.fmt is not None)]
    assert [len(r) for r in batches(mixed)] == [1, 3]  # another format: another run


def test_all_finite():
    ok = [
        torch.randn(64).bfloat16(),
        torch.randn(3, 4),
        torch.arange(5),
        torch.empty(0, dtype=torch.bfloat16),
    ]
    assert all_finite(ok)
    assert all_finite([])
    assert all_finite([torch.arange(3)])  # integers are never checked
    big = torch.full((4,), 3.0e38).bfloat16()  # finite, however large
    assert all_finite([big, torch.tensor([torch.finfo(torch.float32).max])])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(64).bfloat16()
        t[7] = bad
        assert not all_finite([*ok, t])
        with pytest.raises(NonFiniteError, match="holds NaN or Inf"):
            check_copied(
                type("U", (), {"outputs": (type("O", (), {"name": "y", "source": "x"})(),)})(), {"y": t}
            )


def test_run_passthroughs_matches_run_unit():
    plan = small_plan(8)
    srcs = {i.name: torch.randn(i.shape).bfloat16() for i in plan.inputs}
    outs = [{o.name: torch.zeros(o.shape, dtype=o.dtype) for o in u.outputs} for u in plan.units]
    ins = [{n: srcs[n] for n in u.inputs} for u in plan.units]
    assert run_passthroughs(plan.units, ins, outs)
    for u, o in zip(plan.units, outs):
        want = {x.name: torch.zeros(x.shape, dtype=x.dtype) for x in u.outputs}
        run_unit(u, {n: srcs[n] for n in u.inputs}, want)
        for name in want:
            assert torch.equal(o[name], want[name])
    # the output buffer being the input itself: nothing to copy
    same = [{n: srcs[n] for n in u.inputs} for u in plan.units]
    assert run_passthroughs(plan.units, same, same)


def test_run_passthroughs_refuses_what_run_unit_must_explain():
    plan = small_plan(2)
    u = plan.units[0]
    name = u.inputs[0]
    src = torch.randn(64).bfloat16()
    for bad in (torch.zeros(64), torch.zeros(32, dtype=torch.bfloat16)):
        dst = torch.zeros_like(bad)
        assert not run_passthroughs([u], [{name: src}], [{name: dst}])
        assert not dst.any()  # nothing copied
        with pytest.raises(ValueError, match="allocate outputs from the plan"):
            run_unit(u, {name: src}, {name: dst})
    assert not run_passthroughs([u], [{}], [{name: torch.zeros(64, dtype=torch.bfloat16)}])
    quantizing = small_plan(1, numel=64, fmt="block_fp8").units[0]
    assert quantizing.fmt is None  # a non-expert stays a passthrough in every format
    fake = type("U", (), {"fmt": object(), "outputs": ()})()
    assert not run_passthroughs([fake], [{}], [{}])


class Worker:
    """A QuantWorker with its wake socket, for driving it directly."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.endpoint = f"inproc://test-overhead-{id(self)}"
        self.wake = self.ctx.socket(zmq.PULL)
        self.wake.bind(self.endpoint)
        self.worker = QuantWorker(self.ctx, self.endpoint)

    def results(self, n: int, timeout: float = 30.0) -> list:
        return [self.worker.results.get(timeout=timeout) for _ in range(n)]

    def close(self):
        self.worker.close()
        self.wake.close(linger=0)
        self.ctx.term()


@pytest.fixture
def qworker():
    w = Worker()
    yield w
    w.close()


def submit_all(w: Worker, plan: RefitPlan, srcs: dict, outs: dict, step: int = 0, hold: bool = True) -> None:
    """Queue every unit while the worker is busy with a blocker, so they reach it together."""
    for u in plan.units:
        w.worker.submit(
            step,
            u,
            {n: srcs[n] for n in u.inputs},
            {o.name: outs[o.name] for o in u.outputs},
        )


def blocker(w: Worker, release) -> None:
    """A job that waits for ``release`` (a queue), so later submissions queue up behind it."""
    plan = small_plan(1, numel=8)
    u = plan.units[0]
    src, dst = torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)

    class Held(dict):
        """The worker reads its inputs only once it runs the unit: the first read waits."""

        waited = False

        def __getitem__(self, name):
            if not self.waited:
                self.waited = True
                release.get(timeout=30)
            return super().__getitem__(name)

    w.worker.submit(99, u, Held({u.inputs[0]: src}), {u.outputs[0].name: dst})


def test_worker_runs_a_batch_like_one_by_one(qworker):
    plan = small_plan()
    srcs = {i.name: torch.randn(i.shape).bfloat16() for i in plan.inputs}
    outs = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
    release: queue.Queue = queue.Queue()
    blocker(qworker, release)
    submit_all(qworker, plan, srcs, outs)
    release.put(None)
    done = qworker.results(1 + len(plan.units))
    assert [d.unit for d in done[1:]] == [u.index for u in plan.units]
    assert all(d.error is None and not d.skipped and d.seconds >= 0 for d in done)
    assert all(d.step == 0 for d in done[1:])
    for name, t in srcs.items():
        assert torch.equal(outs[name], t)
    assert qworker.worker.inflight == 1 + len(plan.units)  # the serve loop counts them down


def test_worker_batch_with_a_nan_reports_that_unit(qworker):
    plan = small_plan()
    srcs = {i.name: torch.randn(i.shape).bfloat16() for i in plan.inputs}
    bad = plan.inputs[17].name
    srcs[bad][3] = float("nan")
    outs = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
    release: queue.Queue = queue.Queue()
    blocker(qworker, release)
    submit_all(qworker, plan, srcs, outs)
    release.put(None)
    done = qworker.results(1 + len(plan.units))[1:]
    errors = {d.unit: d.error for d in done if d.error is not None}
    assert list(errors) == [17]
    assert isinstance(errors[17], NonFiniteError)
    assert str(errors[17]) == f"tensor {bad!r} holds NaN or Inf; refusing to publish it"
    for i, inp in enumerate(plan.inputs):
        if i != 17:
            assert torch.equal(outs[inp.name], srcs[inp.name])
    # copied, then the copy checked (never staging, which a rank may still write): the step fails,
    # and the generation it was writing is never handed out
    assert torch.equal(outs[bad].view(torch.uint8), srcs[bad].view(torch.uint8))


def test_worker_batch_with_a_wrong_buffer_reports_run_units_error(qworker):
    plan = small_plan(8)
    srcs = {i.name: torch.randn(i.shape).bfloat16() for i in plan.inputs}
    outs = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
    wrong = plan.outputs[5].name
    outs[wrong] = torch.zeros(64)  # float32: not what the plan allocates
    release: queue.Queue = queue.Queue()
    blocker(qworker, release)
    submit_all(qworker, plan, srcs, outs)
    release.put(None)
    done = qworker.results(1 + len(plan.units))[1:]
    errors = {d.unit: d.error for d in done if d.error is not None}
    assert list(errors) == [5]
    assert "allocate outputs from the plan" in str(errors[5])


@pytest.mark.parametrize("fmt", ["block_fp8", "nvfp4", "int4_w4a16"])
def test_worker_runs_queued_cpu_quantizations_as_one_batch(qworker, fmt, monkeypatch):
    """Per-expert units queued together run as one batch (one run_quantized_units, not one run_unit
    each), with the bytes run_unit gives each; a NaN in one expert fails that expert's unit alone
    (the batch falls back to one by one, which names it)."""
    plan = expert_plan(fmt, experts=4)
    gen = torch.Generator().manual_seed(5)
    srcs = {i.name: torch.randn(i.shape, generator=gen).mul(0.02).bfloat16() for i in plan.inputs}
    want = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
    for u in plan.units:
        run_unit(u, srcs, want)
    batched: list[int] = []
    real = worker_mod.run_quantized_units
    monkeypatch.setattr(
        worker_mod, "run_quantized_units", lambda units, i, o: batched.append(len(units)) or real(units, i, o)
    )
    for bad in (None, "model.layers.0.mlp.experts.2.up_proj.weight"):
        inputs = dict(srcs)
        if bad is not None:
            inputs[bad] = srcs[bad].clone()
            inputs[bad][7, 9] = float("nan")
        outs = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
        release: queue.Queue = queue.Queue()
        blocker(qworker, release)
        submit_all(qworker, plan, inputs, outs)
        release.put(None)
        done = qworker.results(1 + len(plan.units))[1:]
        assert sorted(d.unit for d in done) == [u.index for u in plan.units]
        errors = {d.unit: d.error for d in done if d.error is not None}
        quantizing = sum(u.fmt is not None for u in plan.units)
        assert batched and batched[-1] == quantizing
        if bad is None:
            assert not errors
            for name, t in want.items():
                assert torch.equal(
                    outs[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                ), name
        else:
            (unit,) = errors
            assert bad in plan.units[unit].inputs
            assert "NaN or Inf" in str(errors[unit]) and "experts.2.up_proj" in str(errors[unit])


def test_worker_skips_a_cancelled_batch(qworker):
    plan = small_plan()
    srcs = {i.name: torch.randn(i.shape).bfloat16() for i in plan.inputs}
    outs = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
    release: queue.Queue = queue.Queue()
    blocker(qworker, release)
    submit_all(qworker, plan, srcs, outs, step=3)
    qworker.worker.cancel(3)
    release.put(None)
    done = qworker.results(1 + len(plan.units))[1:]
    assert all(d.skipped and d.error is None for d in done)
    assert not any(t.any() for t in outs.values())


def test_worker_close_runs_what_was_queued(qworker):
    plan = small_plan(5)
    srcs = {i.name: torch.randn(i.shape).bfloat16() for i in plan.inputs}
    outs = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in plan.outputs}
    submit_all(qworker, plan, srcs, outs)
    qworker.worker.close()
    done = qworker.results(len(plan.units), timeout=5)
    assert [d.unit for d in done] == [u.index for u in plan.units]
    assert not qworker.worker._thread.is_alive()


# ---- the garbage collector


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left off, as found (a trainer's manual-GC mode)
    finally:
        gc.enable()


def test_freeze_long_lived_hides_objects_from_collections():
    """What freeze_long_lived froze no collection walks (a frozen cycle outlives gc.collect)."""

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector can free it
    ref = weakref.ref(node)
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: the collection did not see it
    finally:
        gc.unfreeze()
    gc.collect()
    assert ref() is None


def test_step_hold_keeps_the_collector_off_until_the_step_ends():
    hold, busy = StepHold(), [True]
    assert gc.isenabled()
    try:
        with hold.turn(lambda: busy[0]):  # the turn that starts a step
            assert not gc.isenabled()
        assert not gc.isenabled() and hold.held  # between turns of the step: still off
        with hold.turn(lambda: busy[0]):
            assert not gc.isenabled()
        busy[0] = False
        with pytest.raises(RuntimeError), hold.turn(lambda: busy[0]):  # the turn that ends it
            raise RuntimeError("boom")
        assert gc.isenabled() and not hold.held
        with hold.turn(lambda: False):  # an idle turn: off during it only
            assert not gc.isenabled()
        assert gc.isenabled()
        with hold.turn(lambda: True):
            pass
        hold.release()  # the daemon's close in the middle of a step
        assert gc.isenabled()
        gc.disable()  # a manual-GC mode: left alone, never turned on
        with hold.turn(lambda: False):
            pass
        hold.release()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_begin_errors_unchanged_under_the_paused_collector():
    state = StepState(0, 1, float("inf"))
    with pytest.raises(Exception, match="shape is a list of 1, expected a list of ints"):
        state.begin(0, [["w", "bfloat16", [4], [0], ["4"]]])
    assert gc.isenabled()
    state = StepState(0, 1, float("inf"))
    with pytest.raises(RefitError, match="negative offset"):
        state.begin(0, [["w", "bfloat16", [4], [-1], [4]]])
    assert gc.isenabled()
    state = StepState(0, 1, float("inf"))
    state.begin(0, [[f"w{i}", "bfloat16", [4], [0], [4]] for i in range(1000)])
    assert len(state.pieces) == 1000 and gc.isenabled()


# ---- the client's local copies


class FakeStaging:
    def __init__(self, tensors):
        self._t = tensors

    def tensors(self):
        return self._t


def test_copy_in_batches_small_copies_before_each_piece_done(monkeypatch):
    """The staging writer copies small pieces together and says PIECE_DONE only for pieces that
    landed: with DONE_BATCH_PIECES = 4, ten pieces go as batches of 4, 4, 2."""
    monkeypatch.setattr(pieces_mod, "DONE_BATCH_PIECES", 4)
    sent: list[list[int]] = []
    staged = {
        "a": torch.zeros(8, dtype=torch.bfloat16),
        "b": torch.zeros(4, 6, dtype=torch.bfloat16),
        "big": torch.zeros(local_mod.FOREACH_COPY_BYTES, dtype=torch.bfloat16),
    }
    for i in range(6):
        staged[f"s{i}"] = torch.zeros(3, dtype=torch.bfloat16)
    a = torch.randn(8).bfloat16()
    b = torch.randn(4, 6).bfloat16()
    big = torch.randn(local_mod.FOREACH_COPY_BYTES).bfloat16()
    smalls = {f"s{i}": torch.randn(3).bfloat16() for i in range(6)}
    named = {
        "a": a,
        "b": [
            pieces_mod.Shard(b[:2], global_shape=(4, 6), offsets=(0, 0)),
            pieces_mod.Shard(b[2:], global_shape=(4, 6), offsets=(2, 0)),
        ],
        "big": big,
        **smalls,
    }
    pieces = pieces_mod.pieces(named)
    assert [p.whole for p in pieces] == [True, False, False, True] + [True] * 6

    def send(kind, fields, frames=()):
        assert kind is Kind.PIECE_DONE
        for pid in fields["pieces"]:  # every piece named here has landed already
            p = pieces[pid]
            full = staged[p.name]
            region = full[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.tensor.shape))]
            assert torch.equal(region, p.tensor), p.name
        sent.append(list(fields["pieces"]))

    link = pieces_mod.Link(
        send=send, keepalive=lambda *a: None, poll=lambda step, timeout: None, heartbeat=lambda: 1.0
    )
    writer = local_mod.StagingWriter(link)
    writer.arena = FakeStaging(staged)
    monkeypatch.setattr(writer, "open", lambda handle: None)
    writer.write_step(0, pieces, list(range(len(pieces))), {}, float("inf"))
    assert sent == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert torch.equal(staged["a"], a) and torch.equal(staged["b"], b) and torch.equal(staged["big"], big)
    for name, t in smalls.items():
        assert torch.equal(staged[name], t)
    assert gc.isenabled()


def test_begin_rows_unchanged():
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    (whole,) = pieces_mod.pieces({"w": t})
    assert whole.wire() == ["w", "bfloat16", [3, 5], [0, 0], [3, 5]]
    (shard,) = pieces_mod.pieces({"w": pieces_mod.Shard(t[1:], global_shape=(3, 5), offsets=(1, 0))})
    assert shard.wire() == ["w", "bfloat16", [3, 5], [1, 0], [2, 5]]


# ---- a BEGIN larger than the daemon accepts


def test_a_begin_over_max_header_bytes_says_which_setting_to_raise(tmp_path):
    """Many tensors make a large BEGIN: over the daemon's max_header_bytes the step fails with a
    message naming the setting and the per-piece cost; the daemon keeps serving."""
    from support.daemons import RunningDaemon

    from sidecar.errors import ErrorKind

    d = RunningDaemon(
        tmp_path,
        model_type="qwen3_5_moe",
        staging_bytes=1 << 20,
        publish_bytes=1 << 20,
        format="bf16",
        max_header_bytes=8 << 10,
    )
    try:
        many = {f"model.language_model.layers.0.mlp.gate.w{i}.weight": torch.zeros(4) for i in range(400)}
        with RefitClient(d.endpoint, 0, 1, timeout=30) as c, pytest.raises(RefitError) as err:
            c.push_step(0, many)
        assert err.value.kind is ErrorKind.PROTOCOL
        text = str(err.value)
        assert "exceeds the limit of 8192" in text and "raise max_header_bytes (--max-header-bytes" in text
        assert d.status()["step_in_progress"] is None
    finally:
        d.close()
