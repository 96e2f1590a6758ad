"""The plan a step runs under, fixed once every rank has begun it (sidecar.daemon.trainers).

Without a model config the first step's declarations fix the plan, as the attached engine workers'
manifests take them (:func:`plan_from_declarations`); with one, a step whose inputs are the plan's
outputs in another form (fused expert slabs, FP32 masters) gets the plan rebuilt for that form
(:func:`plan_in_trainer_form`). Either way the arenas are carved anew through ``adopt_plan``, and a
plan the arenas cannot hold, or that the inputs do not fit, fails the step with a RefitError that
says what to change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sidecar.daemon.memory.staging import ArenaTooSmall
from sidecar.daemon.memory.tiers import least_budget_for, staging_for
from sidecar.daemon.step import StepState
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.attach import check_manifest, with_engine_dtype, with_engine_params
from sidecar.plan.build import RefitPlan, layer_of_name
from transport.arena import ArenaKind

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.engines import EngineState

log = logging.getLogger("refitd.daemon")


def plan_in_trainer_form(ctx: LoopContext, state: StepState) -> None:
    """The plan for this step's inputs when they publish exactly the plan's outputs in another
    form (``RefitPlan.rebuild_for``): fused expert slabs where the config lists per-expert
    names, FP32 masters where it lists BF16. The generation's layout is unchanged (the live one
    stays valid); staging is carved anew. Anything else is left to validate_against to name."""
    plan = ctx.plan.rebuild_for(state.specs())
    if plan is None:
        _refuse_without_mtp(ctx.plan, state)
    if plan is None or plan is ctx.plan:
        return
    try:
        ctx.adopt_plan(plan)
    except ArenaTooSmall as exc:
        raise RefitError(_capacity_advice(ctx, plan, exc), kind=ErrorKind.CAPACITY, step=state.step) from None
    log.info("step %d: the plan follows the trainer's inputs (%d of them)", state.step, len(plan.inputs))


def _capacity_advice(ctx: LoopContext, plan: RefitPlan, exc: ArenaTooSmall) -> str:
    """What to change when the arenas cannot hold ``plan`` (the trainer's inputs in another form
    than the config's): the setting that binds on these arenas, with a value that works. On GPU
    arenas sized from ``device_budget`` (``staging_bytes`` unset) that is ``device_budget``: setting
    ``staging_bytes`` there would make ``refitd serve`` refuse to start."""
    why = (
        f"this step's inputs take {plan.bytes_in} bytes of staging, the checkpoint's {ctx.plan.bytes_in} "
        "(FP32 masters take twice BF16's)"
    )
    config, arenas = ctx.config, ctx.arenas
    sized_by_budget = (
        arenas.kind is ArenaKind.CUDA_IPC
        and config.staging_bytes is None
        and config.device_budget is not None
        and arenas.staging_regions
    )
    if not sized_by_budget:
        return f"{exc} ({why}); set staging_bytes to at least {plan.bytes_in}, or push the checkpoint's dtype"
    try:
        need = least_budget_for(
            ctx.plan,
            plan,
            regions=config.ring_regions,
            budget=config.device_budget,
            host_generations=config.host_generations,
            gpus=arenas.lanes,
        )
    except ArenaTooSmall:  # sized to the config's layers, no budget alone makes a region hold them
        try:
            staging, budget = staging_for(ctx.plan, plan, regions=config.ring_regions, gpus=arenas.lanes)
        except ArenaTooSmall as more:
            return f"the device rings cannot hold this step's inputs ({why}): {more}; push the checkpoint's dtype"
        return (
            f"the device rings, sized from device_budget = {config.device_budget} B to the config's layers, "
            f"cannot stage this step's inputs ({why}), whatever the budget: set staging_bytes to at least "
            f"{staging} B together with device_budget to at least {budget} B ({budget >> 20} MiB: the staging "
            "ring and a publish ring of its size), or push the checkpoint's dtype"
        )
    return (
        f"the device rings sized from device_budget = {config.device_budget} B cannot stage this step's inputs "
        f"({why}): raise device_budget to at least {need} B ({need >> 20} MiB) and leave staging_bytes "
        "unset, or push the checkpoint's dtype"
    )


def plan_from_declarations(ctx: LoopContext, engines: list[EngineState], state: StepState) -> None:
    """The plan fixed from the first step's declarations (no model config given): the attached
    engine workers (``engines``) must agree on the routed experts kept BF16 and on the format's
    parameters, and each one's manifest must take what the ranks declared."""
    keeps = {e.keep_bf16 for e in engines}
    if len(keeps) > 1:
        raise RefitError(
            f"the attached engine workers disagree on which routed experts are BF16: "
            f"{sorted(e.name for e in engines)}; every engine must agree on one plan",
            kind=ErrorKind.ENGINE,
            step=state.step,
        )
    # without the model's config, the first engine's manifest says the checkpoint's dtype
    spec = with_engine_dtype(ctx.spec, engines[0].manifest) if engines else ctx.spec
    # the engines' manifests decide the format's parameters (INT4 group and scale dtype, NVFP4 names)
    params = {with_engine_params(spec, e.manifest).params for e in engines}
    if len(params) > 1:
        raise RefitError(
            f"the attached engine workers hold {spec.format.value} with different parameters "
            f"({sorted(p.describe(spec.format) for p in params)}): "
            f"{sorted(e.name for e in engines)}; every engine must agree on one plan",
            kind=ErrorKind.ENGINE,
            step=state.step,
        )
    if engines:
        spec = with_engine_params(spec, engines[0].manifest)
    for e in engines:
        check = check_manifest(state.specs(), spec, e.manifest, share=ctx.config.share)
        if not check.ok:
            raise RefitError(
                check.message(f"engine worker {e.name!r}"), kind=ErrorKind.ENGINE, step=state.step
            )
    try:
        plan = RefitPlan.build(state.specs(), spec, keep_bf16=next(iter(keeps), ()), share=ctx.config.share)
        ctx.adopt_plan(plan)
    except ArenaTooSmall as exc:
        raise RefitError(str(exc), kind=ErrorKind.CAPACITY, step=state.step) from None
    except ValueError as exc:
        raise RefitError(str(exc), kind=ErrorKind.INVALID, step=state.step) from None
    log.info(
        "plan fixed from step %d: %d inputs, %d outputs, %d units (%d inputs outside this node's share)",
        state.step,
        len(plan.inputs),
        len(plan.outputs),
        len(plan.units),
        len(plan.dropped),
    )


def _refuse_without_mtp(plan: RefitPlan, state: StepState) -> None:
    """A step with no tensor of the MTP layers the config lists (transformers' DeepseekV3ForCausalLM
    and Glm4MoeForCausalLM build none, so a trainer on them has none to push): say so, and what to
    do, instead of listing every MTP tensor as missing."""
    mtp = [n for u in plan.units if isinstance(u.layer, tuple) for n in u.inputs]
    if not mtp:
        return
    layers = plan.num_hidden_layers
    sent = [
        n
        for n in state.tensors
        if isinstance(lay := layer_of_name(n), tuple) or (isinstance(lay, int) and lay >= layers)
    ]
    if sent:
        return
    raise RefitError(
        f"the config lists MTP layer(s) ({len(mtp)} tensors, e.g. {mtp[0]!r}) that no rank sent: a trainer "
        "on transformers' model classes has none (they build no MTP layer); set num_nextn_predict_layers "
        "(mtp_num_hidden_layers for Qwen3.5) to 0 in the config.json the daemon reads, or send the MTP weights",
        kind=ErrorKind.INVALID,
        step=state.step,
    )
