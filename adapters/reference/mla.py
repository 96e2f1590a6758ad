"""A pure-torch reference engine for the DeepSeek-V3 family: MLA attention, sigmoid-routed MoE, MTP.

:class:`DeepseekReferenceEngine` is what :meth:`adapters.reference.ReferenceEngine.from_config`
returns for a ``deepseek_v3`` config. Like the Qwen3.5 reference it loads checkpoint-format tensors
(every one exactly once, dtype and shape checked) and runs a float32 forward pass in which every
published tensor changes the logits, so the demo can check refit byte for byte and measure KL.

What it holds (each checkpoint tensor is its own parameter, under its checkpoint name):

* routed experts ``mlp.experts.{e}.{gate,up,down}_proj`` in the engine's expert format (FP8 weight
  and its ``weight_scale_inv`` / ``weight_scale``), or BF16 for the modules in ``keep_bf16``;
* when the config carries a block-FP8 ``quantization_config`` (as DeepSeek-V3's does), the linears
  it builds with a quant config, as vLLM's ``deepseek_v2.py`` does: ``q_a_proj``, ``q_b_proj`` (or
  ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, the dense MLP and the shared
  experts, in the same format; the router ``mlp.gate``, embeddings, heads, norms and the MTP
  ``eh_proj`` stay BF16 and ``mlp.gate.e_score_correction_bias`` FP32.

What is simplified (plainly): MLA is computed non-absorbed (``kv_b_proj`` expands the latent into
per-head keys and values), with plain half-split RoPE on the ``qk_rope_head_dim`` dims (DeepSeek
interleaves and applies YaRN scaling); the router picks the top-k of ``sigmoid(logits) + bias``
without group limiting (``n_group`` > 1 is refused), weights the chosen sigmoid scores, normalizes
them (``norm_topk_prob``) and scales by ``routed_scaling_factor``. The MTP pass is one layer deep:
``eh_proj([enorm(embed(x[t+1])); hnorm(h[t])])`` through the MTP decoder layer, ``shared_head.norm``
and ``shared_head.head``, using the MTP layer's own embedding copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from adapters.reference.parts import _Builder, _rms, _rope
from adapters.reference.qwen import ENGINE_VERSION, MOE_BACKEND, ReferenceEngine
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, FP8_DTYPE, MX_BLOCK, Format, FormatParams
from sidecar.numerics.reference import dequantize
from sidecar.plan.models import get_model, model_type_of
from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor

__all__ = ["DeepseekReferenceEngine"]

MODEL = "deepseek_v3"
ROUTER_BIAS_DTYPE = torch.float32


@dataclass(frozen=True, slots=True, kw_only=True)
class _MlaDims:
    hidden: int
    vocab: int
    layers: int
    mtp: int
    heads: int
    q_lora: int | None
    kv_lora: int
    nope: int
    rope: int
    v: int
    inter: int
    moe_inter: int
    experts: int
    shared: int
    top_k: int
    first_dense: int
    moe_freq: int
    norm_topk: bool
    scaling: float
    eps: float
    theta: float
    noaux: bool

    @classmethod
    def read(cls, c: Mapping[str, Any]) -> _MlaDims:
        try:
            if int(c.get("n_group", 1) or 1) > 1:
                raise ValueError(
                    f"the reference engine routes without group limits; this config has n_group = {c['n_group']}"
                )
            q_lora = c.get("q_lora_rank")
            return cls(
                hidden=int(c["hidden_size"]),
                vocab=int(c["vocab_size"]),
                layers=int(c["num_hidden_layers"]),
                mtp=int(c.get("num_nextn_predict_layers", 0) or 0),
                heads=int(c["num_attention_heads"]),
                q_lora=None if q_lora is None else int(q_lora),
                kv_lora=int(c["kv_lora_rank"]),
                nope=int(c["qk_nope_head_dim"]),
                rope=int(c["qk_rope_head_dim"]),
                v=int(c["v_head_dim"]),
                inter=int(c["intermediate_size"]),
                moe_inter=int(c["moe_intermediate_size"]),
                experts=int(c["n_routed_experts"]),
                shared=int(c.get("n_shared_experts", 0) or 0),
                top_k=int(c["num_experts_per_tok"]),
                first_dense=int(c.get("first_k_dense_replace", 0)),
                moe_freq=int(c.get("moe_layer_freq", 1)),
                norm_topk=bool(c.get("norm_topk_prob", True)),
                scaling=float(c.get("routed_scaling_factor", 1.0)),
                eps=float(c.get("rms_norm_eps", 1e-6)),
                theta=float(c.get("rope_theta", 10000.0)),
                noaux=c.get("topk_method", "noaux_tc") == "noaux_tc",
            )
        except KeyError as exc:
            raise ValueError(f"{MODEL} config has no {exc}; pass the model's full config.json") from None

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.first_dense and layer % max(self.moe_freq, 1) == 0


def _block_fp8_checkpoint(config: Mapping[str, Any]) -> bool:
    """The config's own quantization_config quantizes the linears (vLLM passes it to every linear)."""
    q = config.get("quantization_config")
    return isinstance(q, Mapping) and q.get("quant_method") == "fp8" and bool(q.get("weight_block_size"))


class DeepseekReferenceEngine(ReferenceEngine):
    """A pure-torch DeepSeek-V3 engine (see the module doc); the same load/manifest/forward surface
    as :class:`~adapters.reference.ReferenceEngine`."""

    def __init__(
        self,
        config: Mapping[str, Any],
        fmt: Format,
        keep_bf16: frozenset[str],
        params: FormatParams = DEFAULT_FORMAT_PARAMS,
    ) -> None:
        params.check_for(fmt)  # FP8 / BF16 only (refused below otherwise): no parameters to take
        self.format_params = params
        if get_model(model_type_of(config)).model_type != MODEL:
            raise ValueError(f"DeepseekReferenceEngine runs {MODEL} configs only")
        d = self.mla = _MlaDims.read(config)
        if fmt.four_bit:
            raise ValueError(
                f"the DeepSeek (MLA) reference engine holds FP8 or BF16 experts, not {fmt.value}; "
                "use the Qwen3.5 reference engine for the 4-bit formats"
            )
        self.expert_format = fmt
        self.quantized_linears = _block_fp8_checkpoint(config) and fmt is not Format.BF16
        self.root = "model"
        self.layers = [f"model.layers.{n}" for n in range(d.layers)]
        self.mtp_layers = [f"model.layers.{d.layers + n}" for n in range(d.mtp)]
        self.keep_bf16 = keep_bf16
        self._formats: dict[str, Format] = {}  # module -> the format this engine holds its weight in
        b = _Builder()
        b.whole("model.embed_tokens.weight", (d.vocab, d.hidden))
        for n, p in enumerate(self.layers + self.mtp_layers):
            mtp = n >= d.layers
            if mtp:
                b.whole(f"{p}.embed_tokens.weight", (d.vocab, d.hidden))
                b.whole(f"{p}.enorm.weight", (d.hidden,))
                b.whole(f"{p}.hnorm.weight", (d.hidden,))
                b.whole(f"{p}.eh_proj.weight", (d.hidden, 2 * d.hidden))  # nn.Linear in vLLM: never FP8
            self._attention_params(b, p)
            self._mlp_params(b, p, n)
            b.whole(f"{p}.input_layernorm.weight", (d.hidden,))
            b.whole(f"{p}.post_attention_layernorm.weight", (d.hidden,))
            if mtp:
                b.whole(f"{p}.shared_head.norm.weight", (d.hidden,))
                b.whole(f"{p}.shared_head.head.weight", (d.vocab, d.hidden))
        b.whole("model.norm.weight", (d.hidden,))
        b.whole("lm_head.weight", (d.vocab, d.hidden))
        unknown = sorted(keep_bf16 - set(self._formats))
        if unknown:
            raise ValueError(
                f"keep_bf16 names no quantizable module of this model: {unknown[:5]}; give module names like "
                f"'model.layers.1.mlp.experts.0.gate_proj'"
            )
        self._params = b.params
        self._slots = {s.name: s for s in b.slots}
        self._experts = {}
        self._dense: dict[str, torch.Tensor] = {}
        self._loaded = False

    # ---- building

    def _linear(self, b: _Builder, module: str, shape: tuple[int, int], fmt: Format) -> None:
        """One linear's weight, held in ``fmt`` (FP8 and its scale) unless kept BF16."""
        if fmt is not Format.BF16 and fmt is Format.MXFP8 and shape[1] % MX_BLOCK:
            raise ValueError(f"{module}: mxfp8 needs the in dim ({shape[1]}) to be a multiple of {MX_BLOCK}")
        self._formats[module] = fmt = Format.BF16 if module in self.keep_bf16 else fmt
        if fmt is Format.BF16:
            b.whole(f"{module}.weight", shape)
            return
        b.slot(f"{module}.weight", b.param(f"{module}.weight", shape, FP8_DTYPE))
        scale = f"{module}.{fmt.scale_suffix}"
        b.slot(scale, b.param(scale, fmt.scale_shape(shape), fmt.scale_dtype))

    def _dense_linear(self, b: _Builder, module: str, shape: tuple[int, int]) -> None:
        self._linear(b, module, shape, self.expert_format if self.quantized_linears else Format.BF16)

    def _attention_params(self, b: _Builder, p: str) -> None:
        d, a = self.mla, f"{p}.self_attn"
        qk = d.nope + d.rope
        if d.q_lora is None:
            self._dense_linear(b, f"{a}.q_proj", (d.heads * qk, d.hidden))
        else:
            self._dense_linear(b, f"{a}.q_a_proj", (d.q_lora, d.hidden))
            b.whole(f"{a}.q_a_layernorm.weight", (d.q_lora,))
            self._dense_linear(b, f"{a}.q_b_proj", (d.heads * qk, d.q_lora))
        self._dense_linear(b, f"{a}.kv_a_proj_with_mqa", (d.kv_lora + d.rope, d.hidden))
        b.whole(f"{a}.kv_a_layernorm.weight", (d.kv_lora,))
        self._dense_linear(b, f"{a}.kv_b_proj", (d.heads * (d.nope + d.v), d.kv_lora))
        self._dense_linear(b, f"{a}.o_proj", (d.hidden, d.heads * d.v))

    def _mlp_params(self, b: _Builder, p: str, layer: int) -> None:
        d = self.mla
        if not d.is_moe(layer):
            for proj, shape in self._mlp_shapes(d.inter):
                self._dense_linear(b, f"{p}.mlp.{proj}", shape)
            return
        for e in range(d.experts):
            for proj, shape in self._mlp_shapes(d.moe_inter):
                self._linear(b, f"{p}.mlp.experts.{e}.{proj}", shape, self.expert_format)
        b.whole(f"{p}.mlp.gate.weight", (d.experts, d.hidden))
        if d.noaux:
            bias = f"{p}.mlp.gate.e_score_correction_bias"
            b.slot(bias, b.param(bias, (d.experts,), ROUTER_BIAS_DTYPE))
        if d.shared:
            for proj, shape in self._mlp_shapes(d.moe_inter * d.shared):
                self._dense_linear(b, f"{p}.mlp.shared_experts.{proj}", shape)

    def _mlp_shapes(self, inter: int) -> tuple[tuple[str, tuple[int, int]], ...]:
        h = self.mla.hidden
        return (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))

    # ---- what it holds

    @property
    def vocab_size(self) -> int:
        return self.mla.vocab

    @property
    def experts_modules(self) -> tuple[str, ...]:
        return tuple(m for m in self._formats if ".mlp.experts." in m)

    def manifest(self, *, version: str = ENGINE_VERSION) -> Manifest:
        tensors = tuple(ManifestTensor(s.name, s.dtype, s.shape) for s in self._slots.values())
        return Manifest(
            engine=EngineKind.REFERENCE,
            engine_version=version,
            moe_backend=MOE_BACKEND,
            expert_format=self.expert_format,
            tensors=tensors,
            info={
                "model_type": MODEL,
                "num_hidden_layers": len(self.layers),
                "mtp_layers": len(self.mtp_layers),
                "keep_bf16": sorted(self.keep_bf16),
                "quantized_linears": self.quantized_linears,
            },
        )

    def load_bf16(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        fp8 = [m for m, f in self._formats.items() if f is not Format.BF16]
        if fp8:
            raise ValueError(
                f"this engine holds {len(fp8)} module(s) in {self.expert_format.value} (first: {fp8[0]}); build "
                "the baseline with expert_format='bf16'"
            )
        self.load(state_dict)

    def _dequantized(self, name: str) -> torch.Tensor:
        module = name.removesuffix(".weight")
        fmt = self._formats.get(module, Format.BF16)
        if fmt is Format.BF16 or name == module:
            return self._params[name].float()
        return dequantize(self._params[name], self._params[f"{module}.{fmt.scale_suffix}"], fmt)

    # ---- forward

    def _w(self, module: str) -> torch.Tensor:
        return self.compute_weight(f"{module}.weight")

    def _norm(self, x: torch.Tensor, module: str) -> torch.Tensor:
        """DeepSeek-V3's RMSNorm: ``rms_normalize(x) * weight``."""
        return _rms(x, self.mla.eps) * self._w(module)

    def _trunk(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(input_ids)
        x = self._w("model.embed_tokens")[input_ids]
        positions = torch.arange(input_ids.shape[1])
        for n, p in enumerate(self.layers):
            x = self._decoder(x, p, n, positions)
        return self._norm(x, "model.norm")

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self._w("lm_head").T

    def forward_mtp(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 MTP logits ``[B, T-1, V]`` of the first MTP layer (see the module doc)."""
        if not self.mtp_layers:
            raise ValueError("this model has no MTP layers (num_nextn_predict_layers = 0)")
        self._check_ids(input_ids)
        if input_ids.shape[1] < 2:
            raise ValueError("forward_mtp needs sequences of at least 2 tokens")
        hidden = self._trunk(input_ids)
        p = self.mtp_layers[0]
        embeds = self._w(f"{p}.embed_tokens")[input_ids[:, 1:]]
        x = torch.cat([self._norm(embeds, f"{p}.enorm"), self._norm(hidden[:, :-1], f"{p}.hnorm")], dim=-1)
        x = x @ self._w(f"{p}.eh_proj").T
        x = self._decoder(x, p, self.mla.layers, torch.arange(1, input_ids.shape[1]))
        return self._norm(x, f"{p}.shared_head.norm") @ self._w(f"{p}.shared_head.head").T

    def _decoder(self, x: torch.Tensor, p: str, layer: int, positions: torch.Tensor) -> torch.Tensor:
        x = x + self._mla(self._norm(x, f"{p}.input_layernorm"), p, positions)
        h = self._norm(x, f"{p}.post_attention_layernorm")
        return x + (self._moe(h, p) if self.mla.is_moe(layer) else self._mlp(h, f"{p}.mlp"))

    def _mla(self, x: torch.Tensor, p: str, positions: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention, non-absorbed: the latent ``c_kv`` expanded by ``kv_b_proj``."""
        d, a = self.mla, f"{p}.self_attn"
        bsz, t, _ = x.shape
        if d.q_lora is None:
            q = x @ self._w(f"{a}.q_proj").T
        else:
            q = self._norm(x @ self._w(f"{a}.q_a_proj").T, f"{a}.q_a_layernorm") @ self._w(f"{a}.q_b_proj").T
        q_nope, q_rope = q.view(bsz, t, d.heads, d.nope + d.rope).split([d.nope, d.rope], -1)
        c_kv, k_rope = (x @ self._w(f"{a}.kv_a_proj_with_mqa").T).split([d.kv_lora, d.rope], -1)
        kv = self._norm(c_kv, f"{a}.kv_a_layernorm") @ self._w(f"{a}.kv_b_proj").T
        k_nope, v = kv.view(bsz, t, d.heads, d.nope + d.v).split([d.nope, d.v], -1)
        q_rope = _rope(q_rope, positions, d.rope, d.theta)
        k_rope = _rope(k_rope.view(bsz, t, 1, d.rope), positions, d.rope, d.theta).expand(
            bsz, t, d.heads, d.rope
        )
        q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope], -1).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d.nope + d.rope)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (probs @ v.transpose(1, 2)).transpose(1, 2).reshape(bsz, t, d.heads * d.v)
        return out @ self._w(f"{a}.o_proj").T

    def _mlp(self, x: torch.Tensor, m: str) -> torch.Tensor:
        gate, up = x @ self._w(f"{m}.gate_proj").T, x @ self._w(f"{m}.up_proj").T
        return (F.silu(gate) * up) @ self._w(f"{m}.down_proj").T

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        d = self.mla
        shape = x.shape
        x = x.reshape(-1, d.hidden)
        scores = torch.sigmoid(x @ self._w(f"{p}.mlp.gate").T)
        choice = scores
        if d.noaux:  # the bias picks the experts; the weights are the unbiased scores
            choice = scores + self.compute_weight(f"{p}.mlp.gate.e_score_correction_bias")
        chosen = choice.topk(d.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if d.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * d.scaling
        out = torch.zeros_like(x)
        for e in range(d.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                y = self._mlp(x[token], f"{p}.mlp.experts.{e}")
                out.index_add_(0, token, y * weights[token, slot, None])
        if d.shared:
            out = out + self._mlp(x, f"{p}.mlp.shared_experts")
        return out.reshape(shape)
