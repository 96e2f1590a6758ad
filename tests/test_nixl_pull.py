"""Remote trainer shards pulled over NIXL (sidecar.daemon.pull), with ZeroMQ frames as the fallback.

An in-process daemon (the real serve loop in a thread) with two ranks: rank 0 local (it writes into
the staging arena), rank 1 remote (``local=False``). Tensor-parallel pieces split along dim 1 have no
contiguous staging destination and always travel as frames, so the NIXL step mixes both movers.
Every published tensor is compared byte for byte with ``sidecar.plan.run.convert``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support import procs
from support.daemons import RunningDaemon

from adapters.base import RefitReader
from sidecar.client.client import RefitClient
from sidecar.daemon.pull import PullSide
from sidecar.errors import ErrorKind, RefitError
from transport import nixl
from transport.shm import shm_region

pytestmark = pytest.mark.timeout(180)

WORLD = 2
FMT = "block_fp8"
NIXL_OK, NIXL_WHY = nixl.available()
needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is unavailable: {NIXL_WHY}")


@pytest.fixture
def daemon(daemons) -> RunningDaemon:
    return daemons(hf_config=procs.hf_config(), world_size=WORLD, format=FMT)


def push_steps(d: RunningDaemon, seeds: list[int], remote_mover: str) -> list:
    """Push one step per seed from both ranks; check each published generation; rank 1's results."""
    endpoint = d.endpoint
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
    pull = daemon.status()["pull"]
    assert pull["nixl"] is True and pull["ranks"]["1"]["mover"] == "nixl+zmq"


def test_forced_zmq_remote_rank_streams_frames_byte_exact(daemon):
    results = push_steps(daemon, [21], "zmq")
    assert results[0].mover == "zmq"
    assert results[0].mover_reason in ("mover=zmq", "the daemon does not offer NIXL pulls")
    assert daemon.status()["pull"]["ranks"]["1"]["mover"] == "zmq"


@needs_nixl
def test_a_failed_nixl_setup_falls_back_to_frames(daemon, monkeypatch):
    """The daemon cannot post the READ: READY pulls nothing, the client streams every piece."""

    def broken(*args, **kwargs):
        raise nixl.NixlError("injected")

    monkeypatch.setattr("sidecar.daemon.pull.PullSide.start", broken)
    results = push_steps(daemon, [31], "auto")
    assert results[0].mover == "zmq" and "injected" in results[0].mover_reason


class RecordingAgent:
    """Stands in for the NIXL agent where NIXL is not installed: the daemon's own bookkeeping of
    what it registered is under test here, not NIXL. Registrations are kept with the segment each
    covered when it was made."""

    def __init__(self, name: str):
        self.calls: list[str] = []
        self.live: dict[int, tuple[int, int]] = {}

    def register(self, regions) -> object:
        reg = object()
        self.calls.append("register")
        self.live[id(reg)] = tuple(regions[0])
        return reg

    def deregister(self, reg) -> None:
        self.calls.append("deregister")
        self.live.pop(id(reg))

    def close(self) -> None:
        self.live.clear()


def test_a_retired_staging_arena_is_deregistered_and_its_successor_registered(daemons, monkeypatch):
    """Staging is retired after a failed step (its memory unmapped) and the new arena is usually
    mapped at the same address with the same size: the daemon must not keep the old arena's
    NIXL registration for it (the pages it pinned are gone; a READ would land there, not in the
    new staging). The registration goes before the memory does, and the next pull registers anew."""
    monkeypatch.setattr("sidecar.daemon.pull.nixl.NixlEndpoint", RecordingAgent)
    d = daemons(hf_config=procs.hf_config(), world_size=1, format=FMT)
    side = PullSide("refitd-test")
    side.endpoint(d.daemon.arenas.staging)  # as the loop does on a step's first pull (it is idle)
    d.daemon.pulls.side = side
    agent = side._ep
    with RefitClient(d.endpoint, 0, 1, local=True, timeout=20) as client:
        client.push_step(0, procs.state_dict(41))
        bad = procs.state_dict(42)
        name = next(iter(bad))
        bad[name] = bad[name].clone()
        bad[name].view(-1)[0] = float("nan")
        with pytest.raises(RefitError) as err:
            client.push_step(1, bad)
        assert err.value.kind is ErrorKind.NON_FINITE, err.value
        client.push_step(2, procs.state_dict(43))  # its BEGIN retires staging first
    d.barrier()
    assert d.status()["last_step"] == 2
    assert agent.calls == ["register", "deregister"] and agent.live == {}, agent.calls
    side.endpoint(d.daemon.arenas.staging)  # the next pull
    assert agent.calls == ["register", "deregister", "register"], agent.calls
    assert list(agent.live.values()) == [shm_region(d.daemon.arenas.staging)]


def test_a_step_that_fails_with_a_pull_in_flight_retires_staging(daemons, monkeypatch):
    """A remote rank's step fails while the daemon's NIXL READ of its pieces is in flight: the
    transfer is released, but UCX may not be able to cancel it (NIXL keeps it on a leak list) and
    its bytes may still land in staging. No local rank was handed staging, yet staging must be
    retired before the next step as after any step whose writers the daemon stopped trusting, or
    those bytes become the next step's inputs."""
    d = daemons(hf_config=procs.hf_config(), world_size=1, format=FMT)
    # a READ posted and never finished (NIXL is not installed here): the loop polls it for nothing
    monkeypatch.setattr("sidecar.daemon.pull.Pulls.busy", property(lambda self: True))
    monkeypatch.setattr("sidecar.daemon.pull.Pulls.progress", lambda self: None)
    before = d.status()["staging"]["segment"]
    with RefitClient(d.endpoint, 0, 1, local=False, timeout=20, mover="zmq") as client:
        client.push_step(0, procs.state_dict(51))
        assert d.status()["staging"]["segment"] == before  # a step that went well retires nothing
        bad = procs.state_dict(52)
        name = next(iter(bad))
        bad[name] = bad[name].clone()
        bad[name].view(-1)[0] = float("nan")
        with pytest.raises(RefitError) as err:
            client.push_step(1, bad)
        assert err.value.kind is ErrorKind.NON_FINITE, err.value
        client.push_step(2, procs.state_dict(53))
    status = d.status()
    assert status["last_step"] == 2 and status["staging"]["segment"] != before, status["staging"]


@needs_nixl
def test_a_step_of_the_same_tensors_reuses_the_pull_setup(daemons, monkeypatch):
    """A remote rank pushing the same tensors every step (new values written in place, as an
    optimizer does) offers the same rows and regions: the daemon's READ descriptors are worked out
    once and reused, and every step still lands byte-exact. Fresh tensors (other addresses) are
    set up afresh, and so are the first ones again after them."""
    d = daemons(hf_config=procs.hf_config(), world_size=1, format=FMT)
    made = []
    real = PullSide.start

    def start(self, *args, **kwargs):
        pull = real(self, *args, **kwargs)
        made.append(self._last[3:5])  # the READ's descriptors: staging's, the rank's
        return pull

    monkeypatch.setattr(PullSide, "start", start)
    sd = first = procs.state_dict(41)
    with (
        RefitClient(d.endpoint, 0, 1, local=False, timeout=20) as client,
        RefitReader(d.endpoint, name="test-reader") as reader,
    ):
        for step, seed in enumerate([41, 42, 43, 44, 45]):
            new = procs.state_dict(seed)
            if seed == 44:
                sd = new  # other tensor objects, other addresses
            else:
                if seed == 45:  # back to the first ones: regions the daemon saw, set for the peer again
                    sd = first
                for name, t in sd.items():
                    t.copy_(new[name])
            result = client.push_step(step, sd)
            assert result.mover == "nixl", (result.mover, result.mover_reason)
            gen = reader.wait(min_step=step, timeout=30)
            for name, w in procs.expected_outputs(seed, FMT).items():
                got = gen.tensors[name]
                assert torch.equal(got.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name
            reader.release(gen)
    assert len(made) == 5
    assert made[2][0] is made[1][0], "the same pieces and regions: the set-up is reused"
    assert made[3][1] != made[2][1], "other addresses: set up afresh"


@needs_nixl
def test_a_retired_staging_arena_leaves_no_pull_setup_behind(daemon, monkeypatch):
    """The READ set-up a rank's steps reuse holds views of staging: retiring the arena (a failed
    step whose local rank was handed it) drops that set-up too (the arena's memory goes once no
    view of it is left), and the next step is set up on the new arena."""
    from sidecar.daemon.pull import Pulls

    kept = []
    real = Pulls.forget

    def forget(self):
        real(self)
        kept.append((len(self._targets), None if self.side is None else self.side._last))

    monkeypatch.setattr(Pulls, "forget", forget)

    def step(clients, pool, step, sd):
        futures = [
            pool.submit(c.push_step, step, procs.rank_pieces(sd, rank, WORLD))
            for rank, c in enumerate(clients)
        ]
        return [f.exception(timeout=120) or f.result() for f in futures]

    good = procs.state_dict(61)
    bad = {name: t.clone() for name, t in good.items()}
    bad[next(iter(bad))].view(-1)[0] = float("nan")
    with (
        RefitClient(daemon.endpoint, 0, WORLD, local=True, timeout=20) as c0,
        RefitClient(daemon.endpoint, 1, WORLD, local=False, timeout=20) as c1,
        ThreadPoolExecutor(2) as pool,
    ):
        assert step((c0, c1), pool, 0, good)[1].mover == "nixl+zmq"
        assert daemon.daemon.pulls._targets  # rank 1's set-up, on this staging arena
        assert all(isinstance(r, RefitError) for r in step((c0, c1), pool, 1, bad))
        assert step((c0, c1), pool, 2, good)[1].mover == "nixl+zmq"  # its BEGIN retires staging first
    daemon.barrier()
    assert kept == [(0, None)]
    assert daemon.daemon.pulls._targets[1][0] is daemon.daemon.arenas.staging.tensors()  # the new arena's
