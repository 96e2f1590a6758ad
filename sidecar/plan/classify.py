"""Classifying a plan's inputs (a routed-expert slab, one expert's projection, anything else) and
checking the routed experts (SPEC §2.3): every problem found, in one error."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, FLOAT_DTYPES, INT4_GROUP, Format, FormatParams
from sidecar.plan.models import ModelSpec
from sidecar.plan.spec import ExpertProj, Layer, TensorSpec


@dataclass(frozen=True, slots=True)
class Routed:
    """A routed-expert input: a slab (``expert`` None) or one expert's projection."""

    spec: TensorSpec
    prefix: str
    proj: str  # gate_up_proj | down_proj | gate_proj | up_proj
    expert: int | None
    layer: Layer


def classify(inp: TensorSpec, model: ModelSpec, layer: Layer) -> Routed | None:
    if model.slab_re is not None and (m := model.slab_re.match(inp.name)):
        return Routed(inp, m.group("prefix"), m.group("proj"), None, layer)
    if m := model.per_expert_re.match(inp.name):
        expert = int(m.group("expert"))
        return Routed(inp, m.group("prefix"), m.group("proj"), expert, layer)
    return None


def check_slabs(slabs: dict[str, dict[str, Routed]], problems: list[str]) -> None:
    """SPEC §2.3: 3-D slabs, even 2I, and a layer's gate_up/down agreeing on E, H and I."""
    for prefix, pair in slabs.items():
        for r in pair.values():
            if len(r.spec.shape) != 3:
                problems.append(f"{r.spec.name}: shape {r.spec.shape} is not 3-D [E, rows, cols]")
        gu, down = pair.get("gate_up_proj"), pair.get("down_proj")
        if gu is None or down is None:
            have, lack = ("gate_up_proj", "down_proj") if down is None else ("down_proj", "gate_up_proj")
            problems.append(f"{prefix}.{have}: no partner slab {prefix}.{lack} in the inputs")
        if gu is not None and len(gu.spec.shape) == 3 and gu.spec.shape[1] % 2:
            problems.append(f"{gu.spec.name}: shape {gu.spec.shape} has an odd 2I = {gu.spec.shape[1]}")
        if gu is None or down is None or len(gu.spec.shape) != 3 or len(down.spec.shape) != 3:
            continue
        (e1, two_i, h1), (e2, h2, i2) = gu.spec.shape, down.spec.shape
        for what, a, b in (("E", e1, e2), ("H", h1, h2), ("I", two_i // 2, i2)):
            if a != b:
                problems.append(
                    f"{gu.spec.name} {gu.spec.shape} and {down.spec.name} {down.spec.shape} disagree "
                    f"on {what} ({a} vs {b})"
                )


def check_experts(experts: dict[tuple[str, int], dict[str, Routed]], problems: list[str]) -> None:
    """Per-expert gate/up ``[I, H]`` and down ``[H, I]``: all three present and consistent."""
    for (prefix, e), projs in experts.items():
        for r in projs.values():
            if len(r.spec.shape) != 2:
                problems.append(f"{r.spec.name}: shape {r.spec.shape} is not 2-D [out, in]")
        lacking = [p.value for p in ExpertProj if p.value not in projs]
        if lacking:
            problems.append(f"{prefix}.{e}: expert has no {', '.join(lacking)} in the inputs")
            continue
        gate, up, down = (projs[p.value].spec for p in ExpertProj)
        if any(len(s.shape) != 2 for s in (gate, up, down)):
            continue
        if gate.shape != up.shape:
            problems.append(f"{gate.name} {gate.shape} and {up.name} {up.shape} differ in shape")
        if down.shape != gate.shape[::-1]:
            problems.append(f"{down.name} {down.shape} is not the transpose of {gate.name} {gate.shape}")


def check_quantizable(
    t: TensorSpec, fmt: Format, problems: list[str], params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> None:
    if t.dtype not in FLOAT_DTYPES:
        problems.append(f"{t.name}: dtype {t.dtype} cannot be quantized (bf16/fp16/fp32 only)")
    # the input dim (K) each format's blocks need a multiple of (SPEC §1.2, §1.5-1.7); INT4's group
    # is the engine's (FormatParams.int4_group)
    multiple = params.k_multiple(fmt)
    if multiple is not None and t.shape and t.shape[-1] % multiple:
        what, fix = "", "keep it in bf16 (ignore_patterns) or use block_fp8"
        if fmt is Format.INT4_W4A16:
            what = " (the group size the engine holds)"
            if t.shape[-1] % INT4_GROUP == 0:
                fix = (
                    f"keep it in bf16 (ignore_patterns), or start the engine with a group_size that divides "
                    f"every K ({INT4_GROUP} divides {t.shape[-1]})"
                )
        problems.append(
            f"{t.name}: {fmt.value} needs the input dim to be a multiple of {multiple}{what}, got "
            f"{t.shape[-1]}; {fix}"
        )


def raise_problems(problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"{len(problems)} problem(s) in the refit inputs; fix the trainer export:\n{lines}")
