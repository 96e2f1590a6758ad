"""Routed-expert names (SPEC §2.1) and the two forms a state dict holds them in: one tensor per expert
and projection, or grouped slabs; :func:`with_expert_form` turns a listing from one into the other."""

from __future__ import annotations

import enum
import re

from sidecar.plan.models.params import Param, _mlp

#: SPEC §2.1, verbatim: group 1 is a decoder layer index, group 2 an MTP layer index.
EXPERT_PREFIX = r"(?:(?:model\.)?(?:language_model\.)?layers\.(\d+)|mtp\.layers\.(\d+))\.mlp\.experts"
#: grouped slabs ``{prefix}.gate_up_proj [E, 2I, H]`` / ``{prefix}.down_proj [E, H, I]`` (no ``.weight``)
SLAB_RE = re.compile(rf"^(?P<prefix>{EXPERT_PREFIX})\.(?P<proj>gate_up_proj|down_proj)$")
#: one expert's projection ``{prefix}.{e}.{gate_proj|up_proj|down_proj}.weight``
PER_EXPERT_RE = re.compile(
    rf"^(?P<prefix>{EXPERT_PREFIX})\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class ExpertForm(str, enum.Enum):
    """How a state dict holds the routed experts of a layer (SPEC §2.1)."""

    #: one tensor per expert and projection: ``{prefix}.{e}.{gate,up,down}_proj.weight`` (checkpoints,
    #: ``save_pretrained``, transformers 4.x modules)
    PER_EXPERT = "per_expert"
    #: grouped slabs ``{prefix}.gate_up_proj [E, 2I, H]`` and ``{prefix}.down_proj [E, H, I]``
    #: (transformers 5.x run-time modules; Qwen3.5 checkpoints)
    FUSED = "fused"


def with_expert_form(params: list[Param], form: ExpertForm | str) -> list[Param]:
    """``params`` with every layer's routed experts in ``form``: each layer's group where its first
    expert tensor was, everything else as it was. The same outputs publish from either form."""
    form = ExpertForm(form)
    out: list[Param] = []
    done: set[str] = set()
    by_prefix: dict[str, list[Param]] = {}
    for p in params:
        m = SLAB_RE.match(p[0]) or PER_EXPERT_RE.match(p[0])
        if m:
            by_prefix.setdefault(m.group("prefix"), []).append(p)
    for name, shape, dtype in params:
        m = SLAB_RE.match(name) or PER_EXPERT_RE.match(name)
        if m is None:
            out.append((name, shape, dtype))
            continue
        prefix = m.group("prefix")
        if prefix in done:
            continue
        done.add(prefix)
        out += _experts_in_form(prefix, by_prefix[prefix], form)
    return out


def _experts_in_form(prefix: str, group: list[Param], form: ExpertForm) -> list[Param]:
    slabs = {SLAB_RE.match(n).group("proj"): (s, d) for n, s, d in group if SLAB_RE.match(n)}
    if slabs:
        (e, two_i, h), dtype = slabs["gate_up_proj"]
        inter = two_i // 2
    else:
        experts = {int(PER_EXPERT_RE.match(n).group("expert")) for n, _, _ in group}
        gate = next((s, d) for n, s, d in group if n.endswith(".gate_proj.weight"))
        (inter, h), dtype, e = gate[0], gate[1], max(experts) + 1
    if form is ExpertForm.FUSED:
        return [
            (f"{prefix}.gate_up_proj", (e, 2 * inter, h), dtype),
            (f"{prefix}.down_proj", (e, h, inter), dtype),
        ]
    return [p for x in range(e) for p in _mlp(f"{prefix}.{x}", h, inter, dtype)]
