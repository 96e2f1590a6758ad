"""A node publishes only its share (issue 15, deliverable 4, the daemon half).

Two daemons in threads of the test process stand for the two nodes of an expert-parallel engine
(``engine_ep=4, nodes=2``) over a small synthetic DeepSeek-V3. The trainer pushes the whole model
to each; each plans, allocates and publishes only its node's routed experts (and everything else
whole), byte for byte what ``convert(..., share=(layout, node))`` gives; READY tells the ranks to
skip the other node's experts, so they are never sent. Node 0 takes the local path (staging in
shared memory, whole step), node 1 the remote one (ZeroMQ frames over loopback TCP, a staging ring).
A rank that sends a piece it was told to skip fails the step on every rank, and the next step
publishes. Plus the settings' validation.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.daemons import RunningDaemon
from support.net import free_port
from test_hostile_trainers import RawRank

from adapters.base import RefitReader
from adapters.engine import EngineWorker
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict, shard_for_rank
from sidecar.cli.serve import render_status
from sidecar.client.client import RefitClient, Shard, _without_skipped
from sidecar.config.settings import ConfigError, DaemonConfig
from sidecar.config.sources import load_config
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import EngineLayout, RefitSpec, plan_from_hf_config, with_checkpoint_scheme
from sidecar.plan.run import convert
from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor
from transport import nixl
from transport.wire import Kind, ProtocolError

MODEL = dict(num_layers=3, num_experts=32)
CONFIG = make_hf_config("deepseek_v3", **MODEL)
LAYOUT = EngineLayout(ep=4, tp=1, nodes=2)
#: the spec each daemon runs: block FP8, the checkpoint's own scheme (its linears quantized too)
SPEC = with_checkpoint_scheme(
    RefitSpec(model_type="deepseek_v3", fmt="block_fp8", num_hidden_layers=MODEL["num_layers"]), CONFIG
)
WORLD = 2
WAIT_S = 60.0
SHARE = dict(engine_ep=LAYOUT.ep, engine_tp=LAYOUT.tp, nodes=LAYOUT.nodes)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")


@pytest.fixture
def nodes(tmp_path):
    """Node 0: ipc (local staging, whole step); node 1: loopback TCP (NIXL READs where NIXL works,
    else frames) through a staging ring."""
    started = []
    try:
        for node, extra in enumerate(
            ({}, {"listen": f"tcp://127.0.0.1:{free_port()}", "staging_regions": 2})
        ):
            root = tmp_path / f"node{node}"
            root.mkdir()
            started.append(
                RunningDaemon(root, hf_config=CONFIG, world_size=WORLD, node_rank=node, **SHARE, **extra)
            )
        yield started
    finally:
        for d in started:
            d.close()


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


def weights(seed: int) -> dict[str, torch.Tensor]:
    return make_state_dict("deepseek_v3", seed=seed, **MODEL)


def push_whole_model(pool, endpoint: str, step: int, sd) -> list:
    """Every trainer rank pushes its part of the whole model, as a trainer that knows nothing of shares."""
    with (
        RefitClient(endpoint, 0, WORLD, timeout=WAIT_S) as c0,
        RefitClient(endpoint, 1, WORLD, timeout=WAIT_S) as c1,
    ):
        futures = [pool.submit(c.push_step, step, shard_for_rank(sd, c.rank, WORLD)) for c in (c0, c1)]
        return [f.result(timeout=WAIT_S) for f in futures]


def published(endpoint: str, step: int) -> dict[str, torch.Tensor]:
    """The live generation's tensors, copied out, once it is ``step``."""
    with RefitReader(endpoint, name="check") as reader:
        gen = reader.wait(min_step=step, timeout=WAIT_S)
        try:
            assert gen.step == step
            return {n: t.clone() for n, t in gen.tensors.items()}
        finally:
            reader.release(gen)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def is_routed(name: str) -> bool:
    return ".mlp.experts." in name


@pytest.mark.timeout(180)
def test_two_nodes_each_publish_exactly_their_share_and_together_the_model(nodes, pool):
    sd = weights(seed=1)
    whole = convert(sd, SPEC)
    plans = [plan_from_hf_config(CONFIG, SPEC, share=(LAYOUT, n)) for n in range(2)]
    full_plan = plan_from_hf_config(CONFIG, SPEC)
    gens = []
    for node, (d, plan) in enumerate(zip(nodes, plans)):
        results = push_whole_model(pool, d.endpoint, 1, sd)
        # the ranks were told to skip the other node's experts: only the share's inputs travelled
        assert {r.bytes_in for r in results} == {plan.bytes_in} and plan.bytes_in < full_plan.bytes_in
        gen = published(d.endpoint, 1)
        expected = convert(sd, SPEC, share=(LAYOUT, node))
        assert list(gen) == list(expected) == [o.name for o in plan.outputs]
        assert [n for n in expected if not same_bytes(gen[n], expected[n])] == []
        gens.append(gen)
        status = d.status()
        # the other node's 16 experts x 3 projections in each of the 2 MoE layers and the MTP layer
        assert len(plan.dropped) == 3 * 16 * 3
        assert status["plan"]["share"] == {**SHARE, "node_rank": node, "dropped_inputs": len(plan.dropped)}
        assert status["plan"]["bytes_out"] == plan.bytes_out
        assert f"node share: node {node} of 2 (engine EP 4, TP 1); 144 inputs" in render_status(status)

    # each node's routed experts are its EP ranks' runs: disjoint, and together every expert
    routed = [{n for n in g if is_routed(n)} for g in gens]
    assert routed[0].isdisjoint(routed[1])
    assert routed[0] | routed[1] == {n for n in whole if is_routed(n)}
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in routed[0]
    assert "model.layers.1.mlp.experts.16.down_proj.weight" in routed[1]
    # everything else is held whole by both; the union is the whole model, byte for byte
    assert {n for n in gens[0] if not is_routed(n)} == {n for n in gens[1] if not is_routed(n)}
    union = {**gens[0], **gens[1]}
    assert set(union) == set(whole)
    assert [n for n in whole if not same_bytes(union[n], whole[n])] == []

    # generation memory: each node's is about half of the whole model's (experts dominate here,
    # as in the real model); the routed-expert part is exactly half
    ratios = [p.bytes_out / full_plan.bytes_out for p in plans]
    expert_bytes = [sum(o.nbytes for o in p.outputs if is_routed(o.name)) for p in plans]
    full_experts = sum(o.nbytes for o in full_plan.outputs if is_routed(o.name))
    assert expert_bytes == [full_experts // 2] * 2
    assert all(0.5 < r < 0.6 for r in ratios), ratios
    generation_bytes = [d.status()["generations"][0]["bytes"] for d in nodes]
    full_generation = sum(o.nbytes for o in full_plan.outputs)
    assert all(b < 0.62 * full_generation for b in generation_bytes), (generation_bytes, full_generation)


@pytest.mark.timeout(180)
def test_a_rank_sending_a_piece_it_was_told_to_skip_fails_the_step_on_every_rank(nodes, pool):
    d = nodes[0]
    sd = weights(seed=2)
    push_whole_model(pool, d.endpoint, 1, sd)  # a good generation first
    raw = RawRank(d.endpoint, rank=0, world=WORLD)
    try:
        raw.hello()
        part = {
            n: (p.tensor, p.global_shape, p.offsets) if isinstance(p, Shard) else (p, p.shape, (0,) * p.dim())
            for n, p in shard_for_rank(sd, 0, WORLD).items()
        }
        rows = [
            [n, str(t.dtype).removeprefix("torch."), list(g), list(o), list(t.shape)]
            for n, (t, g, o) in part.items()
        ]
        with RefitClient(d.endpoint, 1, WORLD, timeout=WAIT_S) as honest:
            future = pool.submit(honest.push_step, 2, shard_for_rank(sd, 1, WORLD))
            raw.send(Kind.BEGIN, {"step": 2, "pieces": rows})
            ready = raw.expect(Kind.READY).fields
            skip = ready["skip"]
            names = list(part)
            assert skip and all(is_routed(names[ready["pieces"].index(pid)]) for pid in skip)
            pid = skip[0]
            tensor, _, offsets = part[names[ready["pieces"].index(pid)]]
            raw.send(
                Kind.SHARD,
                {"step": 2, "piece": pid, "offsets": list(offsets), "shape": list(tensor.shape)},
                [tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()],
            )
            err = raw.error()
            assert err.kind is ErrorKind.PROTOCOL and "told it to skip" in str(err) and "share" in str(err)
            exc = future.exception(timeout=WAIT_S)
            assert isinstance(exc, RefitError) and "told it to skip" in str(exc)
    finally:
        raw.close()
    # the last good generation is still live, and the next honest step publishes its share
    assert d.status()["live"]["step"] == 1
    sd3 = weights(seed=3)
    push_whole_model(pool, d.endpoint, 3, sd3)
    gen, expected = published(d.endpoint, 3), convert(sd3, SPEC, share=(LAYOUT, 0))
    assert [n for n in expected if not same_bytes(gen[n], expected[n])] == []


@pytest.mark.timeout(180)
def test_a_plan_fixed_by_the_first_step_is_the_share(tmp_path, pool):
    """Without hf_config the first step's declarations fix the plan: for the node's share too."""
    d = RunningDaemon(
        tmp_path,
        model_type="deepseek_v3",
        world_size=WORLD,
        staging_bytes="64MiB",
        publish_bytes="64MiB",
        node_rank=1,
        **SHARE,
    )
    try:
        assert d.status()["plan"] is None
        sd = weights(seed=6)
        spec = RefitSpec(model_type="deepseek_v3", fmt="block_fp8")  # no config: the linears stay BF16
        results = push_whole_model(pool, d.endpoint, 1, sd)
        expected = convert(sd, spec, share=(LAYOUT, 1))
        plan_in = sum(
            t.numel() * t.element_size() for n, t in sd.items() if n in expected or not is_routed(n)
        )
        assert {r.bytes_in for r in results} == {plan_in}
        gen = published(d.endpoint, 1)
        assert set(gen) == set(expected)  # in the order the ranks declared them
        assert [n for n in expected if not same_bytes(gen[n], expected[n])] == []
        assert d.status()["plan"]["share"]["dropped_inputs"] == 3 * 16 * 3
    finally:
        d.close()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not nixl.available()[0], reason="NIXL is unavailable")
def test_a_remote_rank_pulled_over_nixl_is_not_read_for_skipped_pieces(tmp_path, pool):
    """Rank 0 writes staging in place, rank 1 is remote and pulled over NIXL: only the share's
    pieces are read (every one of them has a contiguous destination: all of it over NIXL)."""
    d = RunningDaemon(tmp_path, hf_config=CONFIG, world_size=WORLD, node_rank=1, **SHARE)
    try:
        sd = weights(seed=5)
        plan = plan_from_hf_config(CONFIG, SPEC, share=(LAYOUT, 1))
        with (
            RefitClient(d.endpoint, 0, WORLD, local=True, timeout=WAIT_S) as c0,
            RefitClient(d.endpoint, 1, WORLD, local=False, timeout=WAIT_S) as c1,
        ):
            futures = [pool.submit(c.push_step, 1, shard_for_rank(sd, c.rank, WORLD)) for c in (c0, c1)]
            r0, r1 = (f.result(timeout=WAIT_S) for f in futures)
        assert (r0.mover, r1.mover, r1.mover_reason) == ("staging", "nixl", "")
        assert r1.bytes_in == plan.bytes_in
        gen, expected = published(d.endpoint, 1), convert(sd, SPEC, share=(LAYOUT, 1))
        assert list(gen) == list(expected)
        assert [n for n in expected if not same_bytes(gen[n], expected[n])] == []
    finally:
        d.close()


def share_manifest(node: int, keep_bf16=()) -> Manifest:
    """What an engine on ``node`` holding its share (``keep_bf16`` in BF16) would list."""
    plan = plan_from_hf_config(CONFIG, SPEC, keep_bf16=keep_bf16, share=(LAYOUT, node))
    return Manifest(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="test",
        expert_format="block_fp8",
        tensors=tuple(ManifestTensor(o.name, o.dtype, o.shape) for o in plan.outputs),
    )


@pytest.mark.timeout(180)
def test_an_engine_holding_experts_in_bf16_replans_the_same_share(tmp_path, pool):
    """The engine on node 0 keeps one of its experts in BF16: the daemon re-plans, for its share
    still, and the trainer's whole-model push publishes it (the other node's experts still skipped)."""
    keep = [f"model.layers.1.mlp.experts.3.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    d = RunningDaemon(
        tmp_path, hf_config=CONFIG, world_size=WORLD, node_rank=0, publish_bytes="64MiB", **SHARE
    )
    try:
        worker = EngineWorker(
            d.endpoint, name="node0-engine", manifest=share_manifest(0, keep), load=lambda g: None
        )
        assert worker.attach(timeout=WAIT_S)["checked"] is True
        sd = weights(seed=4)
        plan = plan_from_hf_config(CONFIG, SPEC, keep_bf16=keep, share=(LAYOUT, 0))
        results = push_whole_model(pool, d.endpoint, 1, sd)
        assert {r.bytes_in for r in results} == {plan.bytes_in}
        gen = published(d.endpoint, 1)
        expected = convert(sd, SPEC, keep_bf16=keep, share=(LAYOUT, 0))
        assert gen[f"{keep[0]}.weight"].dtype == torch.bfloat16
        assert list(gen) == list(expected)
        assert [n for n in expected if not same_bytes(gen[n], expected[n])] == []
        worker.detach()
    finally:
        d.close()


def test_an_engine_expecting_experts_outside_the_share_is_refused(tmp_path):
    """An engine on node 1 attaches to node 0's daemon: the experts it expects are not published."""
    d = RunningDaemon(tmp_path, hf_config=CONFIG, world_size=WORLD, node_rank=0, **SHARE)
    try:
        worker = EngineWorker(
            d.endpoint, name="node1-engine", manifest=share_manifest(1), load=lambda g: None
        )
        with pytest.raises(RefitError) as err:
            worker.attach(timeout=WAIT_S)
        assert err.value.kind is ErrorKind.ENGINE
        assert "model.layers.1.mlp.experts.16.gate_proj.weight: the engine expects" in str(err.value)
        assert "the plan does not publish it" in str(err.value)
        worker.detach()
    finally:
        d.close()


@pytest.mark.parametrize("skip", [[7], ["1"], 1, [True]])
def test_a_skip_that_names_no_piece_of_the_rank_is_a_protocol_error(skip) -> None:
    with pytest.raises(ProtocolError, match="READY's skip must list piece ids READY gave this rank"):
        _without_skipped(skip, ["a", "b"], [1, 2], None)
    assert _without_skipped([2], ["a", "b"], [1, 2], ["A", "B"]) == (["a"], [1], ["A"])


# --------------------------------------------------------------------------------------------------
# settings


def test_share_settings_from_every_source(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "xdg"), "REFITD_NODE_RANK": "1", "REFITD_ENGINE_EP": "16"}
    c = load_config(["--nodes", "2", "--engine-tp", "1"], env=env)
    assert (c.engine_ep, c.engine_tp, c.nodes, c.node_rank) == (16, 1, 2, 1)
    assert c.share == (EngineLayout(ep=16, tp=1, nodes=2), 1)
    assert DaemonConfig(runtime_dir=tmp_path).share is None  # the default: the whole model
    assert DaemonConfig(runtime_dir=tmp_path, engine_ep=8, node_rank=0).share is None


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"nodes": 2, "engine_ep": 16}, ["nodes = 2 needs node_rank", "SLURM_NODEID"]),
        ({"nodes": 2, "engine_ep": 16, "node_rank": 2}, ["node_rank = 2 is outside the engine's 2 node(s)"]),
        ({"node_rank": 1}, ["node_rank = 1 is outside the engine's 1 node(s)"]),
        (
            {"nodes": 2, "engine_ep": 3, "node_rank": 0},
            ["engine_ep = 3, engine_tp = 1, nodes = 2", "split evenly"],
        ),
        ({"nodes": 2, "engine_ep": 16, "engine_tp": 3, "node_rank": 0}, ["ep must be a multiple of tp"]),
        ({"nodes": 2, "engine_tp": 16, "node_rank": 0}, ["tp=16 spans 2 nodes"]),
        ({"nodes": 0}, ["nodes = 0: give the number of nodes"]),
        ({"engine_ep": 0}, ["engine_ep = 0: give the engine's expert-parallel size"]),
        ({"node_rank": -1}, ["node_rank = -1: give this node's index"]),
        ({"nodes": "two"}, ["nodes = 'two': expected a whole number"]),
    ],
)
def test_share_settings_refused_with_what_to_give(tmp_path: Path, changes, needles) -> None:
    with pytest.raises(ConfigError) as excinfo:
        DaemonConfig(runtime_dir=tmp_path, **changes)
    (message,) = [str(p) for p in excinfo.value.problems]
    assert all(n in message for n in needles), message


def test_a_share_is_refused_in_a_disaggregated_layout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nodes > 1 \(a node's share\) applies to layout = 'colocated'"):
        DaemonConfig(
            runtime_dir=tmp_path,
            layout="disaggregated",
            role="trainer",
            peers=["tcp://127.0.0.1:5555"],
            nodes=2,
            engine_ep=16,
            node_rank=0,
        )
