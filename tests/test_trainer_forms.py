"""What a trainer's state dict looks like besides a checkpoint's: the routed experts fused as
transformers 5.x modules hold them, FP32 masters, and the published dtypes (RefitSpec.published_dtype)."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.plan.build import RefitSpec, Role, plan_from_hf_config
from sidecar.plan.models import MODELS, ExpertForm, get_model
from sidecar.plan.run import convert

FAMILIES = sorted(MODELS)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def config_of(model: str) -> dict:
    cfg = make_hf_config(model, num_layers=2, num_experts=4)
    if "text_config" in cfg:
        cfg["text_config"] = {**cfg["text_config"], "dtype": "bfloat16"}
    return cfg


def per_expert_state_dict(
    model: str, cfg: dict, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random values in the checkpoint's per-expert form; ``dtype`` for every float the checkpoint holds
    in BF16 (the FP32 router bias stays FP32)."""
    g = torch.Generator().manual_seed(seed)
    params = get_model(model).parameters(cfg, experts=ExpertForm.PER_EXPERT)
    return {
        n: (torch.randn(s, generator=g) * 0.05).to(torch.float32 if d == torch.float32 else dtype)
        for n, s, d in params
    }


def fused(model: str, cfg: dict, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with each layer's experts stacked as transformers 5.x holds them (gate rows, then up)."""
    out = {}
    for name, shape, _ in get_model(model).parameters(cfg, experts=ExpertForm.FUSED):
        if name.endswith(".gate_up_proj"):
            p = name.removesuffix(".gate_up_proj")
            out[name] = torch.stack(
                [
                    torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]])
                    for e in range(shape[0])
                ]
            )
        elif name.endswith(".down_proj") and name.rsplit(".", 2)[-2] == "experts":
            p = name.removesuffix(".down_proj")
            out[name] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(shape[0])])
        else:
            out[name] = sd[name]
    return out


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_per_tensor"])
def test_both_expert_forms_publish_the_same_bytes(model, fmt):
    cfg = config_of(model)
    spec = plan_from_hf_config(cfg, RefitSpec(model_type=model, fmt=fmt)).spec
    sd = per_expert_state_dict(model, cfg, torch.bfloat16)
    a, b = convert(sd, spec), convert(fused(model, cfg, sd), spec)
    assert list(a) == list(b) or sorted(a) == sorted(b)
    bad = [n for n in a if not same_bytes(a[n], b[n])]
    assert not bad, bad[:5]


@pytest.mark.parametrize("model", FAMILIES)
def test_a_plan_from_the_config_takes_either_form_and_fp32_masters(model):
    """The config lists the checkpoint's form and dtype; a trainer's fused FP32 state dict publishes the
    very same outputs, in the same layout order, so the daemon's generation layout holds."""
    cfg = config_of(model)
    plan = plan_from_hf_config(cfg, RefitSpec(model_type=model, fmt="mxfp8"))
    for form in ExpertForm:
        for dtype in (torch.bfloat16, torch.float32):
            params = get_model(model).parameters(cfg, experts=form)
            specs = [(n, s, torch.float32 if dtype == torch.float32 else d) for n, s, d in params]
            other = plan.rebuild_for(specs)
            assert other is not None, (form, dtype)
            assert [(o.name, o.dtype, o.shape) for o in other.outputs] == [
                (o.name, o.dtype, o.shape) for o in plan.outputs
            ]
            same = {i.name for i in plan.inputs} == {i.name for i in other.inputs} and dtype == torch.bfloat16
            assert (other is plan) == same
    # a renamed tensor, or a shape that differs, publishes something else: the caller names it
    params = get_model(model).parameters(cfg)
    assert plan.rebuild_for([(n + "x" if i == 0 else n, s, d) for i, (n, s, d) in enumerate(params)]) is None
    assert (
        plan.rebuild_for([(n, (s[0] + 1, *s[1:]) if i == 0 else s, d) for i, (n, s, d) in enumerate(params)])
        is None
    )


@pytest.mark.parametrize("model", FAMILIES)
def test_fp32_masters_publish_the_checkpoint_dtype(model):
    """SPEC's passthrough, in the checkpoint's dtype: an FP32 master's norms and embeddings arrive as
    BF16 (round to nearest even, Tensor.to), the FP32 router bias stays FP32, and the quantized
    outputs are computed from the FP32 input as it is."""
    cfg = config_of(model)
    spec = plan_from_hf_config(cfg, RefitSpec(model_type=model, fmt="mxfp8")).spec
    assert spec.dtype == torch.bfloat16
    master = fused(model, cfg, per_expert_state_dict(model, cfg, torch.float32))
    out = convert(master, spec)
    plan = plan_from_hf_config(cfg, spec).rebuild_for([(n, t) for n, t in master.items()])
    roles = {o.name: o for o in plan.outputs}
    for name, t in out.items():
        o = roles[name]
        if o.role is not Role.PASSTHROUGH:
            continue
        src = master[name]
        if name.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32 and same_bytes(t, src)
        else:
            assert t.dtype == torch.bfloat16 and same_bytes(t, src.to(torch.bfloat16))
    # quantized from FP32 as it is: differs from quantizing the BF16 rounding somewhere
    bf16 = convert(
        {
            n: t.to(torch.bfloat16) if t.dtype == torch.float32 and not n.endswith("bias") else t
            for n, t in master.items()
        },
        spec,
    )
    weights = [n for n, o in roles.items() if o.role is Role.WEIGHT]
    assert weights and any(not same_bytes(out[n], bf16[n]) for n in weights)
    # without a checkpoint dtype every input keeps its own (the old behaviour)
    plain = convert(master, RefitSpec(model_type=model, fmt="mxfp8", num_hidden_layers=2))
    assert all(plain[n].dtype == torch.float32 for n, o in roles.items() if o.role is Role.PASSTHROUGH)


def test_refit_spec_dtype_is_checked():
    assert RefitSpec(model_type="qwen3_moe", fmt="mxfp8", dtype="bfloat16").dtype is torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16, float16, float32"):
        RefitSpec(model_type="qwen3_moe", fmt="mxfp8", dtype=torch.int8)


# ---- the daemon: a plan from the config takes what the trainer pushes


def test_the_daemon_follows_the_trainers_form_and_refuses_too_little_staging(daemons, tmp_path):
    """A daemon planned from a config (per-expert, BF16) takes the fused FP32 state dict a
    transformers 5.x trainer holds, publishing convert's bytes; with staging sized for the checkpoint
    alone the FP32 step fails with a CAPACITY error that says what to set, and nothing changes."""
    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from sidecar.errors import ErrorKind, RefitError

    model = "deepseek_v3"
    cfg = config_of(model)
    spec = plan_from_hf_config(cfg, RefitSpec(model_type=model, fmt="mxfp8")).spec
    bf16 = per_expert_state_dict(model, cfg, torch.bfloat16, seed=1)
    master = fused(model, cfg, per_expert_state_dict(model, cfg, torch.float32, seed=2))
    small = daemons(hf_config=cfg, world_size=1, format="mxfp8", runtime_dir=tmp_path / "small")
    with RefitClient(small.endpoint, rank=0, world_size=1) as client, RefitReader(small.endpoint) as reader:
        client.push_step(0, fused(model, cfg, bf16))  # the fused form fits the checkpoint's staging
        with pytest.raises(RefitError, match="staging_bytes") as err:
            client.push_step(1, master)
        assert err.value.kind is ErrorKind.CAPACITY
        gen = reader.wait()  # step 0 is still live
        reader.release(gen)
        assert gen.step == 0
        client.push_step(2, fused(model, cfg, bf16))  # the daemon keeps serving what fits
        gen = reader.wait(min_step=2)
        try:
            expected = convert(bf16, spec)
            assert gen.step == 2 and all(same_bytes(gen.tensors[n], t) for n, t in expected.items())
        finally:
            reader.release(gen)
    big = daemons(
        hf_config=cfg, world_size=1, format="mxfp8", staging_bytes=16 << 20, runtime_dir=tmp_path / "big"
    )
    with RefitClient(big.endpoint, rank=0, world_size=1) as client, RefitReader(big.endpoint) as reader:
        for step, sd in enumerate([master, bf16, master]):  # the plan follows each step's form
            client.push_step(step, sd)
            gen = reader.wait(min_step=step)
            try:
                expected = convert(sd, spec)
                bad = [n for n, t in expected.items() if not same_bytes(gen.tensors[n], t)]
            finally:
                reader.release(gen)
            assert not bad, (step, bad[:5])


def test_without_a_config_the_engines_manifest_gives_the_published_dtype(daemons):
    """A daemon started without the model's config, an engine attached whose manifest holds BF16: an
    FP32 master's passthroughs are published in BF16 (the router bias in FP32), as convert gives them
    under the engine's dtype; a second engine attaching later is checked against that same plan."""
    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from sidecar.plan.attach import with_engine_dtype
    from sidecar.plan.build import RefitPlan
    from sidecar.plan.constraints import EngineKind
    from sidecar.protocol.manifest import Manifest, ManifestTensor

    model = "deepseek_v3"
    cfg = config_of(model)
    bare = RefitSpec(model_type=model, fmt="mxfp8")  # no config: no checkpoint dtype
    checkpoint = RefitPlan.build(get_model(model).parameters(cfg), bare)  # BF16, router bias FP32
    manifest = Manifest(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format=bare.format,
        tensors=tuple(ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in checkpoint.outputs),
    )
    spec = with_engine_dtype(bare, manifest)
    assert spec.dtype is torch.bfloat16
    master = fused(model, cfg, per_expert_state_dict(model, cfg, torch.float32, seed=3))
    d = daemons(model_type=model, world_size=1, format="mxfp8", staging_bytes=16 << 20, publish_bytes=8 << 20)
    with (
        RefitReader(d.endpoint, name="engine-0", manifest=manifest) as engine,
        RefitClient(d.endpoint, rank=0, world_size=1) as client,
    ):
        engine.attach(timeout=30)
        client.push_step(0, master)
        gen = engine.wait(min_step=0)
        try:
            expected = convert(master, spec)
            assert {n: t.dtype for n, t in expected.items()} == {o.name: o.dtype for o in checkpoint.outputs}
            bad = [n for n, t in expected.items() if not same_bytes(gen.tensors[n], t)]
        finally:
            engine.release(gen)
        assert not bad, bad[:5]
        with RefitReader(d.endpoint, name="engine-1", manifest=manifest) as late:
            late.attach(timeout=30)  # checked against the plan the first engine's dtype made


def test_a_trainer_without_the_configs_mtp_layers_is_told_what_to_do(daemons):
    """transformers' DeepseekV3ForCausalLM builds no MTP layer; the config lists one: the step is refused
    with the setting to change, and the daemon keeps serving."""
    from sidecar.client import RefitClient
    from sidecar.errors import RefitError

    model = "deepseek_v3"
    cfg = {**config_of(model), "num_nextn_predict_layers": 1}
    g = torch.Generator().manual_seed(4)
    sd = {
        n: (torch.randn(s, generator=g) * 0.05).to(d)
        for n, s, d in get_model(model).parameters(cfg, include_mtp=False, experts=ExpertForm.FUSED)
    }
    d = daemons(hf_config=cfg, world_size=1, format="mxfp8")
    with RefitClient(d.endpoint, rank=0, world_size=1) as client:
        with pytest.raises(RefitError, match="set num_nextn_predict_layers") as err:
            client.push_step(0, sd)
        assert "model.layers.2." in str(err.value)
    d2 = daemons(
        hf_config={**cfg, "num_nextn_predict_layers": 0},
        world_size=1,
        format="mxfp8",
        runtime_dir=d.config.runtime_dir.parent / "run2",
    )
    with RefitClient(d2.endpoint, rank=0, world_size=1) as client:
        assert client.push_step(0, sd).step == 0


def _run_plan(plan, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every output of ``plan`` computed from ``tensors`` by run_unit into buffers from the plan (as
    the daemon writes a generation)."""
    from sidecar.plan.run import run_unit

    out = plan.allocate()
    for unit in plan.units:
        run_unit(unit, tensors, out)
    return out


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize(
    ("fmt", "first_bf16"),
    [("bf16", 0), ("mxfp8", 1), ("nvfp4", 1)],
    ids=["bf16", "mxfp8-first", "nvfp4-first"],
)
def test_experts_kept_bf16_take_the_fused_form(model, fmt, first_bf16):
    """issue 32 (3): ``--format bf16`` (and the first layers kept BF16 in any format) refused a
    transformers-5 trainer's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` ("not part of the
    plan": rebuild_for returned None) where the config lists per-expert names. The kept slab now
    publishes each expert's rows under its checkpoint name, byte for byte what the per-expert form
    publishes."""
    cfg = config_of(model)
    spec = RefitSpec(model_type=model, fmt=fmt, num_first_layers_in_bf16=first_bf16)
    plan = plan_from_hf_config(cfg, spec)
    sd = per_expert_state_dict(model, cfg, torch.bfloat16, seed=3)
    trainer = fused(model, cfg, sd)
    other = plan.rebuild_for([(n, t) for n, t in trainer.items()])
    assert other is not None
    assert [(o.name, o.dtype, o.shape) for o in other.outputs] == [
        (o.name, o.dtype, o.shape) for o in plan.outputs
    ]
    checkpoint = sd if all(i.name in sd for i in plan.inputs) else trainer  # the config's own form
    want = _run_plan(plan, checkpoint)
    got = _run_plan(other, trainer)
    bad = [n for n in want if not same_bytes(want[n], got[n])]
    assert not bad, bad[:5]


def test_a_bf16_daemon_takes_the_fused_form_for_an_engine_without_a_warning(daemons, caplog):
    """issue 32 (3), as a trainer meets it: ``refitd serve --format bf16`` planned from the config, an
    engine attached holding every expert in BF16 (its manifest), a transformers-5 trainer pushing the
    fused experts: the step is published with the per-expert bytes, and the daemon no longer warns
    that it will publish the engine's BF16 experts in BF16 (that was asked)."""
    import logging

    from adapters.base import RefitReader
    from sidecar.client import RefitClient
    from sidecar.plan.constraints import EngineKind
    from sidecar.protocol.manifest import Manifest, ManifestTensor

    model = "qwen3_moe"
    cfg = config_of(model)
    plan = plan_from_hf_config(cfg, RefitSpec(model_type=model, fmt="bf16"))
    manifest = Manifest(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format=plan.spec.format,
        tensors=tuple(ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs),
    )
    sd = per_expert_state_dict(model, cfg, torch.bfloat16, seed=5)
    d = daemons(hf_config=cfg, world_size=1, format="bf16")
    with (
        caplog.at_level(logging.WARNING),
        RefitReader(d.endpoint, name="engine-0", manifest=manifest) as engine,
        RefitClient(d.endpoint, rank=0, world_size=1) as client,
    ):
        engine.attach(timeout=30)
        client.push_step(0, fused(model, cfg, sd))
        gen = engine.wait(min_step=0)
        try:
            bad = [n for n, t in sd.items() if not same_bytes(gen.tensors[n], t)]
            assert sorted(gen.tensors) == sorted(sd)
        finally:
            engine.release(gen)
        assert not bad, bad[:5]
        with RefitReader(d.endpoint, name="engine-1", manifest=manifest) as late:
            late.attach(timeout=30)  # checked against the plan of the fused step: per-expert names
    assert not [r for r in caplog.records if "publishing them in BF16" in r.getMessage()]
