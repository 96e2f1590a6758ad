"""The reference engine's parts: its fused parameters (one builder per model family's layers) and the
small numerics its forward pass shares with :mod:`adapters.reference.mla` (RMSNorm, partial RoPE,
dequantizing rows of an FP8 expert)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.numerics.formats import (
    BLOCK,
    DEFAULT_FORMAT_PARAMS,
    FP8_DTYPE,
    MX_BLOCK,
    Format,
    FormatParams,
    Nvfp4Names,
)
from sidecar.numerics.reference import dequantize

BF16 = torch.bfloat16
SUPPORTED_MODEL = "qwen3_5_moe"
#: Qwen3.5 defaults for settings the synthetic configs leave out
DEFAULT_RMS_EPS = 1e-6
DEFAULT_ROPE_THETA = 10_000_000.0
DEFAULT_PARTIAL_ROTARY = 0.25


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one checkpoint tensor lands: ``params[param][index]``, of this dtype and shape."""

    name: str
    param: str
    index: tuple[int | slice, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Experts:
    """One fused routed-experts module: its checkpoint prefix and the format its weights are held in."""

    prefix: str  # e.g. model.language_model.layers.0.mlp.experts
    fmt: Format  # Format.BF16 when held in BF16
    inter: int


@dataclass(frozen=True, slots=True, kw_only=True)
class _Dims:
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    experts: int
    top_k: int
    inter: int
    shared_inter: int
    eps: float
    rope_theta: float
    rotary_dim: int
    norm_topk: bool
    tied: bool

    @classmethod
    def from_text_config(cls, text: Mapping[str, Any], tied: bool) -> _Dims:
        try:
            return cls._read(text, tied)
        except KeyError as exc:
            raise ValueError(
                f"{SUPPORTED_MODEL} config has no {exc}; pass the model's full config.json"
            ) from None

    @classmethod
    def _read(cls, text: Mapping[str, Any], tied: bool) -> _Dims:
        rope = text.get("rope_parameters") or {}
        head_dim = int(text["head_dim"])
        partial = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
        )
        rotary = int(head_dim * partial) // 2 * 2
        return cls(
            hidden=int(text["hidden_size"]),
            vocab=int(text["vocab_size"]),
            heads=int(text["num_attention_heads"]),
            kv_heads=int(text["num_key_value_heads"]),
            head_dim=head_dim,
            lin_k_heads=int(text["linear_num_key_heads"]),
            lin_v_heads=int(text["linear_num_value_heads"]),
            lin_k_dim=int(text["linear_key_head_dim"]),
            lin_v_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text["linear_conv_kernel_dim"]),
            experts=int(text["num_experts"]),
            top_k=int(text["num_experts_per_tok"]),
            inter=int(text["moe_intermediate_size"]),
            shared_inter=int(text["shared_expert_intermediate_size"]),
            eps=float(text.get("rms_norm_eps", DEFAULT_RMS_EPS)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", DEFAULT_ROPE_THETA))),
            rotary_dim=rotary,
            norm_topk=bool(text.get("norm_topk_prob", True)),
            tied=tied,
        )


# --------------------------------------------------------------------------------------------------
# building the parameters and the name map


class _Builder:
    """Allocates the engine's parameters and records which checkpoint name fills which view."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.slots: list[_Slot] = []

    def param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = BF16) -> str:
        self.params[name] = torch.zeros(shape, dtype=dtype)
        return name

    def slot(self, name: str, param: str, *index: int | slice) -> None:
        view = self.params[param][index]
        self.slots.append(_Slot(name, param, index, view.dtype, tuple(view.shape)))

    def whole(self, name: str, shape: tuple[int, ...]) -> None:
        """A checkpoint tensor the engine holds as is (its own parameter, same name)."""
        self.slot(name, self.param(name, shape))

    def fused(self, param: str, parts: list[tuple[str, int]], cols: int) -> None:
        """A parameter whose rows are several checkpoint tensors stacked: ``[(name, rows), ...]``."""
        self.param(param, (sum(rows for _, rows in parts), cols))
        start = 0
        for name, rows in parts:
            self.slot(name, param, slice(start, start + rows))
            start += rows


def _full_attention(b: _Builder, p: str, d: _Dims) -> None:
    q, kv = 2 * d.heads * d.head_dim, d.kv_heads * d.head_dim  # q_proj: query and output gate
    parts = [(f"{p}.self_attn.{n}_proj.weight", rows) for n, rows in (("q", q), ("k", kv), ("v", kv))]
    b.fused(f"{p}.self_attn.qkv_proj.weight", parts, d.hidden)
    b.whole(f"{p}.self_attn.o_proj.weight", (d.hidden, d.heads * d.head_dim))
    b.whole(f"{p}.self_attn.q_norm.weight", (d.head_dim,))
    b.whole(f"{p}.self_attn.k_norm.weight", (d.head_dim,))


def _linear_attention(b: _Builder, p: str, d: _Dims) -> None:
    a = f"{p}.linear_attn"
    key, value, heads = d.lin_k_heads * d.lin_k_dim, d.lin_v_heads * d.lin_v_dim, d.lin_v_heads
    conv = 2 * key + value
    b.fused(
        f"{a}.in_proj_qkvz.weight",
        [(f"{a}.in_proj_qkv.weight", conv), (f"{a}.in_proj_z.weight", value)],
        d.hidden,
    )
    b.fused(
        f"{a}.in_proj_ba.weight",
        [(f"{a}.in_proj_b.weight", heads), (f"{a}.in_proj_a.weight", heads)],
        d.hidden,
    )
    b.whole(f"{a}.conv1d.weight", (conv, 1, d.conv_kernel))
    b.whole(f"{a}.A_log", (heads,))
    b.whole(f"{a}.dt_bias", (heads,))
    b.whole(f"{a}.norm.weight", (d.lin_v_dim,))
    b.whole(f"{a}.out_proj.weight", (d.hidden, value))


def _routed_experts(
    b: _Builder, prefix: str, d: _Dims, fmt: Format, params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> _Experts:
    """``w13``/``w2`` (and their scales) of one MoE layer; per-expert slots, or the slabs if BF16."""
    e, i, h = d.experts, d.inter, d.hidden
    w13, w2 = f"{prefix}.w13_weight", f"{prefix}.w2_weight"
    if fmt is Format.BF16:
        b.slot(f"{prefix}.gate_up_proj", b.param(w13, (e, 2 * i, h)))
        b.slot(f"{prefix}.down_proj", b.param(w2, (e, h, i)))
        return _Experts(prefix, fmt, i)
    if fmt.four_bit:
        return _four_bit_experts(b, prefix, d, fmt, params)
    b.param(w13, (e, 2 * i, h), FP8_DTYPE)
    b.param(w2, (e, h, i), FP8_DTYPE)
    s13, s2 = f"{prefix}.w13_{fmt.scale_suffix}", f"{prefix}.w2_{fmt.scale_suffix}"
    if fmt is Format.BLOCK_FP8:
        nb = _cdiv(i, BLOCK)
        b.param(s13, (e, 2 * nb, _cdiv(h, BLOCK)), torch.float32)
        b.param(s2, (e, _cdiv(h, BLOCK), nb), torch.float32)
        gate_s, up_s = slice(0, nb), slice(nb, 2 * nb)
    elif fmt is Format.MXFP8:
        b.param(s13, (e, 2 * i, h // MX_BLOCK), torch.uint8)
        b.param(s2, (e, h, i // MX_BLOCK), torch.uint8)
        gate_s, up_s = slice(0, i), slice(i, 2 * i)
    else:  # fp8_per_tensor: one scale per projection
        b.param(s13, (e, 2), torch.float32)
        b.param(s2, (e,), torch.float32)
        gate_s, up_s = 0, 1
    for x in range(e):
        for proj, param, scale, rows, scale_rows in (
            ("gate_proj", w13, s13, slice(0, i), gate_s),
            ("up_proj", w13, s13, slice(i, 2 * i), up_s),
            ("down_proj", w2, s2, None, None),
        ):
            name = f"{prefix}.{x}.{proj}"
            b.slot(f"{name}.weight", param, *((x,) if rows is None else (x, rows)))
            b.slot(f"{name}.{fmt.scale_suffix}", scale, *((x,) if scale_rows is None else (x, scale_rows)))
    return _Experts(prefix, fmt, i)


#: a 4-bit format's third tensor per projection (SPEC §2.3): dtype, shape of one; NVFP4's leaf is
#: ``FormatParams.global_scale_leaf()`` (ModelOpt's ``weight_scale_2``, compressed-tensors'
#: ``weight_global_scale`` [1])
FOUR_BIT_EXTRA = {
    (Format.NVFP4, Nvfp4Names.MODELOPT): ("weight_scale_2", torch.float32, ()),
    (Format.NVFP4, Nvfp4Names.COMPRESSED_TENSORS): ("weight_global_scale", torch.float32, (1,)),
    (Format.INT4_W4A16, None): ("weight_shape", torch.int64, (2,)),
}


def four_bit_extra(fmt: Format, params: FormatParams) -> tuple[str, torch.dtype, tuple[int, ...]] | None:
    """A 4-bit format's third tensor per projection under ``params``: leaf, dtype, shape of one."""
    return FOUR_BIT_EXTRA.get((fmt, params.nvfp4_names if fmt is Format.NVFP4 else None))


def _four_bit_experts(
    b: _Builder, prefix: str, d: _Dims, fmt: Format, params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> _Experts:
    """``w13``/``w2`` held packed (SPEC §1.5-1.7), their ``weight_scale`` row for row (INT4's per
    ``params.int4_group`` in ``params.int4_scale_dtype``), and NVFP4's global scales
    ``w13_weight_scale_2 [E, 2]`` (gate, up) / ``w2_weight_scale_2 [E]`` (under compressed-tensors'
    names ``w13_weight_global_scale [E, 2, 1]``, their reciprocals) or INT4's ``weight_shape``
    ``[E, 2, 2]`` / ``[E, 2]``. Checkpoint names are SPEC's: ``.weight`` (NVFP4 under ModelOpt's names)
    or ``.weight_packed``."""
    e, i, h = d.experts, d.inter, d.hidden
    w13, w2 = f"{prefix}.w13_weight", f"{prefix}.w2_weight"
    b.param(w13, (e, *fmt.weight_shape((2 * i, h))), fmt.weight_dtype)
    b.param(w2, (e, *fmt.weight_shape((h, i))), fmt.weight_dtype)
    s13, s2 = f"{prefix}.w13_{fmt.scale_suffix}", f"{prefix}.w2_{fmt.scale_suffix}"
    b.param(s13, (e, *params.scale_shape(fmt, (2 * i, h))), params.scale_dtype(fmt))
    b.param(s2, (e, *params.scale_shape(fmt, (h, i))), params.scale_dtype(fmt))
    extra = four_bit_extra(fmt, params)
    x13 = x2 = ""
    if extra is not None:
        leaf, dtype, shape = extra
        x13, x2 = (
            b.param(f"{prefix}.w13_{leaf}", (e, 2, *shape), dtype),
            b.param(f"{prefix}.w2_{leaf}", (e, *shape), dtype),
        )
    for x in range(e):
        for proj, param, scale, xparam, rows, part in (
            ("gate_proj", w13, s13, x13, slice(0, i), 0),
            ("up_proj", w13, s13, x13, slice(i, 2 * i), 1),
            ("down_proj", w2, s2, x2, None, None),
        ):
            name, index = f"{prefix}.{x}.{proj}", ((x,) if rows is None else (x, rows))
            b.slot(f"{name}.{params.weight_suffix(fmt)}", param, *index)
            b.slot(f"{name}.{fmt.scale_suffix}", scale, *index)
            if extra is not None:
                b.slot(f"{name}.{extra[0]}", xparam, *((x,) if part is None else (x, part)))
    return _Experts(prefix, fmt, i)


def _decoder_layer(
    b: _Builder, p: str, d: _Dims, full: bool, fmt: Format, params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> _Experts:
    (_full_attention if full else _linear_attention)(b, p, d)
    b.whole(f"{p}.mlp.gate.weight", (d.experts, d.hidden))
    experts = _routed_experts(b, f"{p}.mlp.experts", d, fmt, params)
    s = f"{p}.mlp.shared_expert"
    parts = [(f"{s}.gate_proj.weight", d.shared_inter), (f"{s}.up_proj.weight", d.shared_inter)]
    b.fused(f"{s}.gate_up_proj.weight", parts, d.hidden)
    b.whole(f"{s}.down_proj.weight", (d.hidden, d.shared_inter))
    b.whole(f"{p}.mlp.shared_expert_gate.weight", (1, d.hidden))
    b.whole(f"{p}.input_layernorm.weight", (d.hidden,))
    b.whole(f"{p}.post_attention_layernorm.weight", (d.hidden,))
    return experts


# --------------------------------------------------------------------------------------------------
# numerics


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Partial rotary embedding of ``x [B, T, heads, head_dim]`` (first ``rotary_dim`` dims, halves)."""
    if rotary_dim == 0:
        return x
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def _dequantize_rows(
    q: torch.Tensor,
    scale: torch.Tensor,
    fmt: Format,
    rows: list[int],
    extra: torch.Tensor | None = None,
    *,
    reciprocal: bool = False,
) -> torch.Tensor:
    """Float32 ``[E, R, C]`` of fused FP8 or 4-bit weights ``q`` whose rows are ``rows`` projections
    stacked, each under its own scales (block-FP8 block-rows / MXFP8, NVFP4, MXFP4, INT4 rows / one
    per-tensor scale each); ``extra`` holds NVFP4's global scales (``[E, parts]`` or ``[E]``), their
    reciprocals with ``reciprocal`` (compressed-tensors' ``weight_global_scale``)."""
    parts, start, block_start = [], 0, 0
    for j, n in enumerate(rows):
        qp = q[:, start : start + n]
        if fmt.four_bit:
            sp = scale[:, start : start + n]
            if fmt is Format.NVFP4:
                gs = (extra[:, j] if extra.dim() == 2 else extra)[:, None, None]
                if reciprocal:  # compressed-tensors' weight_global_scale: 1 / gs, inverted as vLLM does
                    gs = 1.0 / gs
                parts.append(dequantize(qp, sp, fmt, global_scale=gs))
            else:
                parts.append(dequantize(qp, sp, fmt))
            start += n
            continue
        if fmt is Format.BLOCK_FP8:
            sp = scale[:, block_start : block_start + _cdiv(n, BLOCK)]
            block_start += _cdiv(n, BLOCK)
        elif fmt is Format.MXFP8:
            sp = scale[:, start : start + n]
        else:
            sp = (scale[:, j] if scale.dim() == 2 else scale)[:, None, None]
        parts.append(dequantize(qp, sp, fmt))
        start += n
    return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------------------------------
# the engine
