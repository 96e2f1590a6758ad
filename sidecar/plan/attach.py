"""The attach check: the daemon's plan against an engine's manifest, before the first step.

Two rules (docs/design.md, decision 2):

* the engine decides what is FP8: a routed expert the manifest holds in BF16 is published in BF16
  (``keep_bf16``), whatever the patterns say;
* everything else must agree exactly, or the attach is refused with every mismatch listed: a tensor
  the engine expects that the plan does not publish, a dtype or shape that differs, an expert format
  the engine's resolved MoE backend does not hold, a shape the backend's kernels cannot take.

Tensors the plan publishes that the engine does not list (an MTP head the engine does not run, a
vision tower) are reported as warnings: publishing them costs memory, not correctness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from sidecar.numerics.formats import FP8_DTYPE, MX_BLOCK, Format
from sidecar.plan.build import EngineLayout, ExpertProj, RefitPlan, RefitSpec, Role, TensorSpec
from sidecar.plan.models import get_model
from sidecar.protocol.manifest import Manifest

MAX_LISTED = 40


@dataclass(slots=True)
class AttachCheck:
    plan: RefitPlan | None
    keep_bf16: frozenset[str]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def message(self, who: str) -> str:
        shown = self.errors[:MAX_LISTED]
        more = len(self.errors) - len(shown)
        lines = [
            f"{who}: the engine's manifest does not match the refit plan ({len(self.errors)} mismatches):"
        ]
        lines += [f"  - {e}" for e in shown]
        if more:
            lines.append(f"  ... and {more} more")
        lines.append(
            "  fix: build the engine from the same RefitSpec the daemon runs (adapters.vllm.vllm_engine_args / "
            "adapters.trtllm.trtllm_llm_args), or change the daemon's format / BF16 exclusions"
        )
        return "\n".join(lines)


def engine_bf16_modules(manifest: Manifest, model_type: str) -> frozenset[str]:
    """Module names of the routed experts, and of the linears a block-FP8 checkpoint quantizes
    (``ModelSpec.linear_re``), that the engine holds unquantized (the manifest wins)."""
    model = get_model(model_type)
    keep = set()
    for t in manifest.tensors:
        if t.dtype in (torch.bfloat16, torch.float16, torch.float32) and (
            (model.slab_re is not None and model.slab_re.match(t.name))
            or model.per_expert_re.match(t.name)
            or (model.linear_re is not None and model.linear_re.match(t.name))
        ):
            keep.add(t.name.removesuffix(".weight"))
    return frozenset(keep)


def with_engine_dtype(spec: RefitSpec, manifest: Manifest) -> RefitSpec:
    """``spec`` with its checkpoint dtype (``RefitSpec.dtype``) taken from the engine's manifest when
    it has none (a daemon started without the model's config): the dtype the engine holds most of its
    unquantized tensors in, those the family keeps in FP32 (``ModelSpec.fp32_re``) not counted. So an
    FP32 master's passthroughs are published as the engine holds them. ``spec`` as is otherwise."""
    if spec.dtype is not None:
        return spec
    fp32 = spec.model.fp32_re
    counts = Counter(
        t.dtype
        for t in manifest.tensors
        if t.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not (fp32 is not None and fp32.search(t.name))
    )
    return replace(spec, dtype=counts.most_common(1)[0][0]) if counts else spec


def with_engine_params(spec: RefitSpec, manifest: Manifest) -> RefitSpec:
    """``spec`` with the format parameters the engine holds (the manifest decides, SPEC §1.7 and
    §2.3): INT4's group and scale dtype, NVFP4's names, those of ``spec``'s own format only (an engine
    holding another format is refused by :func:`check_manifest` for that)."""
    params = manifest.format_params.for_format(spec.format)
    return spec if params == spec.params else replace(spec, params=params)


def check_manifest(
    inputs: Iterable[TensorSpec],
    spec: RefitSpec,
    manifest: Manifest,
    *,
    share: tuple[EngineLayout, int] | None = None,
) -> AttachCheck:
    """Plan ``inputs`` under ``spec`` with the manifest's BF16 experts kept, and list every mismatch.

    ``share=(layout, node)``: the daemon publishes one node's share; ``inputs`` are then every input
    (``RefitPlan.source``), the other nodes' experts included, and the engine must expect no more
    than the share. The plan is made with the engine's format parameters (:func:`with_engine_params`):
    ``check.plan.spec.params`` may differ from ``spec.params``, and the daemon then re-plans."""
    keep = engine_bf16_modules(manifest, spec.model_type)
    spec = with_engine_params(spec, manifest)
    inputs = list(inputs)
    expected = manifest.by_name()
    try:
        plan = RefitPlan.build(inputs, spec, keep_bf16=keep, share=share)
        if any(o.name not in expected for o in plan.outputs):
            # slabs kept BF16 (a trainer's fused experts) that the engine takes per expert
            split = RefitPlan.build(inputs, spec, keep_bf16=keep, share=share, split_slabs=True)
            if sum(o.name not in expected for o in split.outputs) < sum(
                o.name not in expected for o in plan.outputs
            ):
                plan = split
    except ValueError as exc:
        return AttachCheck(None, keep, [f"the plan cannot be built with the engine's BF16 experts: {exc}"])
    check = AttachCheck(plan, keep)
    quantized = [o for o in plan.outputs if o.role is Role.WEIGHT]
    if quantized and manifest.expert_format is not spec.fmt:
        check.errors.append(
            f"the engine's routed experts are {manifest.expert_format.value} (MoE backend "
            f"{manifest.moe_backend or 'unknown'}) but the daemon publishes {spec.fmt.value}"
        )
    published = {o.name: o for o in plan.outputs}
    for name, t in expected.items():
        o = published.get(name)
        if o is None:
            check.errors.append(
                f"{name}: the engine expects {_describe(t.dtype, t.shape)}, the plan does not publish it"
            )
        elif (
            o.role is Role.PASSTHROUGH
            and FP8_DTYPE not in (o.dtype, t.dtype)
            and o.dtype != t.dtype
            and tuple(o.shape) == tuple(t.shape)
        ):
            check.errors.append(
                f"{name}: the engine holds {_describe(t.dtype, t.shape)}, the plan publishes "
                f"{_describe(o.dtype, o.shape)}; a passthrough is published in the checkpoint's dtype (the "
                "config's dtype, RefitSpec.dtype) or, with none, in its input's: give the daemon the model's "
                f"config.json, or send it as {str(t.dtype).removeprefix('torch.')} from the trainer"
            )
        elif o.dtype != t.dtype or tuple(o.shape) != tuple(t.shape):
            hint = ""
            if o.dtype == FP8_DTYPE and t.dtype != FP8_DTYPE:
                hint = " (the checkpoint's scheme quantizes it: set quantize_linears = False, or ignore it)"
            elif t.dtype == FP8_DTYPE and o.dtype != FP8_DTYPE:
                hint = (
                    " (the engine runs it in FP8: plan from the checkpoint's config, or set quantize_linears)"
                )
            check.errors.append(
                f"{name}: the engine holds {_describe(t.dtype, t.shape)}, the plan publishes "
                f"{_describe(o.dtype, o.shape)}{hint}"
            )
    extra = [n for n in published if n not in expected]
    if extra:
        check.warnings.append(
            f"{len(extra)} published tensors are not in the engine's manifest (e.g. {extra[:3]}); they are "
            "published anyway"
        )
    check.errors += constraint_problems(plan, manifest)
    return check


def constraint_problems(plan: RefitPlan, manifest: Manifest) -> list[str]:
    """What the engine's resolved backend cannot take: the adapter's :class:`EngineConstraints`
    (``manifest.constraints``) run against the expert dims of the daemon's own plan, so the daemon
    refuses what the adapter's check refuses even when an adapter skipped it."""
    fmt = plan.spec.format
    # routed experts only (``proj`` set): a block-FP8 linear (DeepSeek-V3's kv_a_proj_with_mqa, 576 rows)
    # is not an MoE kernel's operand and takes ragged blocks
    weights = [o for o in plan.outputs if o.role is Role.WEIGHT and o.proj is not None]
    problems = []
    if weights:
        # the engine holds the format the plan publishes (a mismatch is reported above); check that one
        c = replace(manifest.constraints, expert_format=fmt)
        dims: dict[tuple[int, int], str] = {}
        for o in weights:
            out_dim, in_dim = o.shape[-2], o.shape[-1]
            # the intermediate dim is what tensor parallelism splits: rows of gate/up, columns of down
            h, i = (out_dim, in_dim) if o.proj is ExpertProj.DOWN else (in_dim, out_dim)
            dims.setdefault((h, i), o.name)
        for (h, i), example in list(dims.items())[:MAX_LISTED]:
            problems += [
                f"{example}: {p} (MoE backend {manifest.moe_backend or 'unknown'})"
                for p in c.problems(hidden=h, intermediate=i)
            ]
    if fmt is Format.MXFP8 and any(o.shape[-1] % MX_BLOCK for o in weights):
        problems.append(f"mxfp8 needs every expert's in dim to be a multiple of {MX_BLOCK}")
    return problems


def _describe(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"
