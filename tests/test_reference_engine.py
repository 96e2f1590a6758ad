"""The pure-torch reference engine: its manifest, exact loading, and what FP8 refit does to its logits.

One tiny Qwen3.5 MoE (4 layers, one full-attention, 8 experts, unaligned sizes so block-FP8 tiles
are ragged, one MTP layer) is converted by ``sidecar.plan.run.convert`` into each format and loaded the
way an engine loads a published generation.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from adapters.reference import MOE_BACKEND, ReferenceEngine, next_token_kl, sample_inputs
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.numerics import reference as quant
from sidecar.numerics.formats import BLOCK, FP8_DTYPE, Format
from sidecar.plan.build import RefitSpec, plan_from_hf_config
from sidecar.plan.models import SLAB_RE
from sidecar.plan.run import convert
from sidecar.protocol.manifest import EngineKind, Manifest

MODEL = "qwen3_5_moe"
SIZES = {"num_layers": 4, "num_experts": 8, "unaligned": True}
CONFIG = make_hf_config(MODEL, **SIZES)
LAYERS = CONFIG["text_config"]["num_hidden_layers"]
ROOT = "model.language_model"
FORMATS = [f.value for f in Format]
QUANTIZED = [f.value for f in Format if f.quantized]
#: a loose ceiling on the mean next-token KL(BF16 ‖ FP8), seed 0. Measured: block_fp8 4.4e-5,
#: mxfp8 2.3e-4, fp8_per_tensor 1.2e-4 (main head; the MTP head about half of that)
KL_BOUND = 0.05


def experts(layer: int | str) -> str:
    return (
        f"mtp.layers.{layer[4:]}.mlp.experts"
        if isinstance(layer, str)
        else f"{ROOT}.layers.{layer}.mlp.experts"
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal is not implemented for fp8)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def signature(named) -> dict:
    items = named.items() if isinstance(named, dict) else ((t.name, t) for t in named)
    return {n: (t.dtype, tuple(t.shape)) for n, t in items}


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return make_state_dict(MODEL, **SIZES)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return sample_inputs(CONFIG["text_config"]["vocab_size"])


@pytest.fixture(scope="module")
def published(state):
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(fmt: str) -> dict[str, torch.Tensor]:
        if fmt not in cache:
            cache[fmt] = convert(state, RefitSpec(model_type=MODEL, fmt=fmt))
        return cache[fmt]

    return get


@pytest.fixture(scope="module")
def baseline(state, ids):
    """The BF16 engine loaded from the original state dict, and its logits (main and MTP heads)."""
    engine = ReferenceEngine.from_config(CONFIG, expert_format="bf16")
    engine.load_bf16(state)
    return engine, engine.forward(ids), engine.forward_mtp(ids)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest, and immune to a busy machine's oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def loaded(fmt: str, tensors: dict[str, torch.Tensor]) -> ReferenceEngine:
    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt)
    engine.load(tensors)
    return engine


# --------------------------------------------------------------------------------------------------
# the manifest


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_is_what_convert_publishes(fmt, published):
    """An engine built from the config alone expects exactly the names, dtypes and shapes that
    convert() publishes for its format, and the config-only plan agrees."""
    manifest = ReferenceEngine.from_config(CONFIG, expert_format=fmt).manifest(version="test-1")
    assert signature(manifest.tensors) == signature(published(fmt))
    plan = plan_from_hf_config(CONFIG, RefitSpec(model_type=MODEL, fmt=fmt))
    assert signature(manifest.tensors) == {o.name: (o.dtype, o.shape) for o in plan.outputs}
    assert manifest.engine is EngineKind.REFERENCE
    assert manifest.engine_version == "test-1"
    assert manifest.moe_backend == MOE_BACKEND
    assert manifest.expert_format is Format(fmt)
    assert Manifest.from_wire(manifest.to_wire()).tensors == manifest.tensors


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_bf16_layers_match_the_refit_spec_and_the_manifest_wins(fmt, state):
    """Holding the first and last layers' experts in BF16 gives the manifest RefitSpec's first/last
    exclusions publish; and the BF16 slabs a manifest lists, handed to the plan as keep_bf16, make the
    daemon publish exactly that manifest (the MTP layer's experts included)."""
    first_last = [experts(0), experts(LAYERS - 1)]
    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt, keep_bf16=first_last)
    spec = RefitSpec(model_type=MODEL, fmt=fmt, num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)
    assert signature(engine.manifest().tensors) == signature(convert(state, spec))

    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt, keep_bf16=[experts(1), experts("mtp.0")])
    manifest = engine.manifest()
    slabs = [t.name for t in manifest.tensors if SLAB_RE.match(t.name)]
    assert len(slabs) == 4 and all(manifest.by_name()[s].dtype == torch.bfloat16 for s in slabs)
    published = convert(state, RefitSpec(model_type=MODEL, fmt=fmt), keep_bf16=slabs)
    assert signature(manifest.tensors) == signature(published)
    engine.load(published)  # and it loads


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_other_shapes_load_and_run(fmt, ids):
    """Aligned sizes, eight layers (two of them full attention) and no MTP: the manifest is still
    what convert() publishes, the generation loads and runs, and there is no MTP head to ask for."""
    sizes = {"num_layers": 8, "num_experts": 4, "mtp_layers": 0}
    state = make_state_dict(MODEL, **sizes)
    engine = ReferenceEngine.from_config(make_hf_config(MODEL, **sizes), expert_format=fmt)
    out = convert(state, RefitSpec(model_type=MODEL, fmt=fmt))
    assert signature(engine.manifest().tensors) == signature(out)
    engine.load(out)
    assert torch.isfinite(engine.forward(ids)).all()
    with pytest.raises(ValueError, match="no MTP layers"):
        engine.forward_mtp(ids)


def test_keep_bf16_must_name_experts_modules():
    with pytest.raises(ValueError, match=r"keep_bf16 names no routed-experts module.*gate_up_proj"):
        ReferenceEngine.from_config(CONFIG, keep_bf16=[f"{experts(0)}.gate_up_proj"])
    with pytest.raises(ValueError, match="runs qwen3_5_moe only"):
        ReferenceEngine.from_config(make_hf_config("qwen3_moe"))


# --------------------------------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_load_is_exact(fmt, published):
    """After a load the fused w13/w2 bytes (and their scales, in the documented layout) are the
    published per-expert bytes: gate in rows [0, I), up in rows [I, 2I); so are the other fused
    parameters' rows and every parameter held as is."""
    out = published(fmt)
    engine = loaded(fmt, out)
    p, suffix = engine.params, Format(fmt).scale_suffix
    inter = CONFIG["text_config"]["moe_intermediate_size"]
    nb = -(-inter // BLOCK)
    for module in engine.experts_modules:
        w13, w2 = p[f"{module}.w13_weight"], p[f"{module}.w2_weight"]
        s13, s2 = p[f"{module}.w13_{suffix}"], p[f"{module}.w2_{suffix}"]
        assert w13.dtype == w2.dtype == FP8_DTYPE
        for e in range(SIZES["num_experts"]):
            x = f"{module}.{e}"
            assert same_bytes(w13[e, :inter], out[f"{x}.gate_proj.weight"])
            assert same_bytes(w13[e, inter:], out[f"{x}.up_proj.weight"])
            assert same_bytes(w2[e], out[f"{x}.down_proj.weight"])
            gate_s, up_s = {
                "block_fp8": (s13[e, :nb], s13[e, nb:]),
                "mxfp8": (s13[e, :inter], s13[e, inter:]),
                "fp8_per_tensor": (s13[e, 0], s13[e, 1]),
            }[fmt]
            assert same_bytes(gate_s, out[f"{x}.gate_proj.{suffix}"])
            assert same_bytes(up_s, out[f"{x}.up_proj.{suffix}"])
            assert same_bytes(s2[e], out[f"{x}.down_proj.{suffix}"])
    full, linear = f"{ROOT}.layers.3", f"{ROOT}.layers.0"
    fused = {
        f"{full}.self_attn.qkv_proj.weight": [f"{full}.self_attn.{n}_proj.weight" for n in "qkv"],
        f"{linear}.linear_attn.in_proj_qkvz.weight": [
            f"{linear}.linear_attn.in_proj_{n}.weight" for n in ("qkv", "z")
        ],
        f"{linear}.linear_attn.in_proj_ba.weight": [f"{linear}.linear_attn.in_proj_{n}.weight" for n in "ba"],
        f"{full}.mlp.shared_expert.gate_up_proj.weight": [
            f"{full}.mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up")
        ],
    }
    for param, names in fused.items():
        assert same_bytes(p[param], torch.cat([out[n] for n in names]))
    as_is = [n for n in out if n in p]
    assert len(as_is) > 50
    assert all(same_bytes(p[n], out[n]) for n in as_is)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_forward_uses_the_spec_dequantization(fmt, published):
    """The float32 expert weights the forward pass multiplies by are SPEC §1's dequantization of
    each published projection under its own scale, exactly."""
    out = published(fmt)
    engine = loaded(fmt, out)
    suffix, inter = Format(fmt).scale_suffix, CONFIG["text_config"]["moe_intermediate_size"]
    for module in (experts(0), experts(3), experts("mtp.0")):
        w13, w2 = engine.compute_weight(f"{module}.w13_weight"), engine.compute_weight(f"{module}.w2_weight")
        for e in range(SIZES["num_experts"]):

            def deq(proj, x=f"{module}.{e}"):
                return quant.dequantize(out[f"{x}.{proj}.weight"], out[f"{x}.{proj}.{suffix}"], fmt)

            assert torch.equal(w13[e, :inter], deq("gate_proj"))
            assert torch.equal(w13[e, inter:], deq("up_proj"))
            assert torch.equal(w2[e], deq("down_proj"))


def test_load_lists_every_problem_and_copies_nothing(published, baseline, ids):
    """Missing, unknown, duplicated and misshapen tensors are all named in one error, and a refused
    load leaves the engine as it was."""
    engine, base_logits, _ = baseline
    good = published("bf16")
    bad = dict(good)
    del bad[f"{ROOT}.norm.weight"], bad["mtp.fc.weight"]
    bad["model.visual.merger.norm.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    bad["lm_head.weight"] = good["lm_head.weight"].float()
    bad[f"{experts(1)}.down_proj"] = good[f"{experts(1)}.down_proj"][:, :, :32]
    pairs = [*bad.items(), ("mtp.norm.weight", good["mtp.norm.weight"])]
    with pytest.raises(ValueError) as err:
        engine.load(pairs)
    msg = str(err.value)
    for fragment in (
        "1 sent more than once: ['mtp.norm.weight']",
        f"2 missing: ['{ROOT}.norm.weight', 'mtp.fc.weight']",
        "1 not expected by this engine: ['model.visual.merger.norm.weight']",
        "lm_head.weight: got torch.float32",
        f"{experts(1)}.down_proj: got torch.bfloat16 (8, 160, 32), expected torch.bfloat16 (8, 160, 96)",
    ):
        assert fragment in msg
    with pytest.raises(ValueError, match="missing"):
        ReferenceEngine.from_config(CONFIG, expert_format="block_fp8").load(good)  # slabs, not experts
    assert torch.equal(engine.forward(ids), base_logits)


def test_load_reads_read_only_memory_and_keeps_nothing(tmp_path, published, ids):
    """A generation in read-only mapped memory (as a reader's shared-memory views are) loads: a write
    into it would fault. The engine copies out, so what it computes does not change afterwards."""
    out = published("block_fp8")
    path = tmp_path / "generation.bin"
    offsets, offset = {}, 0
    with path.open("wb") as f:
        for name, t in out.items():
            raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            f.write(raw)
            offsets[name] = (offset, len(raw))
            offset += len(raw)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert not mapped.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about non-writable arrays
        views = {
            n: torch.from_numpy(mapped[o : o + size]).view(out[n].dtype).reshape(out[n].shape)
            for n, (o, size) in offsets.items()
        }
    engine = loaded("block_fp8", views)
    logits = engine.forward(ids)
    assert torch.equal(logits, loaded("block_fp8", out).forward(ids))
    clones = {n: t.clone() for n, t in out.items()}
    engine.load(clones)
    for t in clones.values():
        t.view(torch.uint8).fill_(0)
    assert torch.equal(engine.forward(ids), logits)
    del views, mapped


def test_load_bf16_needs_a_bf16_engine(state):
    with pytest.raises(ValueError, match="expert_format='bf16'"):
        ReferenceEngine.from_config(CONFIG, expert_format="mxfp8").load_bf16(state)


# --------------------------------------------------------------------------------------------------
# what FP8 does to the outputs


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_logits_stay_close_to_bf16(fmt, published, baseline, ids):
    """The engine loaded from each format's generation predicts nearly what the BF16 model does; in
    bf16 the published tensors are the checkpoint's, and the logits are identical."""
    _, base_logits, base_mtp = baseline
    engine = loaded(fmt, published(fmt))
    logits, mtp = engine.forward(ids), engine.forward_mtp(ids)
    assert logits.dtype == torch.float32 and logits.shape == (*ids.shape, CONFIG["text_config"]["vocab_size"])
    if fmt == "bf16":
        assert torch.equal(logits, base_logits) and torch.equal(mtp, base_mtp)
        return
    kl, kl_mtp = next_token_kl(base_logits, logits), next_token_kl(base_mtp, mtp)
    print(f"{fmt}: next-token KL(bf16 || {fmt}) = {kl:.3g}, MTP head {kl_mtp:.3g}")
    assert 0 < kl < KL_BOUND and 0 < kl_mtp < KL_BOUND
    assert torch.equal(engine.forward(ids), logits)  # deterministic


_EXPERT_RE = re.compile(r"(?:layers\.(\d+)|mtp\.layers\.\d+)\.mlp\.experts\.(\d+)\.")


def _expert_kinds(names: list[str]) -> list[str]:
    """One routed-expert tensor of each kind (decoder or MTP layer; gate, up or down; weight or
    scale): the rest of a generation does not depend on the format."""
    kinds = {re.sub(r"\d+", "#", n): n for n in names if _EXPERT_RE.search(n)}
    return list(kinds.values())


def _wide_sample(names: list[str]) -> list[str]:
    """Every tensor but the routed experts'; every expert of layer 1; in each other layer (MTP too)
    every tensor of one expert, a different one per layer."""
    out = []
    for n in names:
        m = _EXPERT_RE.search(n)
        if m is None or m.group(1) == "1":
            out.append(n)
        else:
            layer = int(m.group(1)) if m.group(1) else LAYERS
            out += [n] if int(m.group(2)) == (3 * layer) % SIZES["num_experts"] else []
    return out


def _perturbed(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A clearly different tensor of the same dtype and shape."""
    if t.dtype == FP8_DTYPE:
        return (t.view(torch.uint8) ^ 0x80).view(FP8_DTYPE)  # flip every sign
    if t.dtype == torch.uint8:  # E8M0 scale bytes: double or halve
        return torch.where(t < 254, t + 1, t - 1)
    if t.dtype == torch.float32:  # scales
        return t * 2
    return (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)


@pytest.mark.parametrize(
    ("fmt", "sample"),
    [("block_fp8", _wide_sample), ("mxfp8", _expert_kinds), ("fp8_per_tensor", _expert_kinds)],
)
def test_every_published_tensor_changes_the_outputs(fmt, sample, published, ids):
    """Perturbing any one published tensor changes the main logits (or, for an MTP tensor, the MTP
    logits and not the main ones): no tensor is loaded and then ignored. block_fp8 tries every tensor
    that is not a routed expert's and a wide sample of those; the other formats one routed-expert
    tensor of each kind."""
    out = published(fmt)
    engine = loaded(fmt, out)
    base, base_mtp = engine.forward(ids), engine.forward_mtp(ids)
    names = sample(list(out))
    gen = torch.Generator().manual_seed(0)
    unused = []
    for name in names:
        engine.load({**out, name: _perturbed(out[name], gen)})
        if name.startswith("mtp."):
            changed = not torch.equal(engine.forward_mtp(ids), base_mtp) and torch.equal(
                engine.forward(ids), base
            )
        else:
            changed = not torch.equal(engine.forward(ids), base)
        if not changed:
            unused.append(name)
    assert not unused, f"perturbing these changed nothing (or the wrong head): {unused}"


# --------------------------------------------------------------------------------------------------
# helpers and input checks


def test_helpers_are_deterministic_and_kl_is_a_divergence():
    a, b = sample_inputs(50, batch=2, seq=5, seed=3), sample_inputs(50, batch=2, seq=5, seed=3)
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (2, 5) and int(a.max()) < 50
    assert not torch.equal(a, sample_inputs(50, batch=2, seq=5, seed=4))
    p = torch.tensor([[[0.0, 1.0, 2.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    pp, qq = p.double().softmax(-1), q.double().softmax(-1)
    assert next_token_kl(p, p) == 0.0
    assert next_token_kl(p, q) == pytest.approx(float((pp * (pp / qq).log()).sum()), rel=1e-12)
    with pytest.raises(ValueError, match="differ in shape"):
        next_token_kl(p, q[..., :2])


def test_forward_checks_its_input(baseline):
    engine, _, _ = baseline
    with pytest.raises(ValueError, match=r"lie in \[0, 256\)"):
        engine.forward(torch.tensor([[0, 256]]))
    with pytest.raises(ValueError, match="integer tensor"):
        engine.forward(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="no weights loaded"):
        ReferenceEngine.from_config(CONFIG).forward(torch.zeros(1, 2, dtype=torch.int64))


# ---- DeepSeek-V3: MLA, the sigmoid router with its FP32 bias, block-FP8 linears, MTP

DSV3_SIZES = {"num_layers": 3, "num_experts": 4}
DSV3_CONFIG = make_hf_config("deepseek_v3", **DSV3_SIZES)


@pytest.fixture(scope="module")
def dsv3_state() -> dict[str, torch.Tensor]:
    return make_state_dict("deepseek_v3", **DSV3_SIZES)


@pytest.fixture(scope="module")
def dsv3_baseline(dsv3_state):
    engine = ReferenceEngine.from_config(DSV3_CONFIG, expert_format="bf16")
    engine.load_bf16(dsv3_state)
    return engine


@pytest.mark.parametrize("fmt", FORMATS)
def test_deepseek_v3_manifest_equals_the_plan_and_fp8_stays_close(fmt, dsv3_state, dsv3_baseline):
    """The engine's own manifest (written from its modules, as vLLM builds them) equals what the
    daemon plans from the config, in every format; loaded, its logits and MTP logits stay close."""
    from sidecar.plan.attach import check_manifest

    engine = ReferenceEngine.from_config(DSV3_CONFIG, expert_format=fmt)
    plan = plan_from_hf_config(DSV3_CONFIG, RefitSpec(model_type="deepseek_v3", fmt=fmt))
    assert signature(engine.manifest().tensors) == {o.name: (o.dtype, tuple(o.shape)) for o in plan.outputs}
    check = check_manifest(plan.inputs, plan.spec, engine.manifest())
    assert check.ok, check.errors
    engine.load(convert(dsv3_state, plan.spec))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert engine.params[bias].dtype is torch.float32 and same_bytes(engine.params[bias], dsv3_state[bias])
    ids = sample_inputs(engine.vocab_size, batch=2, seq=16)
    assert next_token_kl(dsv3_baseline.forward(ids), engine.forward(ids)) < KL_BOUND
    assert next_token_kl(dsv3_baseline.forward_mtp(ids), engine.forward_mtp(ids)) < KL_BOUND
    if fmt != "bf16":
        assert engine.params["model.layers.0.self_attn.kv_b_proj.weight"].dtype is FP8_DTYPE


def test_deepseek_v3_every_published_tensor_changes_the_logits(dsv3_state, dsv3_baseline):
    """MLA uses every projection and norm; the router bias changes which experts are picked; the MTP
    layer's own embedding and head copies feed forward_mtp: perturbing any one tensor moves the logits."""
    ids = sample_inputs(dsv3_baseline.vocab_size, batch=2, seq=16)
    base = (dsv3_baseline.forward(ids), dsv3_baseline.forward_mtp(ids))
    engine = ReferenceEngine.from_config(DSV3_CONFIG, expert_format="bf16")
    unused = []
    for name in dsv3_state:
        perturbed = dict(dsv3_state)
        t = dsv3_state[name]
        if name.endswith("e_score_correction_bias"):  # raise one expert's bias: it wins every token
            perturbed[name] = t.clone()
            perturbed[name][0] += 10.0
        else:
            perturbed[name] = (t.float() + 0.3).to(t.dtype)
        engine.load_bf16(perturbed)
        out = (engine.forward(ids), engine.forward_mtp(ids))
        if all(torch.equal(a, b) for a, b in zip(base, out, strict=True)):
            unused.append(name)
    assert not unused
