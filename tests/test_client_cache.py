"""The client's per-step caches: the pieces and packed BEGIN rows of a step that hands over the very
same tensors (client.pieces.StepPieces), and the staging writer's planned copies of the same pieces
into the same arena. Reused only while nothing that shapes them changed; the bytes copied are always
the tensors' current values."""

from __future__ import annotations

import msgpack
import pytest
import torch

from sidecar.client import local as local_mod
from sidecar.client import pieces as pieces_mod
from sidecar.client.pieces import Shard, StepPieces, packed_rows
from transport.wire import Kind


def weights() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(3, 5).bfloat16(),
        "b": torch.randn(7),
        "c": torch.arange(6, dtype=torch.int32).view(2, 3),
        "d": torch.randn(()).half(),
        "e": torch.zeros(0, 4, dtype=torch.bfloat16),
    }


def test_packed_rows_are_msgpack_of_the_wire_rows():
    t = torch.randn(4, 6).bfloat16()
    named = {
        **weights(),
        "s": [
            Shard(t[:1], global_shape=(4, 6), offsets=(0, 0)),
            Shard(t[1:], global_shape=(4, 6), offsets=(1, 0)),
        ],
        "t": torch.randn(8, 8)[:, ::2],  # not contiguous
    }
    made = pieces_mod.pieces(named)
    assert packed_rows(made) == msgpack.packb([p.wire() for p in made], use_bin_type=True)


def test_the_same_tensors_reuse_the_pieces_and_rows():
    cache, w = StepPieces(), weights()
    pieces, rows = cache.of(w)
    assert rows == packed_rows(pieces) and [p.name for p in pieces] == list(w)
    again, rows_again = cache.of(dict(w))  # another dict, the same tensor objects
    assert again is pieces and rows_again is rows
    w["a"].mul_(2)  # values change every step: nothing to rebuild
    assert cache.of(w)[0] is pieces
    assert cache.of(list(w.items()))[0] is pieces  # pairs instead of a mapping


@pytest.mark.parametrize("change", ["new object", "renamed", "reordered", "reshaped", "retyped", "dropped"])
def test_anything_else_rebuilds_them(change):
    cache, w = StepPieces(), weights()
    pieces, rows = cache.of(w)
    if change == "new object":
        w["b"] = w["b"].clone()
    elif change == "renamed":
        w = {("z" if k == "b" else k): v for k, v in w.items()}
    elif change == "reordered":
        w = dict(reversed(list(w.items())))
    elif change == "reshaped":
        w["b"].data = torch.randn(9)  # the same Parameter-like object, another shape
    elif change == "retyped":
        w["b"].data = w["b"].data.double()
    else:
        del w["e"]
    again, rows_again = cache.of(w)
    assert again is not pieces
    assert [(p.name, p.tensor) for p in again] == list(w.items())
    assert rows_again == packed_rows(again)
    if change in ("new object", "reshaped", "retyped"):
        assert next(p for p in again if p.name == "b").tensor is w["b"]
    assert (rows_again is rows) is (change == "new object")  # the same rows: the same bytes


def test_steps_with_shards_are_never_cached_and_bad_input_still_raises():
    cache, t = StepPieces(), torch.randn(4, 6)
    named = {
        "s": [
            Shard(t[:2], global_shape=(4, 6), offsets=(0, 0)),
            Shard(t[2:], global_shape=(4, 6), offsets=(2, 0)),
        ]
    }
    first, _ = cache.of(named)
    assert cache.of(named)[0] is not first
    with pytest.raises(TypeError, match="expected a tensor or a Shard"):
        cache.of({"x": 3})
    with pytest.raises(ValueError, match="does not fit the global shape"):
        cache.of({"x": Shard(t, global_shape=(2, 6), offsets=(0, 0))})


class FakeStaging:
    def __init__(self, tensors):
        self._t = tensors

    def tensors(self):
        return self._t

    def close(self):
        pass


def writer_for(staged, sent, monkeypatch):
    def send(kind, fields, frames=()):
        assert kind is Kind.PIECE_DONE
        sent.append(list(fields["pieces"]))

    link = pieces_mod.Link(
        send=send, keepalive=lambda *a: None, poll=lambda step, timeout: None, heartbeat=lambda: 1.0
    )
    writer = local_mod.StagingWriter(link)
    writer.arena = FakeStaging(staged)
    monkeypatch.setattr(writer, "open", lambda handle: None)
    return writer


def test_the_staging_writer_reuses_its_plan_and_copies_current_values(monkeypatch):
    """Two steps of the same pieces: one plan, and each step's PIECE_DONEs name the pieces once
    their current values landed. New ids (another rank order) or another arena make a new plan."""
    monkeypatch.setattr(pieces_mod, "DONE_BATCH_PIECES", 2)
    w = weights()
    w["big"] = torch.randn(local_mod.FOREACH_COPY_BYTES)  # over the foreach size: copied on its own
    staged = {n: torch.zeros_like(t) for n, t in w.items()}
    sent: list[list[int]] = []
    writer = writer_for(staged, sent, monkeypatch)
    pieces, _ = StepPieces().of(w)
    ids = list(range(10, 10 + len(pieces)))
    writer.write_step(0, pieces, ids, {}, float("inf"))
    plan = writer._planned
    assert sent == [[10, 11], [12, 13], [14, 15]]
    assert all(torch.equal(staged[n], t) for n, t in w.items())

    for t in w.values():  # the trainer's next step
        if t.numel():
            t.add_(1)
    writer.write_step(1, pieces, list(ids), {}, float("inf"))
    assert writer._planned is plan
    assert all(torch.equal(staged[n], t) for n, t in w.items())

    fresh = {n: t.clone() for n, t in w.items()}  # other tensor objects, the same places
    fresh["a"].add_(5)
    fresh_pieces, _ = StepPieces().of(fresh)
    writer.write_step(1, fresh_pieces, list(ids), {}, float("inf"))
    assert writer._planned is not plan and writer._planned[3][0].regions is plan[3][0].regions
    assert all(torch.equal(staged[n], t) for n, t in fresh.items())
    plan = writer._planned
    moved = dict(fresh)
    moved["b"] = torch.randn(7).bfloat16()  # another dtype: planned again
    writer.write_step(1, StepPieces().of(moved)[0], list(ids), {}, float("inf"))
    assert writer._planned[3][0].regions is not plan[3][0].regions
    writer.write_step(1, pieces, list(ids), {}, float("inf"))
    plan = writer._planned

    writer.write_step(2, pieces, ids[::-1], {}, float("inf"))
    assert writer._planned is not plan and sent[-3:] == [[15, 14], [13, 12], [11, 10]]
    plan = writer._planned
    writer.arena = FakeStaging({n: torch.zeros_like(t) for n, t in w.items()})  # another mapping
    writer.write_step(3, pieces, ids[::-1], {}, float("inf"))
    assert writer._planned is not plan
    assert all(torch.equal(writer.arena.tensors()[n], t) for n, t in w.items())
    writer.close()
    assert writer._planned is None


# ---- READY names a staging arena the rank mapped by its layout id


def test_a_ready_names_a_mapped_arena_by_layout_id_and_a_new_layout_remaps(monkeypatch):
    from sidecar.daemon.peers import Peer
    from sidecar.daemon.trainers import staging_for
    from sidecar.protocol.enums import PeerRole
    from transport.wire import ProtocolError

    opened = []

    class Mapped(FakeStaging):
        def __init__(self, handle):
            super().__init__({})
            self.name, self.closed = handle["name"], False
            opened.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(local_mod, "open_any_arena", lambda handle, writable, device=None: Mapped(handle))
    full = {"kind": "shm", "name": "refitd-x-staging", "size": 4096, "layout": [["w", "bfloat16", [4], 0, 8]]}
    full["layout_id"] = "aaaa"
    peer = Peer(b"id", PeerRole.TRAINER, 0.0, rank=0, local=True)
    assert staging_for(peer, full) is full  # the first READY: the whole handle
    peer.staging = ("refitd-x-staging", "aaaa")
    short = staging_for(peer, full)
    assert short == {"kind": "shm", "name": "refitd-x-staging", "layout_id": "aaaa"}

    writer = local_mod.StagingWriter(pieces_mod.Link(send=None, keepalive=None, poll=None, heartbeat=None))
    with pytest.raises(ProtocolError, match="without its layout, but this client has not mapped it"):
        writer.open(short)
    writer.open(full)
    writer.open(short)  # the same arena and layout: nothing opened
    assert len(opened) == 1 and not opened[0].closed
    writer.open({**full, "layout_id": "bbbb", "layout": [["w", "bfloat16", [2, 2], 0, 8]]})  # re-carved
    assert len(opened) == 2 and opened[0].closed
    with pytest.raises(ProtocolError, match="has not mapped it"):
        writer.open(short)  # the old layout's id: not what is mapped now


def test_local_steps_get_the_layout_once_per_connection(daemons):
    """The daemon sends the staging layout in the first READY on a connection; later steps name
    the arena by layout id and the client keeps its mapping; a reconnected client gets it again."""
    from sidecar.client import RefitClient

    d = daemons(model_type="qwen3_moe", format="bf16", staging_bytes=1 << 20, publish_bytes=1 << 20)
    w = {f"n.{i}.weight": torch.randn(8) for i in range(20)}
    with RefitClient(d.endpoint, 0, 1, timeout=60) as client:
        client.push_step(0, w)
        arena = client._local.arena
        trainer = next(p for p in d.daemon.peers.values() if p.rank == 0)
        assert trainer.staging is not None and trainer.staging[0] == arena.name
        client.push_step(1, w)
        assert client._local.arena is arena and client._local._layout_id == trainer.staging[1]
    with RefitClient(d.endpoint, 0, 1, timeout=60) as again:  # a new connection: the whole handle
        again.push_step(2, w)
        assert again._local.arena is not None
