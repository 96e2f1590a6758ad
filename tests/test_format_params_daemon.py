"""The daemon publishes in the format parameters the attached engine's manifest says (INT4 group and
scale dtype, NVFP4's names): planned from the config with the defaults, it re-plans when the engine
attaches; planned from the first step, it plans with them. An engine holding other parameters than
the one attached is refused naming both, and the daemon serves on."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.numerics.formats import Format, FormatParams
from sidecar.plan.build import RefitPlan, RefitSpec
from sidecar.plan.run import convert
from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor

MODEL = "qwen3_moe"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def manifest_for(state: dict[str, torch.Tensor], fmt: str, params: FormatParams) -> Manifest:
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type=MODEL, fmt=fmt, params=params))
    return Manifest(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format=fmt,
        tensors=tuple(ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs),
        format_params=params,
    )


@pytest.mark.parametrize(
    ("fmt", "params", "with_config"),
    [
        ("int4_w4a16", FormatParams(int4_group=128, int4_scale_dtype="float32"), True),
        ("nvfp4", FormatParams(nvfp4_names="compressed_tensors"), False),
    ],
    ids=["int4-g128-f32-from-config", "nvfp4-ct-names-from-step"],
)
def test_the_daemon_publishes_what_the_engine_holds(daemons, fmt, params, with_config):
    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from sidecar.errors import ErrorKind, RefitError

    state = make_state_dict(MODEL, num_layers=2, num_experts=2, seed=6)
    settings = {"world_size": 1, "format": fmt, "staging_bytes": 16 << 20, "publish_bytes": 8 << 20}
    if with_config:
        settings["hf_config"] = make_hf_config(MODEL, num_layers=2, num_experts=2)
    else:
        settings["model_type"] = MODEL
    d = daemons(**settings)
    with (
        RefitReader(d.endpoint, name="engine-0", manifest=manifest_for(state, fmt, params)) as engine,
        RefitClient(d.endpoint, rank=0, world_size=1) as client,
    ):
        engine.attach(timeout=30)
        client.push_step(0, state)
        gen = engine.wait(min_step=0)
        try:
            expected = convert(state, RefitSpec(model_type=MODEL, fmt=fmt, params=params))
            assert set(gen.tensors) == set(expected)
            bad = [n for n, t in expected.items() if not same_bytes(gen.tensors[n], t)]
        finally:
            engine.release(gen)
        assert not bad, bad[:5]
        # a second engine holding the defaults cannot share this plan: refused naming both
        with (
            RefitReader(
                d.endpoint, name="engine-1", manifest=manifest_for(state, fmt, FormatParams())
            ) as other,
            pytest.raises(RefitError) as err,
        ):
            other.attach(timeout=30)
        assert err.value.kind is ErrorKind.ENGINE
        assert params.describe(Format(fmt)) in str(err.value)
        # the daemon serves on, in the first engine's parameters
        client.push_step(1, state)
        gen = engine.wait(min_step=1)
        try:
            assert all(same_bytes(gen.tensors[n], t) for n, t in expected.items())
        finally:
            engine.release(gen)


def test_a_forwarded_generation_keeps_the_trainer_nodes_parameters(tmp_path):
    """Disaggregated: the engines attach to the inference node's daemon, not to the trainer node's, so
    the trainer node's settings give the parameters (``int4_group``, ``int4_scale_dtype``); the inference
    node publishes the forwarded group-128, float32-scale generation byte for byte."""
    from support.daemons import RunningDaemon
    from support.net import free_port
    from support.waiting import wait_until

    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from transport.curve import write_keypair

    keys = tmp_path / "keys"
    allowed = keys / "allowed"
    allowed.mkdir(parents=True)
    trainer_key, _ = write_keypair(allowed, "trainer")
    inference_key, inference_pub = write_keypair(keys, "inference")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    params = FormatParams(int4_group=128, int4_scale_dtype="float32")
    common = dict(layout="disaggregated", forward_timeout_s=10.0, reader_timeout_s=30.0, format="int4_w4a16")
    state = make_state_dict(MODEL, num_layers=2, num_experts=2, seed=8)
    inference = RunningDaemon(
        tmp_path,
        runtime_dir=tmp_path / "inference",
        role="inference",
        model_type=MODEL,
        publish_bytes=8 << 20,
        listen=endpoint,
        curve_secret_key=inference_key,
        curve_allowed_keys=allowed,
        curve_trainer_keys=allowed / "trainer.key.pub",
        **common,
    )
    trainer = RunningDaemon(
        tmp_path,
        runtime_dir=tmp_path / "trainer",
        hf_config=make_hf_config(MODEL, num_layers=2, num_experts=2),
        role="trainer",
        world_size=1,
        peers=[endpoint],
        curve_secret_key=trainer_key,
        curve_server_key=inference_pub,
        int4_group=params.int4_group,
        int4_scale_dtype=params.int4_scale_dtype,
        **common,
    )
    try:
        with RefitReader(inference.daemon.local_listen, name="inference-engine", timeout=20.0) as reader:
            with RefitClient(trainer.endpoint, 0, 1, timeout=20.0) as client:
                client.push_step(0, state)

            def live() -> bool:
                return reader.status(timeout=20.0)["last_step"] == 0

            wait_until("the forwarded step live on the inference node", live, timeout=60.0)
            gen = reader.wait(min_step=0)
            try:
                expected = convert(state, RefitSpec(model_type=MODEL, fmt="int4_w4a16", params=params))
                assert set(gen.tensors) == set(expected)
                bad = [n for n, t in expected.items() if not same_bytes(gen.tensors[n], t)]
                scale = next(t for n, t in gen.tensors.items() if n.endswith("down_proj.weight_scale"))
            finally:
                reader.release(gen)
            assert not bad, bad[:5]
            assert scale.dtype == torch.float32
    finally:
        trainer.close()
        inference.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "argv",
    [
        ["--format", "int4_w4a16", "--int4-scale-dtype", "float32"],
        ["--format", "nvfp4", "--nvfp4-names", "compressed_tensors"],
    ],
    ids=["int4-f32", "nvfp4-ct"],
)
def test_the_demo_runs_an_engine_holding_a_variant(argv):
    """``refitd demo`` with the reference engine holding a variant: every generation byte for byte into
    it, decoded, the KL against BF16 small."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli.main", "demo", *argv, "--steps", "2", "--layers", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] and summary["steps"] == 2
    assert summary["format_params"] in ("group 32, float32 scales", "compressed_tensors names")
    for row in summary["per_step"]:
        assert row["published_exact"] and row["engine_exact"] and 0 < row["kl"] < 0.05
