"""adapters.vllm.last_good: when a vLLM worker's loads read the engine's NVFP4 activation scales and when
they carry the last good ones (pure Python; the real-engine checks are in tests/test_engine_vllm_fourbit.py:
a whole load and a streamed step failing halfway, target and MTP drafter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adapters.vllm.last_good import last_good_scales


def test_a_load_reads_the_engine_unless_one_failed_since_the_last_good_one():
    worker = SimpleNamespace()
    engine = {"s": torch.tensor(1.0)}  # what the engine's parameters say now
    reads = []

    def read():
        reads.append(float(engine["s"]))
        return dict(engine)

    record = last_good_scales(worker)
    assert last_good_scales(worker) is record  # one per worker: both load paths use it
    assert float(record.for_load(read)["s"]) == 1.0 and reads == [1.0]  # the first load reads
    assert float(record.for_load(read)["s"]) == 1.0 and reads == [1.0]  # (the same load goes on)
    record.succeeded()
    engine["s"] = torch.tensor(2.0)  # e.g. a reload outside refitd: read afresh after a good load
    assert float(record.for_load(read)["s"]) == 2.0 and reads == [1.0, 2.0]
    engine["s"] = torch.tensor(float("inf"))  # ... that load fails halfway: the engine holds garbage
    for _ in range(2):  # every load until one succeeds (the rollback, the next whole load)
        assert float(record.for_load(read)["s"]) == 2.0 and reads == [1.0, 2.0]
    record.succeeded()
    engine["s"] = torch.tensor(2.0)
    assert float(record.for_load(read)["s"]) == 2.0 and reads == [1.0, 2.0, 2.0]
    assert last_good_scales(SimpleNamespace()) is not record


def test_a_read_that_raises_leaves_the_record_as_it_was():
    record = last_good_scales(SimpleNamespace())

    def broken():
        raise ValueError("no float32 input_scale reproduces the held NVFP4 activation scale")

    with pytest.raises(ValueError, match="no float32"):
        record.for_load(broken)
    assert float(record.for_load(lambda: {"s": torch.tensor(3.0)})["s"]) == 3.0
