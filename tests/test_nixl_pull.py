"""Remote trainer shards pulled over NIXL (sidecar.daemon.pull), with ZeroMQ frames as the fallback.

An in-process daemon (the real serve loop in a thread) with two ranks: rank 0 local (it writes into
the staging arena), rank 1 remote (``local=False``). Tensor-parallel pieces split along dim 1 have no
contiguous staging destination and always travel as frames, so the NIXL step mixes both movers.
Every published tensor is compared byte for byte with ``sidecar.plan.run.convert``.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import procs
import pytest
import torch

from adapters.base import RefitReader
from sidecar.client.client import RefitClient
from sidecar.config.settings import DaemonConfig, prepare_runtime_dir
from sidecar.daemon.loop import Daemon
from transport import nixl

pytestmark = pytest.mark.timeout(180)

WORLD = 2
FMT = "block_fp8"
NIXL_OK, NIXL_WHY = nixl.available()
needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is unavailable: {NIXL_WHY}")


@pytest.fixture
def daemon(tmp_path):
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(procs.hf_config()))
    config = DaemonConfig(
        runtime_dir=tmp_path / "run",
        hf_config=cfg_path,
        world_size=WORLD,
        format=FMT,
        reader_timeout_s=3.0,
        rank_timeout_s=10.0,
        heartbeat_interval_s=0.2,
    )
    prepare_runtime_dir(config)
    d = Daemon(config)
    d.start()
    thread = threading.Thread(target=d.serve_forever, name="refitd-test", daemon=True)
    thread.start()
    yield d
    d.request_stop()
    thread.join(timeout=30)
    d.close()


def status(d: Daemon) -> dict:
    """Asked over the control socket, as an operator would (the serve loop owns the state)."""
    with RefitReader(d.config.listen, name="test-status") as reader:
        return reader.status(timeout=30)


def push_steps(d: Daemon, seeds: list[int], remote_mover: str) -> list:
    """Push one step per seed from both ranks; check each published generation; rank 1's results."""
    endpoint = d.config.listen
    results = []
    with (
        RefitClient(endpoint, 0, WORLD, local=True, timeout=20) as c0,
        RefitClient(endpoint, 1, WORLD, local=False, timeout=20, mover=remote_mover) as c1,
        RefitReader(endpoint, name="test-reader") as reader,
        ThreadPoolExecutor(2) as pool,
    ):
        for step, seed in enumerate(seeds):
            sd = procs.state_dict(seed)
            futures = [
                pool.submit(c.push_step, step, procs.rank_pieces(sd, rank, WORLD))
                for rank, c in enumerate((c0, c1))
            ]
            r0, r1 = (f.result(timeout=120) for f in futures)
            assert r0.mover == "staging"
            results.append(r1)
            gen = reader.wait(min_step=step, timeout=30)
            want = procs.expected_outputs(seed, FMT)
            assert set(gen.tensors) == set(want)
            for name, w in want.items():
                got = gen.tensors[name]
                assert got.dtype == w.dtype and tuple(got.shape) == tuple(w.shape), name
                assert torch.equal(got.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name
            reader.release(gen)
    return results


@needs_nixl
def test_remote_rank_is_pulled_over_nixl_byte_exact(daemon):
    results = push_steps(daemon, [11, 12], "auto")
    for r in results:
        # dim-1 tensor-parallel slices are not contiguous in staging: those go as frames
        assert r.mover == "nixl+zmq", (r.mover, r.mover_reason)
        assert "contiguous" in r.mover_reason
    pull = status(daemon)["pull"]
    assert pull["nixl"] is True and pull["ranks"]["1"]["mover"] == "nixl+zmq"


def test_forced_zmq_remote_rank_streams_frames_byte_exact(daemon):
    results = push_steps(daemon, [21], "zmq")
    assert results[0].mover == "zmq"
    assert results[0].mover_reason in ("mover=zmq", "the daemon does not offer NIXL pulls")
    assert status(daemon)["pull"]["ranks"]["1"]["mover"] == "zmq"


@needs_nixl
def test_a_failed_nixl_setup_falls_back_to_frames(daemon, monkeypatch):
    """The daemon cannot post the READ: READY pulls nothing, the client streams every piece."""

    def broken(*args, **kwargs):
        raise nixl.NixlError("injected")

    monkeypatch.setattr("sidecar.daemon.pull.PullSide.start", broken)
    results = push_steps(daemon, [31], "auto")
    assert results[0].mover == "zmq" and "injected" in results[0].mover_reason
