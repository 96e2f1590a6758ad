"""A pure-torch reference engine: a small Qwen3.5-MoE decoder that loads published generations.

It loads checkpoint-format tensors the way real engines do (its own fused parameters, filled from
checkpoint names) and runs a forward pass, so tests and the demo can measure what FP8 refit does to a
model's outputs. It is a reference for *loading*, not a fast or production-exact model.

Usage::

    config = make_hf_config("qwen3_5_moe", num_layers=4, num_experts=8, unaligned=True)
    state = make_state_dict("qwen3_5_moe", num_layers=4, num_experts=8, unaligned=True)
    baseline = ReferenceEngine.from_config(config, expert_format="bf16")
    baseline.load_bf16(state)
    engine = ReferenceEngine.from_config(config, expert_format="block_fp8")
    engine.load(convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")))
    ids = sample_inputs(engine.vocab_size)
    kl = next_token_kl(baseline.forward(ids), engine.forward(ids))

Parameters (engine-style, vLLM-like names, each under its checkpoint module path):

* full attention: ``self_attn.qkv_proj.weight`` = [q_proj; k_proj; v_proj] rows, plus o_proj and the
  q/k norms. q_proj holds, per head, ``head_dim`` query rows then ``head_dim`` output-gate rows
  (transformers' ``view(..., heads, 2 * head_dim).chunk(2)``); the attention output is multiplied by
  ``sigmoid(gate)`` before o_proj.
* linear attention: ``linear_attn.in_proj_qkvz.weight`` = [in_proj_qkv; in_proj_z] and
  ``linear_attn.in_proj_ba.weight`` = [in_proj_b; in_proj_a]; conv1d, A_log, dt_bias, norm and
  out_proj as in the checkpoint.
* shared expert: ``mlp.shared_expert.gate_up_proj.weight`` = [gate_proj; up_proj]; down_proj and
  ``mlp.shared_expert_gate`` as in the checkpoint.
* routed experts, fused: ``mlp.experts.w13_weight [E, 2I, H]`` (gate rows ``[0, I)``, up rows
  ``[I, 2I)``) and ``mlp.experts.w2_weight [E, H, I]``, in the engine's expert format:

  ========================  ==================  ====================================================
  format                    w13 / w2 weights    scales (``w13_<suffix>`` / ``w2_<suffix>``)
  ========================  ==================  ====================================================
  ``block_fp8``             float8_e4m3fn       ``weight_scale_inv`` float32
                                                ``[E, 2*ceil(I/128), ceil(H/128)]`` (gate block-rows
                                                first, then up: no block straddles gate and up) /
                                                ``[E, ceil(H/128), ceil(I/128)]``
  ``mxfp8``                 float8_e4m3fn       ``weight_scale`` uint8 ``[E, 2I, H/32]`` /
                                                ``[E, H, I/32]``
  ``fp8_per_tensor``        float8_e4m3fn       ``weight_scale`` float32 ``[E, 2]`` (gate, up) / ``[E]``
  ``nvfp4``                 uint8, 2 per byte   ``weight_scale`` float8_e4m3fn ``[E, 2I, H/16]`` /
                                                ``[E, H, I/16]``; ``weight_scale_2`` float32
                                                ``[E, 2]`` (gate, up) / ``[E]``
  ``mxfp4``                 uint8, 2 per byte   ``weight_scale`` uint8 ``[E, 2I, H/32]`` / ``[E, H, I/32]``
  ``int4_w4a16``            int32, 8 per word   ``weight_scale`` bfloat16 ``[E, 2I, H/32]`` /
                                                ``[E, H, I/32]``; ``weight_shape`` int64 ``[E, 2, 2]`` /
                                                ``[E, 2]``
  ``bf16`` (or kept BF16)   bfloat16            none; loaded from the slabs ``experts.gate_up_proj``
                                                / ``experts.down_proj`` as published
  ========================  ==================  ====================================================

The manifest is derived from these parameters: every checkpoint name is a view into one of them, and
its dtype and shape are that view's (the 4-bit formats' checkpoint names are SPEC §2.3's: ``.weight``
for NVFP4, ``.weight_packed`` for MXFP4 and INT4). Quantized experts are dequantized with
``sidecar.numerics.reference.dequantize``
(part by part: gate, up and down each under their own scales) the first time a forward pass needs
them after a load, and cached as float32.

What is simplified (plainly): computation is float32 throughout, whole sequences only (no KV or conv
cache, no chunked kernels). The linear-attention layers follow the recurrent form of Gated DeltaNet
(causal depthwise conv + SiLU, L2-normed q/k, ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``, delta-rule state update, gated RMSNorm with ``silu(z)``, out_proj), written
from transformers' torch fallback but never compared against transformers or vLLM numerics. Rotary
embeddings are plain partial RoPE (multimodal RoPE reduces to it for text-only positions). The MTP
head (:meth:`ReferenceEngine.forward_mtp`) is a one-pass sketch: ``fc([norm(embed(x[t+1]));
norm(h[t])])`` through the MTP decoder layers, ``mtp.norm`` and the shared lm_head; it exists so
every MTP tensor is used. Qwen3 MoE (per-expert checkpoints, no shared expert) is not supported.
DeepSeek-V3 configs get :class:`adapters.reference.mla.DeepseekReferenceEngine` (MLA, sigmoid router,
block-FP8 linears) from :meth:`ReferenceEngine.from_config`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

import sidecar
from adapters.reference.parts import (
    SUPPORTED_MODEL,
    _Builder,
    _decoder_layer,
    _dequantize_rows,
    _Dims,
    _Experts,
    _rms,
    _rope,
)
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams, Nvfp4Names
from sidecar.plan.models import get_model, model_type_of
from sidecar.plan.models.qwen import FULL_ATTENTION, qwen3_5_layer_types
from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor

__all__ = ["ENGINE_VERSION", "MOE_BACKEND", "ReferenceEngine", "next_token_kl", "sample_inputs"]

ENGINE_VERSION = f"refitd-reference-{sidecar.__version__}"
MOE_BACKEND = "ReferenceFusedMoE"
BF16 = torch.bfloat16
#: how many names of each kind a load error lists before it summarizes
MAX_LISTED = 20


class ReferenceEngine:
    """A pure-torch Qwen3.5-MoE engine holding fused, engine-style parameters (see the module doc).

    Build with :meth:`from_config`; :meth:`manifest` says what it expects, :meth:`load` fills it
    from a published generation (every tensor exactly once), :meth:`forward` returns float32 logits.
    """

    #: engines for other model families, by model_type (``adapters.reference`` registers MLA's)
    families: ClassVar[dict[str, type[ReferenceEngine]]] = {}

    def __init__(
        self,
        config: Mapping[str, Any],
        fmt: Format,
        keep_bf16: frozenset[str],
        params: FormatParams = DEFAULT_FORMAT_PARAMS,
    ) -> None:
        params.check_for(fmt)
        self.format_params = params
        model = get_model(model_type_of(config))
        if model.model_type != SUPPORTED_MODEL:
            raise ValueError(f"the reference engine runs {SUPPORTED_MODEL} only, not {model.model_type}")
        text = model.text_config(config)
        multimodal = "text_config" in config or config.get("model_type") == SUPPORTED_MODEL
        self.root = "model.language_model" if multimodal else "model"
        tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        d = self.dims = _Dims.from_text_config(text, tied)
        self.expert_format = fmt
        self.layer_types = qwen3_5_layer_types(text)
        self.num_mtp_layers = int(text.get("mtp_num_hidden_layers", 0) or 0)
        multiple = params.k_multiple(fmt)
        if multiple is not None and (d.hidden % multiple or d.inter % multiple):
            raise ValueError(
                f"{fmt.value} experts need hidden ({d.hidden}) and moe_intermediate_size ({d.inter}) to be "
                f"multiples of {multiple}; use block_fp8 or bf16"
            )
        self.layers = [f"{self.root}.layers.{n}" for n in range(len(self.layer_types))]
        self.mtp_layers = [f"mtp.layers.{n}" for n in range(self.num_mtp_layers)]
        known = {f"{p}.mlp.experts" for p in self.layers + self.mtp_layers}
        unknown = sorted(keep_bf16 - known)
        if unknown:
            raise ValueError(
                f"keep_bf16 names no routed-experts module of this model: {unknown}; give module names "
                f"like {sorted(known)[0]!r}"
            )
        self.keep_bf16 = keep_bf16

        b = _Builder()
        b.whole(f"{self.root}.embed_tokens.weight", (d.vocab, d.hidden))
        self._experts: dict[str, _Experts] = {}
        for p, kind in zip(self.layers, self.layer_types, strict=True):
            self._add_layer(b, p, kind == FULL_ATTENTION)
        b.whole(f"{self.root}.norm.weight", (d.hidden,))
        if not d.tied:
            b.whole("lm_head.weight", (d.vocab, d.hidden))
        if self.mtp_layers:
            b.whole("mtp.fc.weight", (d.hidden, 2 * d.hidden))
            for p in self.mtp_layers:
                self._add_layer(b, p, True)
            for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
                b.whole(f"mtp.{n}.weight", (d.hidden,))
        self._params = b.params
        self._slots = {s.name: s for s in b.slots}
        self._dense: dict[str, torch.Tensor] = {}
        self._loaded = False

    def _add_layer(self, b: _Builder, p: str, full: bool) -> None:
        module = f"{p}.mlp.experts"
        fmt = Format.BF16 if module in self.keep_bf16 else self.expert_format
        self._experts[module] = _decoder_layer(b, p, self.dims, full, fmt, self.format_params)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        expert_format: Format | str = Format.BLOCK_FP8,
        keep_bf16: Collection[str] = (),
        format_params: FormatParams = DEFAULT_FORMAT_PARAMS,
    ) -> ReferenceEngine:
        """An empty engine for the model ``config`` (a ``config.json`` dict) describes.

        ``keep_bf16`` names routed-experts modules (``…layers.L.mlp.experts``, ``mtp.layers.N.mlp.
        experts``) this engine holds in BF16 whatever ``expert_format`` says; its manifest then lists
        their slabs ``…experts.gate_up_proj`` / ``…experts.down_proj`` in BF16. ``format_params``
        (INT4 group and scale dtype, NVFP4 names) are what it holds and its manifest says.
        """
        keep = (keep_bf16,) if isinstance(keep_bf16, str) else tuple(keep_bf16)
        family = (
            cls.families.get(get_model(model_type_of(config)).model_type) if cls is ReferenceEngine else None
        )
        fmt = Format.parse(expert_format)
        if format_params == DEFAULT_FORMAT_PARAMS:
            return (family or cls)(config, fmt, frozenset(keep))
        return (family or cls)(config, fmt, frozenset(keep), format_params)

    # ---- what it holds

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab

    @property
    def params(self) -> Mapping[str, torch.Tensor]:
        """The engine's own parameters by engine name (read them; load through :meth:`load`)."""
        return MappingProxyType(self._params)

    @property
    def experts_modules(self) -> tuple[str, ...]:
        """Every routed-experts module name, decoder layers then MTP layers."""
        return tuple(self._experts)

    def manifest(self, *, version: str = ENGINE_VERSION) -> Manifest:
        """Every checkpoint tensor this engine expects, mapped back from its fused parameters."""
        tensors = tuple(ManifestTensor(s.name, s.dtype, s.shape) for s in self._slots.values())
        return Manifest(
            engine=EngineKind.REFERENCE,
            engine_version=version,
            moe_backend=MOE_BACKEND,
            expert_format=self.expert_format,
            format_params=self.format_params,
            tensors=tensors,
            info={
                "model_type": SUPPORTED_MODEL,
                "num_hidden_layers": len(self.layers),
                "mtp_layers": len(self.mtp_layers),
                "keep_bf16": sorted(self.keep_bf16),
            },
        )

    # ---- loading

    def load(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a whole published generation into the engine's parameters.

        Every expected tensor must arrive exactly once with its manifest dtype and shape, and no
        other; otherwise a ValueError lists every problem and nothing is copied. Inputs are only read
        (read-only shared-memory views are fine) and no reference to them is kept.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self._check(items)
        for name, tensor in items:
            s = self._slots[name]
            self._params[s.param][s.index].copy_(tensor)
        self._dense.clear()
        self._loaded = True

    def load_part(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy some of a generation's tensors (streamed refit: one layer group as it is published,
        or a rollback's reload of what a failed step replaced). Each must be one this engine
        expects, with its manifest dtype and shape; otherwise a ValueError lists every problem and
        nothing is copied. The engine holds a whole step again only once every tensor of it came."""
        problems = []
        for name, t in named_tensors.items():
            s = self._slots.get(name)
            if s is None:
                problems.append(f"{name}: not expected by this engine")
            elif not isinstance(t, torch.Tensor) or t.dtype != s.dtype or tuple(t.shape) != s.shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"{name}: got {got}, expected {s.dtype} {s.shape}")
        if problems:
            more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
            raise ValueError(
                f"cannot load these tensors into the reference engine: {problems[:MAX_LISTED]}{more}"
            )
        for name, tensor in named_tensors.items():
            s = self._slots[name]
            self._params[s.param][s.index].copy_(tensor)
        self._dense.clear()

    def load_bf16(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Fill a BF16 engine from the original BF16 checkpoint (the baseline FP8 is measured against).

        With every routed expert held in BF16 the published tensors *are* the checkpoint's, so this
        is :meth:`load` on the state dict; an engine holding FP8 experts refuses.
        """
        fp8 = [m for m, e in self._experts.items() if e.fmt is not Format.BF16]
        if fp8:
            raise ValueError(
                f"this engine holds {len(fp8)} routed-experts module(s) in {self.expert_format.value} "
                f"(first: {fp8[0]}); build the baseline with expert_format='bf16'"
            )
        self.load(state_dict)

    def _check(self, items: list[tuple[str, torch.Tensor]]) -> None:
        problems: list[str] = []

        def note(kind: str, names: list[str]) -> None:
            if names:
                more = f" (and {len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
                problems.append(f"{len(names)} {kind}: {names[:MAX_LISTED]}{more}")

        counts = Counter(name for name, _ in items)
        note("sent more than once", sorted(n for n, c in counts.items() if c > 1))
        note("missing", [n for n in self._slots if n not in counts])
        note("not expected by this engine", [n for n in counts if n not in self._slots])
        wrong = []
        for name, t in items:
            s = self._slots.get(name)
            if s is None:
                continue
            if not isinstance(t, torch.Tensor):
                wrong.append(f"{name}: a {type(t).__name__}, not a tensor")
            elif t.dtype != s.dtype or tuple(t.shape) != s.shape:
                wrong.append(f"{name}: got {t.dtype} {tuple(t.shape)}, expected {s.dtype} {s.shape}")
        note("with the wrong dtype or shape", wrong)
        if problems:
            lines = "\n".join(f"  - {p}" for p in problems)
            raise ValueError(f"cannot load this generation into the reference engine:\n{lines}")

    # ---- compute weights

    def compute_weight(self, name: str) -> torch.Tensor:
        """The float32 weight the forward pass uses for engine parameter ``name`` (FP8 routed
        experts dequantized under their scales); cached until the next load."""
        w = self._dense.get(name)
        if w is None:
            w = self._dense[name] = self._dequantized(name)
        return w

    def _dequantized(self, name: str) -> torch.Tensor:
        prefix, _, leaf = name.rpartition(".")
        experts = self._experts.get(prefix)
        if experts is None or experts.fmt is Format.BF16 or leaf not in ("w13_weight", "w2_weight"):
            return self._params[name].float()
        fmt = experts.fmt
        scale = self._params[f"{prefix}.{leaf.removesuffix('weight')}{fmt.scale_suffix}"]
        rows = [experts.inter, experts.inter] if leaf == "w13_weight" else [self.dims.hidden]
        extra, reciprocal = None, False
        if fmt is Format.NVFP4:
            leaf = self.format_params.global_scale_leaf()  # weight_scale_2, or weight_global_scale [..., 1]
            extra = self._params[f"{name.removesuffix('weight')}{leaf}"]
            reciprocal = self.format_params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
            extra = extra.reshape(extra.shape[:-1]) if reciprocal else extra
        return _dequantize_rows(self._params[name], scale, fmt, rows, extra, reciprocal=reciprocal)

    # ---- forward

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[B, T, V]`` of ``input_ids [B, T]`` (causal, whole sequences)."""
        return self._logits(self._trunk(input_ids))

    def forward_mtp(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 MTP logits ``[B, T-1, V]``: position t, from the main model's hidden state at t
        and the embedding of token t+1, predicts token t+2 (a sketch, see the module doc)."""
        if not self.mtp_layers:
            raise ValueError("this model has no MTP layers (mtp_num_hidden_layers = 0)")
        self._check_ids(input_ids)
        if input_ids.shape[1] < 2:
            raise ValueError("forward_mtp needs sequences of at least 2 tokens")
        hidden = self._trunk(input_ids)
        embeds = self.compute_weight(f"{self.root}.embed_tokens.weight")[input_ids[:, 1:]]
        x = torch.cat(
            [
                self._norm(embeds, "mtp.pre_fc_norm_embedding"),
                self._norm(hidden[:, :-1], "mtp.pre_fc_norm_hidden"),
            ],
            dim=-1,
        )
        x = x @ self.compute_weight("mtp.fc.weight").T
        positions = torch.arange(1, input_ids.shape[1])
        for p in self.mtp_layers:
            x = self._layer(x, p, True, positions)
        return self._logits(self._norm(x, "mtp.norm"))

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if not self._loaded:
            raise RuntimeError("no weights loaded: call load() or load_bf16() first")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size})")

    def _trunk(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The main model's final normed hidden states ``[B, T, H]``."""
        self._check_ids(input_ids)
        x = self.compute_weight(f"{self.root}.embed_tokens.weight")[input_ids]
        positions = torch.arange(input_ids.shape[1])
        for p, kind in zip(self.layers, self.layer_types, strict=True):
            x = self._layer(x, p, kind == FULL_ATTENTION, positions)
        return self._norm(x, f"{self.root}.norm")

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = f"{self.root}.embed_tokens.weight" if self.dims.tied else "lm_head.weight"
        return hidden @ self.compute_weight(head).T

    def _norm(self, x: torch.Tensor, module: str) -> torch.Tensor:
        """Qwen3.5's RMSNorm: ``rms_normalize(x) * (1 + weight)`` (weights are stored zero-centred)."""
        return _rms(x, self.dims.eps) * (1.0 + self.compute_weight(f"{module}.weight"))

    def _layer(self, x: torch.Tensor, p: str, full: bool, positions: torch.Tensor) -> torch.Tensor:
        h = self._norm(x, f"{p}.input_layernorm")
        x = x + (self._attention(h, p, positions) if full else self._linear_attention(h, p))
        h = self._norm(x, f"{p}.post_attention_layernorm")
        return x + self._moe(h, p)

    def _attention(self, x: torch.Tensor, p: str, positions: torch.Tensor) -> torch.Tensor:
        d, a = self.dims, f"{p}.self_attn"
        bsz, t, _ = x.shape
        q_rows, kv_rows = 2 * d.heads * d.head_dim, d.kv_heads * d.head_dim
        qg, k, v = (x @ self.compute_weight(f"{a}.qkv_proj.weight").T).split([q_rows, kv_rows, kv_rows], -1)
        q, gate = qg.view(bsz, t, d.heads, 2 * d.head_dim).chunk(2, dim=-1)
        q = _rms(q, d.eps) * (1.0 + self.compute_weight(f"{a}.q_norm.weight"))
        k = _rms(k.view(bsz, t, d.kv_heads, d.head_dim), d.eps) * (
            1.0 + self.compute_weight(f"{a}.k_norm.weight")
        )
        q, k = (_rope(z, positions, d.rotary_dim, d.rope_theta) for z in (q, k))
        v = v.view(bsz, t, d.kv_heads, d.head_dim)
        group = d.heads // d.kv_heads
        q, k, v = (
            q.transpose(1, 2),
            k.repeat_interleave(group, 2).transpose(1, 2),
            v.repeat_interleave(group, 2).transpose(1, 2),
        )
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(bsz, t, d.heads * d.head_dim)
        out = out * torch.sigmoid(gate.reshape(bsz, t, d.heads * d.head_dim))
        return out @ self.compute_weight(f"{a}.o_proj.weight").T

    def _linear_attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        d, a = self.dims, f"{p}.linear_attn"
        bsz, t, _ = x.shape
        key, value, hv = d.lin_k_heads * d.lin_k_dim, d.lin_v_heads * d.lin_v_dim, d.lin_v_heads
        mixed, z = (x @ self.compute_weight(f"{a}.in_proj_qkvz.weight").T).split([2 * key + value, value], -1)
        b, a_in = (x @ self.compute_weight(f"{a}.in_proj_ba.weight").T).split([hv, hv], -1)
        conv_w = self.compute_weight(f"{a}.conv1d.weight")  # [C, 1, kernel]: causal depthwise conv
        mixed = F.conv1d(F.pad(mixed.transpose(1, 2), (d.conv_kernel - 1, 0)), conv_w, groups=conv_w.shape[0])
        q, k, v = F.silu(mixed).transpose(1, 2).split([key, key, value], -1)
        q = F.normalize(q.reshape(bsz, t, d.lin_k_heads, d.lin_k_dim), dim=-1)
        k = F.normalize(k.reshape(bsz, t, d.lin_k_heads, d.lin_k_dim), dim=-1)
        group = hv // d.lin_k_heads
        q, k = q.repeat_interleave(group, 2) * d.lin_k_dim**-0.5, k.repeat_interleave(group, 2)
        v = v.reshape(bsz, t, hv, d.lin_v_dim)
        beta = torch.sigmoid(b)  # [B, T, Hv]
        g = -torch.exp(self.compute_weight(f"{a}.A_log")) * F.softplus(
            a_in + self.compute_weight(f"{a}.dt_bias")
        )
        state = x.new_zeros(bsz, hv, d.lin_k_dim, d.lin_v_dim)
        outs = []
        for i in range(t):  # the delta rule, one step at a time
            state = state * torch.exp(g[:, i])[..., None, None]
            remembered = (state * k[:, i, :, :, None]).sum(-2)
            delta = (v[:, i] - remembered) * beta[:, i, :, None]
            state = state + k[:, i, :, :, None] * delta[:, :, None, :]
            outs.append((state * q[:, i, :, :, None]).sum(-2))
        o = torch.stack(outs, dim=1)  # [B, T, Hv, dv]
        o = (
            _rms(o, d.eps)
            * self.compute_weight(f"{a}.norm.weight")
            * F.silu(z.reshape(bsz, t, hv, d.lin_v_dim))
        )
        return o.reshape(bsz, t, value) @ self.compute_weight(f"{a}.out_proj.weight").T

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        d = self.dims
        shape = x.shape
        x = x.reshape(-1, d.hidden)
        probs = (x @ self.compute_weight(f"{p}.mlp.gate.weight").T).softmax(-1)
        weights, chosen = probs.topk(d.top_k, dim=-1)
        if d.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        w13 = self.compute_weight(f"{p}.mlp.experts.w13_weight")
        w2 = self.compute_weight(f"{p}.mlp.experts.w2_weight")
        out = torch.zeros_like(x)
        for e in range(d.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = (x[token] @ w13[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e].T
            out.index_add_(0, token, y * weights[token, slot, None])
        s = f"{p}.mlp.shared_expert"
        gate, up = (x @ self.compute_weight(f"{s}.gate_up_proj.weight").T).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ self.compute_weight(f"{s}.down_proj.weight").T
        shared = shared * torch.sigmoid(x @ self.compute_weight(f"{p}.mlp.shared_expert_gate.weight").T)
        return (out + shared).reshape(shape)


# --------------------------------------------------------------------------------------------------
# measuring


def next_token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over all positions of KL(P ‖ Q) between the next-token distributions (nats, float64)."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logits differ in shape: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    log_p = p_logits.double().log_softmax(-1)
    log_q = q_logits.double().log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def sample_inputs(vocab: int, batch: int = 4, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """Token ids ``[batch, seq]`` drawn uniformly from ``[0, vocab)``; same seed, same ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen, dtype=torch.int64)
