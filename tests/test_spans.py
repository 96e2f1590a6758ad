"""Small passthroughs copied staging -> generation as byte spans (sidecar.daemon.spans): which units
merge, byte-exact copies of odd dtypes and sizes, NaN/Inf named per tensor (never the padding), and
the worker's one result for a span job."""

from __future__ import annotations

import queue

import pytest
import torch
import zmq

from sidecar.daemon import spans as spans_mod
from sidecar.daemon.memory.generations import layouts
from sidecar.daemon.spans import SpanTable, check_span, run_span
from sidecar.daemon.worker import QuantWorker, SpanJob, batches
from sidecar.numerics.reference import NonFiniteError
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from transport.layout import ALIGN

#: odd dtypes and sizes: padding of every length between the slots, zero-byte and 0-d tensors
SPECS = [
    TensorSpec("model.norm.weight", torch.float32, (5,)),
    TensorSpec("a.bias", torch.bfloat16, (3, 7)),
    TensorSpec("a.scale", torch.float16, ()),
    TensorSpec("a.empty", torch.bfloat16, (0, 4)),
    TensorSpec("a.ids", torch.int64, (3,)),
    TensorSpec("a.mask", torch.bool, (13,)),
    TensorSpec("a.bytes", torch.uint8, (ALIGN + 1,)),
    TensorSpec("a.more", torch.bfloat16, (64,)),
    *(
        TensorSpec(f"model.layers.0.mlp.experts.0.{proj}.weight", torch.bfloat16, (64, 64))
        for proj in ("gate_proj", "up_proj", "down_proj")
    ),
    TensorSpec("b.after", torch.float32, (31,)),
    TensorSpec("b.last", torch.bfloat16, (2, 2)),
]


def plan_of(specs=SPECS, fmt="block_fp8") -> RefitPlan:
    return RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt=fmt))


def arenas_for(plan: RefitPlan, seed: int = 0):
    """Flat uint8 'arenas' carved like the daemon's, staging filled with random values per tensor
    and random bytes in the padding."""
    staging, outputs = layouts(plan)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (staging.size,), dtype=torch.uint8, generator=gen)
    for slot in staging:
        view = src[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        if slot.dtype.is_floating_point:
            view.copy_(torch.randn(slot.shape, generator=gen))
        elif slot.dtype == torch.bool:
            view.copy_(torch.randint(0, 2, slot.shape, generator=gen).bool())
        else:
            view.copy_(torch.randint(-100, 100, slot.shape, generator=gen))
    dst = torch.zeros(outputs.size, dtype=torch.uint8)
    return staging, outputs, src, dst


def run_all(spans, src, dst):
    for s in spans:
        run_span(s, src[s.src : s.src + s.nbytes], dst[s.dst : s.dst + s.nbytes])


def test_spans_merge_consecutive_passthroughs_and_stop_at_a_quantized_unit():
    plan = plan_of()
    staging, outputs, _, _ = arenas_for(plan)
    table = SpanTable(plan, staging, outputs)
    spans, rest = table.spans(reversed(plan.units))  # any order in, unit order out
    assert [u.index for u in rest] == [10, 9, 8]  # the routed expert is quantized
    assert [tuple(s.units) for s in spans] == [(0, 1, 2, 3, 4, 5, 6, 7), (11, 12)]
    for s in spans:  # a span's members are where the layouts put them, on both sides
        for m in s.members:
            assert staging.slots[m.name].offset == m.src and outputs.slots[m.name].offset == m.dst
            assert m.src - s.src == m.dst - s.dst < s.nbytes or m.nbytes == 0
        assert s.units == [m.unit for m in s.members]
    assert table.fits(plan, staging, outputs)
    assert not table.fits(plan, *layouts(plan))  # other layout objects: a new table


def test_spans_copy_every_tensor_byte_exact():
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    spans, _ = SpanTable(plan, staging, outputs).spans(plan.units)
    run_all(spans, src, dst)
    for unit in plan.units:
        if unit.fmt is not None:
            continue
        s, o = staging.slots[unit.inputs[0]], outputs.slots[unit.outputs[0].name]
        assert torch.equal(dst[o.offset : o.offset + o.nbytes], src[s.offset : s.offset + s.nbytes])
    for unit in plan.units[8:11]:  # not passthroughs: never touched
        for o in unit.outputs:
            q = outputs.slots[o.name]
            assert not dst[q.offset : q.offset + q.nbytes].any()


def test_spans_split_where_units_are_not_adjacent_or_too_big(monkeypatch):
    plan = plan_of()
    staging, outputs, _, _ = arenas_for(plan)
    table = SpanTable(plan, staging, outputs)
    some = [plan.units[i] for i in (0, 1, 4, 5, 12)]  # 2, 3 and 11 did not complete yet
    spans, rest = table.spans(some)
    assert [tuple(s.units) for s in spans] == [(0, 1), (4, 5), (12,)] and not rest
    monkeypatch.setattr(spans_mod, "SPAN_MAX_BYTES", 2 * ALIGN)
    spans, _ = table.spans(plan.units)
    assert all(s.nbytes <= 2 * ALIGN or len(s.members) == 1 for s in spans)
    assert [u for s in spans for u in s.units] == [0, 1, 2, 3, 4, 5, 6, 7, 11, 12]
    monkeypatch.setattr(spans_mod, "SPAN_UNIT_BYTES", 16)
    small = SpanTable(plan, staging, outputs)
    spans, rest = small.spans(plan.units)
    assert {u.index for u in rest} == {0, 1, 4, 6, 7, 8, 9, 10, 11}  # over 16 bytes (or quantized)
    assert [tuple(s.units) for s in spans] == [(2, 3), (5,), (12,)]


@pytest.mark.parametrize("bad", ["model.norm.weight", "a.bias", "a.scale", "a.more", "b.last"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_tensor_is_named(bad, value):
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    slot = staging.slots[bad]
    src[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(-1)[-1] = value
    spans, _ = SpanTable(plan, staging, outputs).spans(plan.units)
    with pytest.raises(NonFiniteError) as err:
        run_all(spans, src, dst)
    assert str(err.value) == f"tensor {bad!r} holds NaN or Inf; refusing to publish it"


def test_nan_in_the_padding_or_in_an_int_tensor_is_not_an_error():
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    bias = staging.slots["a.bias"]
    pad = bias.offset + bias.nbytes  # 42 bytes of bf16, then padding up to the next slot
    src[pad : pad + 2].view(torch.bfloat16)[0] = float("nan")
    ids = staging.slots["a.ids"]
    src[ids.offset : ids.offset + 8].view(torch.float64)[0] = float("nan")  # the bits of an int64
    spans, _ = SpanTable(plan, staging, outputs).spans(plan.units)
    check_span(spans[0], src[spans[0].src : spans[0].src + spans[0].nbytes])  # no error
    run_all(spans, src, dst)


def test_run_span_refuses_buffers_that_are_not_the_span():
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    span = SpanTable(plan, staging, outputs).spans(plan.units)[0][0]
    with pytest.raises(ValueError, match="give uint8 views of exactly the span"):
        run_span(span, src[: span.nbytes - 1], dst[: span.nbytes])
    with pytest.raises(ValueError, match="give uint8 views of exactly the span"):
        run_span(span, src[: span.nbytes], dst[: span.nbytes // 2].view(torch.int16))


# ---- the worker


@pytest.fixture
def worker():
    ctx = zmq.Context()
    endpoint = f"inproc://test-spans-{id(ctx)}"
    wake = ctx.socket(zmq.PULL)
    wake.bind(endpoint)
    w = QuantWorker(ctx, endpoint)
    yield w
    w.close()
    wake.close(linger=0)
    ctx.term()


def span_views(plan, staging, outputs, src, dst):
    spans, _ = SpanTable(plan, staging, outputs).spans(plan.units)
    return [(s, src[s.src : s.src + s.nbytes], dst[s.dst : s.dst + s.nbytes]) for s in spans]


def test_worker_reports_a_span_job_once_for_all_its_units(worker):
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    views = span_views(plan, staging, outputs, src, dst)
    worker.submit_spans(4, views)
    done = worker.results.get(timeout=30)
    assert (done.step, done.unit, done.units) == (4, 0, (0, 1, 2, 3, 4, 5, 6, 7, 11, 12))
    assert done.error is None and not done.skipped
    assert worker.inflight == 1  # one job: the serve loop counts it down once
    for _, a, b in views:
        assert torch.equal(a, b)
    with pytest.raises(queue.Empty):
        worker.results.get(timeout=0.05)
    worker.submit_spans(5, [])  # nothing to run: nothing queued, nothing reported
    assert worker.inflight == 1


def test_worker_span_job_with_a_nan_fails_naming_the_tensor(worker):
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    slot = staging.slots["b.after"]
    src[slot.offset : slot.offset + 4].view(torch.float32)[0] = float("nan")
    worker.submit_spans(1, span_views(plan, staging, outputs, src, dst))
    done = worker.results.get(timeout=30)
    assert isinstance(done.error, NonFiniteError)
    assert "'b.after'" in str(done.error)


def test_worker_skips_a_cancelled_span_job(worker):
    plan = plan_of()
    staging, outputs, src, dst = arenas_for(plan)
    worker.cancel(2)
    worker.submit_spans(2, span_views(plan, staging, outputs, src, dst))
    done = worker.results.get(timeout=30)
    assert done.skipped and done.error is None and done.units
    assert not dst.any()


def test_batches_keep_a_span_job_alone():
    plan = plan_of(fmt="bf16")
    job = SpanJob(0, [], (0, 1))
    units = [(0, u, {}, {}, False) for u in plan.units[:2]]
    runs = batches([units[0], job, units[1]])
    assert [len(r) for r in runs] == [1, 1, 1] and runs[1] == [job]


# ---- through the daemon


def test_a_local_step_of_many_small_tensors_publishes_byte_exact_and_names_a_nan(daemons):
    """A local rank pushes 1,500 small tensors of mixed dtypes (three PIECE_DONE batches: spans of
    several hundred units each) and a large one: the generation holds every byte. A NaN in one of
    the small ones fails the step naming it (the span runs on the serve loop; the large tensor's
    unit, due after it, is then never submitted); the next step publishes again."""
    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from sidecar.errors import ErrorKind, RefitError

    d = daemons(model_type="qwen3_moe", format="bf16", staging_bytes=4 << 20, publish_bytes=4 << 20)
    dtypes = (torch.bfloat16, torch.float32, torch.float16, torch.int32)
    gen = torch.Generator().manual_seed(3)

    def weights(step: int) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(1500):
            dtype, shape = dtypes[i % 4], (1 + i % 7, 3 + i % 5)
            t = torch.randn(shape, generator=gen) * (step + 1)
            out[f"small.{i}.weight"] = t.to(dtype) if dtype.is_floating_point else (t * 100).to(dtype)
        # over SPAN_UNIT_BYTES: a unit of its own, submitted after the spans of its PIECE_DONE batch
        out["big.weight"] = torch.randn(spans_mod.SPAN_UNIT_BYTES, generator=gen).bfloat16()
        return out

    with RefitClient(d.endpoint, 0, 1, timeout=60) as client, RefitReader(d.endpoint, name="t") as reader:
        sent = weights(0)
        client.push_step(0, sent)
        got = reader.wait(min_step=0, timeout=30)
        assert set(got.tensors) == set(sent)
        for name, t in sent.items():
            assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), name
        reader.release(got)

        bad = weights(1)
        bad["small.1234.weight"][0, 1] = float("nan")
        with pytest.raises(RefitError) as err:
            client.push_step(1, bad)
        assert err.value.kind is ErrorKind.NON_FINITE
        assert "'small.1234.weight' holds NaN or Inf" in str(err.value)

        sent = weights(2)
        client.push_step(2, sent)
        got = reader.wait(min_step=2, timeout=30)
        assert all(torch.equal(got.tensors[n], t) for n, t in sent.items())
        reader.release(got)


@pytest.mark.parametrize("bad", [None, 0, 3, 5])
def test_a_span_of_one_dtype_is_checked_in_one_run_and_still_names_the_tensor(bad):
    specs = [TensorSpec(f"u.{i}", torch.bfloat16, (0,) if i == 2 else (3 + i,)) for i in range(6)]
    plan = plan_of(specs, fmt="bf16")
    staging, outputs, src, dst = arenas_for(plan)
    (span,), rest = SpanTable(plan, staging, outputs).spans(plan.units)
    assert (
        not rest
        and span.dtype == torch.bfloat16
        and spans_mod._float_runs(span) == [(torch.bfloat16, 0, span.nbytes)]
    )
    if bad is not None:
        slot = staging.slots[f"u.{bad}"]
        src[slot.offset : slot.offset + 2].view(torch.bfloat16)[0] = float("nan")
        with pytest.raises(NonFiniteError, match=f"'u.{bad}' holds NaN or Inf"):
            run_all([span], src, dst)
        return
    last = staging.slots["u.5"]
    src[last.offset - 2 : last.offset].view(torch.bfloat16)[0] = float("inf")  # padding before u.5
    run_all([span], src, dst)
    for slot in staging:
        o = outputs.slots[slot.name]
        assert torch.equal(dst[o.offset : o.offset + o.nbytes], src[slot.offset : slot.offset + slot.nbytes])
