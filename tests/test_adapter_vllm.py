"""The vLLM adapter, tested without vLLM: against parameter lists transcribed from vLLM's source.

``vllm_parameters`` below is the transcription: it lists the parameters (name, dtype, load-time shape)
a vLLM engine creates for a model config and a quantization config, following the vLLM source files
named in ``SOURCES`` (model classes, ``Fp8Config`` / ``Fp8MoEMethod.create_weights``,
``is_layer_skipped``, the Qwen3.5 ``hf_to_vllm_mapper``). It is written independently of
``adapters.vllm.build_manifest``, which maps such lists back to checkpoint names; the stored files
``tests/data/manifests/vllm_*.json`` are its output for the two real configs (regenerate with
``python -m tests.test_adapter_vllm``; a test checks they are current).

The central claim: for a RefitSpec, the engine started with ``vllm_engine_args(spec, config)`` holds
exactly the tensors the refit plan publishes, by name, dtype and global shape, so the attach check
passes by construction; and an engine configured differently yields a precise mismatch list.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.engines import missing

import adapters.vllm as av
import adapters.vllm.worker as avw
from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.formats import Format
from sidecar.plan.build import RefitSpec, plan_from_hf_config
from sidecar.plan.models import get_model, model_type_of
from transport.wire import dtype_name

DATA = Path(__file__).parent / "data"
MANIFESTS = DATA / "manifests"
CONFIGS = {
    "qwen3_moe": DATA / "qwen3-30b-a3b.config.json",
    "qwen3_5_moe": DATA / "qwen3.5-35b-a3b.config.json",
}
#: vLLM versions the stored transcriptions follow: before RoutedExperts (the stored source copies named
#: in SOURCES) experts are ``mlp.experts.w13_weight``; vLLM 0.33.0 (= HEAD when written) holds them in
#: ``mlp.experts.routed_experts`` (MoERunner.routed_experts; fused_moe/layer.py routed_experts_prefix)
PRE_ROUTED = "before RoutedExperts (stored source copies named in 'source')"
VLLM_0_33 = "0.33.0"
TRANSCRIBED = {
    ("qwen3_moe", PRE_ROUTED): MANIFESTS / "vllm_qwen3_30b_a3b_block_fp8.json",
    ("qwen3_5_moe", PRE_ROUTED): MANIFESTS / "vllm_qwen3_5_35b_a3b_block_fp8.json",
    ("qwen3_moe", VLLM_0_33): MANIFESTS / "vllm-0.33.0_qwen3_30b_a3b_block_fp8.json",
    ("qwen3_5_moe", VLLM_0_33): MANIFESTS / "vllm-0.33.0_qwen3_5_35b_a3b_block_fp8.json",
}
#: what the 0.33.0 transcriptions add (read from the vllm-0.33.0 wheel); the other parameters follow SOURCES
SOURCES_0_33 = [
    "vllm 0.33.0 wheel: vllm/model_executor/layers/fused_moe/runner/moe_runner.py (MoERunner.routed_experts "
    "holds w13_/w2_ parameters) and layers/fused_moe/layer.py (routed_experts_prefix='routed_experts')",
]
#: the vLLM files (vllm-project/vllm, stored copies; commit of the copy read) each fact comes from
SOURCES = {
    "qwen3_moe": [
        "vllm/model_executor/models/qwen3_moe.py@2e0831b0ab951c8896d4dd5d6cb9c3350a4574de "
        "(Qwen3MoeForCausalLM, Qwen3MoeModel, Qwen3MoeDecoderLayer, Qwen3MoeAttention, "
        "Qwen3MoeSparseMoeBlock: module names, order, which linears get quant_config)",
    ],
    "qwen3_5_moe": [
        "vllm/model_executor/models/qwen3_5.py@00def4f8421153e037ff6270c0a8c31912a00206 "
        "(Qwen3_5MoeForConditionalGeneration, Qwen3_5DecoderLayer, packed in_proj_qkvz/in_proj_ba)",
        "vllm/model_executor/models/qwen3_next.py@6365b387890f7aa74b0fe65b81705d4730fcc763 "
        "(Qwen3NextSparseMoeBlock, Qwen3NextAttention with output gate, Qwen3NextGatedDeltaNet "
        "parameters: conv1d, in_proj_qkvz, in_proj_ba, dt_bias, A_log, norm, out_proj)",
        "vllm/model_executor/models/qwen3_vl.py (Qwen3VLForConditionalGeneration.hf_to_vllm_mapper)",
    ],
    "common": [
        "vllm/model_executor/layers/quantization/fp8.py@1436674bcb3f46f4c960d09334cf7dd1534943ca "
        "(Fp8Config.from_config/get_quant_method/apply_vllm_mapper; Fp8LinearMethod and "
        "Fp8MoEMethod.create_weights: parameter names, dtypes, shapes)",
        "vllm/model_executor/layers/quantization/utils/quant_utils.py@4de0dd6db70fbcfdb5420b3de5892d06ed1624c8 "
        "(is_layer_skipped)",
    ],
}
#: configuration keys vLLM reads, with the file that reads them
FP8_CONFIG_KEYS = {  # fp8.py Fp8Config.from_config; "fmt" is Hugging Face's own key, ignored by vLLM
    "quant_method",
    "activation_scheme",
    "ignored_layers",
    "modules_to_not_convert",
    "weight_block_size",
    "fmt",
}
FP8_ACTIVATION_SCHEMES = {"static", "dynamic"}  # fp8.py ACTIVATION_SCHEMES
MODELOPT_CONFIG_KEYS = {
    "quant_method",
    "quant_algo",
    "kv_cache_quant_algo",
    "ignore",
    "group_size",
}  # modelopt.py
ENGINE_ARG_KEYS = {  # vllm/engine/arg_utils.py EngineArgs; worker_extension_cls: vllm/config/parallel.py
    "language_model_only",  # vllm 0.33.0 config/multimodal.py MultiModalConfig.language_model_only
    "quantization",
    "hf_overrides",
    "load_format",
    "dtype",
    "worker_extension_cls",
}
QUANTIZATION_NAMES = {"fp8", "modelopt_mxfp8", None}  # Fp8Config / ModelOptMxFp8Config .get_name()

FP8, BF16, F32, U8 = "float8_e4m3fn", "bfloat16", "float32", "uint8"


# --------------------------------------------------------------------------------------------------
# the transcription: what vLLM creates


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _hf_to_vllm(name: str) -> str:
    """Qwen3VLForConditionalGeneration.hf_to_vllm_mapper (qwen3_vl.py), as Fp8Config.apply_vllm_mapper
    applies it to ignored_layers."""
    for old, new in (
        ("model.language_model.", "language_model.model."),
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("model.", "language_model.model."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _is_layer_skipped(prefix: str, ignored: list[str], packed: dict[str, list[str]]) -> bool:
    """quant_utils.is_layer_skipped, skip_with_substr=False."""
    proj = prefix.split(".")[-1]
    if proj in packed:
        skipped = {prefix.replace(proj, shard) in ignored for shard in packed[proj]}
        if len(skipped) > 1:
            raise ValueError(f"Detected some but not all shards of {prefix} are quantized.")
        return skipped.pop()
    if "experts" in prefix:
        return any(prefix in name for name in ignored if "experts" in name)
    return prefix in ignored


class _Emitter:
    """Creates parameters the way vLLM's layers do for one quantization config."""

    def __init__(self, quant: dict[str, Any] | None, packed: dict[str, list[str]], mapper, tp: int, ep: int):
        quant = quant or {}
        self.method = quant.get("quant_method")
        self.algo = str(quant.get("quant_algo", "")).upper()
        self.block = quant.get("weight_block_size")
        names = quant.get("ignored_layers") or quant.get("ignore") or []
        self.ignored = [mapper(n) for n in names]
        self.packed, self.tp, self.ep = packed, tp, ep
        self.out: list[list[Any]] = []
        #: allocate block-FP8 experts whatever I/tp is, as a vLLM without create_weights' check would
        self.unchecked = False

    def param(self, name: str, dtype: str, shape: list[int]) -> None:
        self.out.append([name, dtype, list(shape)])

    def _quantized(self, prefix: str) -> bool:
        if self.method is None:
            return False
        if self.method == "modelopt":  # ModelOptQuantConfigBase.is_layer_excluded
            excluded = _is_layer_skipped(prefix, self.ignored, self.packed)
            excluded = excluded or any(e != prefix and e in prefix for e in self.ignored)
            return not (excluded or any(fnmatch.fnmatch(prefix, e) for e in self.ignored))
        return not _is_layer_skipped(prefix, self.ignored, self.packed)

    def linear(self, prefix: str, in_local: int, shards: list[int], *, quant_config: bool = True) -> None:
        """Linear layers: Fp8LinearMethod.create_weights, or UnquantizedLinearMethod."""
        rows = sum(shards)
        if not (quant_config and self._quantized(prefix)):
            self.param(f"{prefix}.weight", BF16, [rows, in_local])
            return
        self.param(f"{prefix}.weight", FP8, [rows, in_local])
        if self.method == "modelopt":
            self.param(f"{prefix}.weight_scale", U8, [rows, in_local // 32])
        elif self.block:
            if len(shards) > 1 or self.tp > 1:
                bad = [s for s in shards if s % self.block[0]]
                if bad:
                    raise ValueError(f"{prefix}: output_partition_size {bad[0]} not divisible by block_n")
            self.param(f"{prefix}.weight_scale_inv", F32, [_cdiv(rows, 128), _cdiv(in_local, 128)])
        else:
            self.param(f"{prefix}.weight_scale", F32, [len(shards)])

    def experts(self, prefix: str, e: int, i: int, h: int) -> None:
        """FusedMoE: Fp8MoEMethod / ModelOpt MXFP8 MoE / UnquantizedFusedMoEMethod create_weights."""
        e_loc, i_loc = e // self.ep, i // (1 if self.ep > 1 else self.tp)
        quantized = self._quantized(prefix)
        dtype = FP8 if quantized else BF16
        self.param(f"{prefix}.w13_weight", dtype, [e_loc, 2 * i_loc, h])
        self.param(f"{prefix}.w2_weight", dtype, [e_loc, h, i_loc])
        if not quantized:
            return
        if self.method == "modelopt":
            self.param(f"{prefix}.w13_weight_scale", U8, [e_loc, 2 * i_loc, h // 32])
            self.param(f"{prefix}.w2_weight_scale", U8, [e_loc, h, i_loc // 32])
        elif self.block:
            if i_loc % 128 and not self.unchecked:
                raise ValueError(f"{prefix}: intermediate_size_per_partition {i_loc} not divisible by 128")
            self.param(f"{prefix}.w13_weight_scale_inv", F32, [e_loc, 2 * _cdiv(i_loc, 128), _cdiv(h, 128)])
            self.param(f"{prefix}.w2_weight_scale_inv", F32, [e_loc, _cdiv(h, 128), _cdiv(i_loc, 128)])
        else:
            self.param(f"{prefix}.w13_weight_scale", F32, [e_loc, 2])
            self.param(f"{prefix}.w2_weight_scale", F32, [e_loc])


def _attention(em: _Emitter, p: str, t: dict[str, Any], h: int, gate: bool) -> None:
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    hd, tp = t.get("head_dim") or h // heads, em.tp
    q_local, kv_local = heads * (2 if gate else 1) // tp * hd, max(1, kv // tp) * hd
    em.linear(f"{p}.self_attn.qkv_proj", h, [q_local, kv_local, kv_local])
    em.linear(f"{p}.self_attn.o_proj", heads * hd // tp, [h])
    em.param(f"{p}.self_attn.q_norm.weight", BF16, [hd])
    em.param(f"{p}.self_attn.k_norm.weight", BF16, [hd])


def _qwen3_moe(em: _Emitter, c: dict[str, Any]) -> None:
    h, v, e, tp = c["hidden_size"], c["vocab_size"], c["num_experts"], em.tp
    em.param("model.embed_tokens.weight", BF16, [v // tp, h])
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        _attention(em, p, c, h, gate=False)
        em.linear(f"{p}.mlp.gate", h, [e])  # ReplicatedLinear, quant_config=quant_config
        em.experts(f"{p}.mlp.experts", e, c["moe_intermediate_size"], h)
        em.param(f"{p}.input_layernorm.weight", BF16, [h])
        em.param(f"{p}.post_attention_layernorm.weight", BF16, [h])
    em.param("model.norm.weight", BF16, [h])
    if not c.get("tie_word_embeddings"):
        em.param("lm_head.weight", BF16, [v // tp, h])


def _qwen3_5_moe(em: _Emitter, c: dict[str, Any]) -> None:
    """Qwen3_5MoeForConditionalGeneration, language model only (vision tower not transcribed)."""
    t = c["text_config"]
    h, v, e, tp, root = t["hidden_size"], t["vocab_size"], t["num_experts"], em.tp, "language_model.model"
    key = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    vheads, vdim = t["linear_num_value_heads"], t["linear_value_head_dim"]
    value, shared = vheads * vdim, t["shared_expert_intermediate_size"]
    em.param(f"{root}.embed_tokens.weight", BF16, [v // tp, h])
    for layer, kind in enumerate(t["layer_types"]):
        p = f"{root}.layers.{layer}"
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            em.param(f"{a}.conv1d.weight", BF16, [(2 * key + value) // tp, 1, t["linear_conv_kernel_dim"]])
            em.linear(f"{a}.in_proj_qkvz", h, [(2 * key + value) // tp, value // tp])
            em.linear(f"{a}.in_proj_ba", h, [vheads // tp, vheads // tp])
            em.param(f"{a}.dt_bias", BF16, [vheads // tp])
            em.param(f"{a}.A_log", F32, [vheads // tp])  # QwenGatedDeltaNetAttention: torch.float32
            em.param(f"{a}.norm.weight", BF16, [vdim])
            em.linear(f"{a}.out_proj", value // tp, [h])
        else:
            _attention(em, p, t, h, gate=bool(t.get("attn_output_gate", True)))
        em.linear(f"{p}.mlp.gate", h, [e])
        em.linear(f"{p}.mlp.shared_expert_gate", h, [1], quant_config=False)
        em.linear(f"{p}.mlp.shared_expert.gate_up_proj", h, [shared // tp, shared // tp])
        em.linear(f"{p}.mlp.shared_expert.down_proj", shared // tp, [h])
        em.experts(f"{p}.mlp.experts", e, t["moe_intermediate_size"], h)
        em.param(f"{p}.input_layernorm.weight", BF16, [h])
        em.param(f"{p}.post_attention_layernorm.weight", BF16, [h])
    em.param(f"{root}.norm.weight", BF16, [h])
    em.param("language_model.lm_head.weight", BF16, [v // tp, h])


def vllm_parameters(
    config: dict[str, Any], quant: dict[str, Any] | None, *, tp: int = 1, ep: int = 1, unchecked: bool = False
) -> list:
    """The parameters (name, dtype, load-time shape) vLLM creates for ``config`` under ``quant``
    (``unchecked``: without Fp8MoEMethod's I/tp % 128 check, which the adapter must then make)."""
    if model_type_of(config) == "qwen3_moe":
        packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        em = _Emitter(quant, packed, lambda n: n, tp, ep)
        em.unchecked = unchecked
        _qwen3_moe(em, config)
    else:
        packed = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
            "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
            "in_proj_ba": ["in_proj_b", "in_proj_a"],
        }
        em = _Emitter(quant, packed, _hf_to_vllm, tp, ep)
        em.unchecked = unchecked
        _qwen3_5_moe(em, config)
    return em.out


def _routed(params: list) -> list:
    """vLLM 0.33.0's names: a MoE layer's parameters live on ``experts.routed_experts``."""
    return [[n.replace(".mlp.experts.", ".mlp.experts.routed_experts."), d, s] for n, d, s in params]


def _transcription(model_type: str, version: str = PRE_ROUTED) -> dict[str, Any]:
    config = json.loads(CONFIGS[model_type].read_text())
    spec = RefitSpec(model_type=model_type, fmt="block_fp8")
    quant = av.vllm_engine_args(spec, config)["hf_overrides"]["quantization_config"]
    params = vllm_parameters(config, quant)
    extra = SOURCES_0_33 if version == VLLM_0_33 else []
    return {
        "what": f"vLLM parameters (name, dtype, load-time shape) for {CONFIGS[model_type].name}, block-FP8, tp=1",
        "engine_version": version,
        "source": SOURCES[model_type] + SOURCES["common"] + extra,
        "config": f"tests/data/{CONFIGS[model_type].name}",
        "tp_size": 1,
        "ep_size": 1,
        "quantization_config": quant,
        "parameters": _routed(params) if version == VLLM_0_33 else params,
    }


def _dump(doc: dict[str, Any]) -> str:
    head = {k: v for k, v in doc.items() if k != "parameters"}
    rows = ",\n".join("  " + json.dumps(p) for p in doc["parameters"])
    return json.dumps(head, indent=1)[:-2] + ',\n "parameters": [\n' + rows + "\n ]\n}\n"


def regenerate() -> None:
    MANIFESTS.mkdir(parents=True, exist_ok=True)
    for (model_type, version), path in TRANSCRIBED.items():
        path.write_text(_dump(_transcription(model_type, version)))
        print(f"wrote {path}")


# --------------------------------------------------------------------------------------------------
# helpers


def _config(model_type: str) -> dict[str, Any]:
    return json.loads(CONFIGS[model_type].read_text())


def _quant(spec: RefitSpec, config: dict[str, Any]) -> dict[str, Any] | None:
    return av.vllm_engine_args(spec, config).get("hf_overrides", {}).get("quantization_config")


def diff(manifest, plan) -> list[str]:
    """What the attach check compares: names, dtypes and shapes (MTP layers aside: vLLM's main
    model skips ``mtp.``; a draft model would take them)."""
    want = {o.name: (o.dtype, o.shape) for o in plan.outputs if not o.name.startswith("mtp.")}
    have = {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors}
    out = [f"engine expects {n}, not published" for n in sorted(have.keys() - want.keys())]
    out += [f"published {n}, engine does not take it" for n in sorted(want.keys() - have.keys())]
    for n in sorted(have.keys() & want.keys()):
        if have[n] != want[n]:
            (hd, hs), (wd, ws) = have[n], want[n]
            out.append(f"{n}: engine {dtype_name(hd)} {list(hs)}, published {dtype_name(wd)} {list(ws)}")
    return out


def _manifest(config, spec=None, quant=None, **kw):
    quant = _quant(spec, config) if quant is None else quant
    return av.build_manifest(vllm_parameters(config, quant, **kw), config, quant, **kw)


def _small(model_type: str, **kw) -> dict[str, Any]:
    return make_hf_config(model_type, num_layers=kw.pop("num_layers", 2), num_experts=2, **kw)


# --------------------------------------------------------------------------------------------------
# import surface


def test_import_works_without_vllm_and_the_extension_says_it_needs_it():
    """Importing the adapter never imports vLLM; calling into the engine side without it is a clear
    ImportError, not an AttributeError deep inside."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert "vllm" not in sys.modules
    ext = av.RefitWorkerExtension()
    for call in (lambda: ext.refit_attach("ipc:///nowhere"), lambda: ext.refit_load(0), ext.refit_manifest):
        with pytest.raises(ImportError, match=r"needs vLLM installed"):
            call()
    assert "vllm" not in sys.modules


# --------------------------------------------------------------------------------------------------
# transcribed manifests == the plan


@pytest.mark.parametrize(("model_type", "version"), sorted(TRANSCRIBED))
def test_stored_transcriptions_are_current(model_type, version):
    """The JSON files are the generator's output, and name their sources and vLLM version."""
    stored = json.loads(TRANSCRIBED[model_type, version].read_text())
    assert stored == json.loads(_dump(_transcription(model_type, version)))
    assert all("vllm/" in s for s in stored["source"])
    assert stored["engine_version"] == version
    routed = [p[0] for p in stored["parameters"] if ".mlp.experts.routed_experts." in p[0]]
    assert bool(routed) == (version == VLLM_0_33)


@pytest.mark.parametrize(("model_type", "version"), sorted(TRANSCRIBED))
def test_transcribed_engine_holds_exactly_what_the_plan_publishes(model_type, version):
    """Block-FP8, the real configs, every vLLM version kept: build_manifest over vLLM's parameters
    equals the plan's outputs (names, dtypes, global shapes), so the attach check passes."""
    doc, config = json.loads(TRANSCRIBED[model_type, version].read_text()), _config(model_type)
    manifest = av.build_manifest(doc["parameters"], config, doc["quantization_config"])
    plan = plan_from_hf_config(config, RefitSpec(model_type=model_type, fmt="block_fp8"))
    assert diff(manifest, plan) == []
    assert manifest.expert_format is Format.BLOCK_FP8
    assert manifest.moe_backend == "Fp8MoEMethod"
    assert manifest.info["keep_bf16"] == []
    assert av.check_vllm_constraints(manifest, plan) == []
    n_layers = get_model(model_type).num_hidden_layers(config)
    scales = [t for t in manifest.tensors if t.name.endswith(".weight_scale_inv")]
    experts = _config(model_type).get("num_experts") or config["text_config"]["num_experts"]
    assert len(scales) == n_layers * experts * 3


@pytest.mark.parametrize("fmt", ["block_fp8", "fp8_per_tensor", "mxfp8", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_every_format_and_bf16_layer_choice_matches_the_plan(model_type, fmt):
    """Small configs, every format, first/last layers and a pattern kept BF16: the engine that
    vllm_engine_args configures matches the plan with no keep_bf16 from the manifest needed."""
    config = _small(model_type, num_layers=4)
    spec = RefitSpec(
        model_type=model_type,
        fmt=fmt,
        num_first_layers_in_bf16=1,
        num_last_layers_in_bf16=1,
        ignore_patterns=("*layers.2.mlp.experts*",),
    )
    manifest = _manifest(config, spec)
    assert manifest.expert_format is Format.parse(fmt)
    assert diff(manifest, plan_from_hf_config(config, spec)) == []
    if fmt != "bf16":
        assert {m.split(".mlp.")[0].rsplit(".", 1)[-1] for m in av.routed_bf16_modules(manifest)} == {
            "0",
            "2",
            "3",
        }


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_tensor_and_expert_parallel_workers_send_the_global_manifest(model_type):
    """tp=2 (experts split along I) and ep=2 (experts split across ranks): same global tensors."""
    config = _config(model_type)
    spec = RefitSpec(model_type=model_type, fmt="block_fp8")
    one = _manifest(config, spec)
    for kw in ({"tp": 2}, {"tp": 2, "ep": 2}):
        quant = _quant(spec, config)
        params = vllm_parameters(config, quant, **kw)
        many = av.build_manifest(params, config, quant, tp_size=kw["tp"], ep_size=kw.get("ep", 1))
        assert many.tensors == one.tensors
        assert many.info["moe_tp_size"] == (1 if kw.get("ep", 1) > 1 else kw["tp"])


def test_newer_vllm_names_and_lora_base_layer_map_the_same():
    """``experts.routed_experts.w13_weight`` (RoutedExperts) and LoRA's ``base_layer.`` infix."""
    config = _small("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    params = vllm_parameters(config, quant)
    renamed = [
        [n.replace(".experts.", ".experts.routed_experts.").replace(".o_proj.", ".o_proj.base_layer."), d, s]
        for n, d, s in params
    ]
    assert (
        av.build_manifest(renamed, config, quant).tensors == av.build_manifest(params, config, quant).tensors
    )


# --------------------------------------------------------------------------------------------------
# mismatches


def test_attention_quantized_by_the_engine_is_listed():
    """The engine was started with attention left out of ignored_layers: it wants FP8 q/k/v/o and
    their scales where the plan publishes BF16."""
    config = {**_small("qwen3_moe", num_layers=1), "num_key_value_heads": 4}  # k/v rows 128-aligned
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    quant = {**quant, "ignored_layers": [n for n in quant["ignored_layers"] if ".self_attn." not in n]}
    manifest = _manifest(config, quant=quant)
    p = "model.layers.0.self_attn"
    shapes = {"q_proj": [128, 128], "k_proj": [128, 128], "v_proj": [128, 128], "o_proj": [128, 128]}
    expected = [f"engine expects {p}.{proj}.weight_scale_inv, not published" for proj in sorted(shapes)]
    expected += [
        f"{p}.{proj}.weight: engine float8_e4m3fn {s}, published bfloat16 {s}"
        for proj, s in sorted(shapes.items())
    ]
    assert diff(manifest, plan_from_hf_config(config, spec)) == expected


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_one_layers_experts_held_bf16_by_the_engine(model_type):
    """The engine keeps layer 1's experts BF16 though the spec does not: every one of that layer's
    published FP8 tensors is refused, and the BF16 forms the engine wants (per-expert names for
    Qwen3, the grouped slabs for Qwen3.5) are missing. With the manifest's keep_bf16 the plan
    matches again: the manifest wins."""
    config = _small(model_type)
    spec = RefitSpec(model_type=model_type, fmt="block_fp8")
    quant = _quant(spec, config)
    root = "model" if model_type == "qwen3_moe" else "model.language_model"
    moe = f"{root}.layers.1.mlp.experts"
    manifest = _manifest(config, quant={**quant, "ignored_layers": [*quant["ignored_layers"], moe]})
    plan = plan_from_hf_config(config, spec)
    if model_type == "qwen3_moe":
        wanted = [f"{moe}.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
        expected = [f"published {m}.weight_scale_inv, engine does not take it" for m in sorted(wanted)]
        expected += [
            f"{m}.weight: engine bfloat16 {s}, published float8_e4m3fn {s}"
            for m, s in sorted((m, [128, 128]) for m in wanted)
        ]
    else:
        wanted = [f"{moe}.down_proj", f"{moe}.gate_up_proj"]
        expected = [f"engine expects {m}, not published" for m in wanted]
        expected += [
            f"published {moe}.{e}.{p}.{leaf}, engine does not take it"
            for e in range(2)
            for p in ("down_proj", "gate_proj", "up_proj")
            for leaf in ("weight", "weight_scale_inv")
        ]
    assert diff(manifest, plan) == expected
    assert av.routed_bf16_modules(manifest) == sorted(wanted)
    kept = plan_from_hf_config(config, spec, keep_bf16=av.routed_bf16_modules(manifest))
    assert diff(manifest, kept) == []


def test_unmappable_engine_parameters_are_refused_together():
    config = _small("qwen3_moe", num_layers=1)
    quant = _quant(RefitSpec(model_type="qwen3_moe", fmt="block_fp8"), config)
    params = vllm_parameters(config, quant)
    params += [
        ["model.layers.0.mlp.mystery.weight", BF16, [4, 4]],
        ["model.layers.0.self_attn.wqkv.weight", BF16, [4]],
    ]
    with pytest.raises(ValueError) as err:
        av.build_manifest(params, config, quant)
    assert "model.layers.0.mlp.mystery.weight" in str(err.value) and "wqkv" in str(err.value)


def test_a_wrong_parallel_layout_is_refused():
    """Parameters of a tp=2 engine described as tp=1: the experts' I is half the checkpoint's."""
    config = _small("qwen3_moe", num_layers=1)
    params = vllm_parameters(config, None, tp=2)
    with pytest.raises(ValueError, match=r"engine holds I=64, H=128; the checkpoint has \(128, 128\)"):
        av.build_manifest(params, config, None, tp_size=1)
    assert av.build_manifest(params, config, None, tp_size=2).tensors == _manifest(config, quant={}).tensors


def test_kv_cache_scales_and_tied_lm_head_are_not_expected():
    config = {**_small("qwen3_moe", num_layers=1), "tie_word_embeddings": True}
    params = vllm_parameters(config, None)
    params += [["model.layers.0.self_attn.attn.k_scale", F32, []], ["lm_head.weight", BF16, [256, 128]]]
    names = {t.name for t in av.build_manifest(params, config, None).tensors}
    assert "lm_head.weight" not in names and not any("k_scale" in n for n in names)


# --------------------------------------------------------------------------------------------------
# the quantization config and the engine arguments


def test_resolve_quant_from_dicts_and_resolved_classes():
    assert av.resolve_quant(None).fmt is Format.BF16
    assert (
        av.resolve_quant({"quant_method": "fp8", "activation_scheme": "dynamic"}).fmt is Format.FP8_PER_TENSOR
    )
    block = av.resolve_quant(
        {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["x"]}
    )
    assert (block.fmt, block.ignored) == (Format.BLOCK_FP8, ("x",))
    assert (
        av.resolve_quant({"quant_method": "modelopt", "quant_algo": "mxfp8", "ignore": ["a"]}).fmt
        is Format.MXFP8
    )
    legacy = {"quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8", "exclude_modules": ["b"]}}
    assert av.resolve_quant(legacy).ignored == ("b",)
    with pytest.raises(ValueError, match="128x128"):
        av.resolve_quant({"quant_method": "fp8", "weight_block_size": [1, 128]})
    nvfp4 = av.resolve_quant({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["x"]})
    assert (nvfp4.fmt, nvfp4.ignored, nvfp4.static_activations) == (Format.NVFP4, ("x",), True)
    with pytest.raises(ValueError, match="W4A8_AWQ"):
        av.resolve_quant({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"})
    with pytest.raises(ValueError, match="compressed-tensors"):
        av.resolve_quant({"quant_method": "compressed-tensors", "format": "pack-quantized"})

    Fp8Config = type(
        "Fp8Config",
        (),
        {"weight_block_size": [128, 128], "ignored_layers": ["y"], "activation_scheme": "dynamic"},
    )
    ModelOptMxFp8Config = type("ModelOptMxFp8Config", (), {"exclude_modules": ["z"]})
    AWQConfig = type("AWQConfig", (), {})
    assert av.resolve_quant(Fp8Config()).fmt is Format.BLOCK_FP8
    assert av.resolve_quant(ModelOptMxFp8Config()).ignored == ("z",)
    with pytest.raises(ValueError, match="AWQConfig"):
        av.resolve_quant(AWQConfig())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_engine_args_use_only_keys_vllm_reads(model_type):
    config = _config(model_type)
    for fmt in ("block_fp8", "fp8_per_tensor", "mxfp8", "bf16"):
        args = av.vllm_engine_args(RefitSpec(model_type=model_type, fmt=fmt), config)
        assert set(args) <= ENGINE_ARG_KEYS and args["quantization"] in QUANTIZATION_NAMES
        assert (
            args["load_format"] == "dummy"
            and args["worker_extension_cls"] == "adapters.vllm.RefitWorkerExtension"
        )
        qc = args.get("hf_overrides", {}).get("quantization_config")
        if fmt == "bf16":
            assert qc is None
        elif fmt == "mxfp8":
            assert set(qc) <= MODELOPT_CONFIG_KEYS and qc["quant_algo"] == "MXFP8"
        else:
            assert set(qc) <= FP8_CONFIG_KEYS and qc["activation_scheme"] in FP8_ACTIVATION_SCHEMES
            assert qc["activation_scheme"] == "dynamic"  # block-FP8 requires it (Fp8Config.__init__)
            assert qc.get("weight_block_size") == ([128, 128] if fmt == "block_fp8" else None)
    assert av.VLLM_ENV == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}


def test_ignored_layers_list_what_the_plan_keeps_bf16():
    config = _config("qwen3_5_moe")
    spec = RefitSpec(
        model_type="qwen3_5_moe", fmt="block_fp8", num_first_layers_in_bf16=1, num_last_layers_in_bf16=2
    )
    ignored = set(_quant(spec, config)["ignored_layers"])
    p = "model.language_model.layers"
    for module in (
        f"{p}.0.linear_attn.in_proj_qkv",
        f"{p}.0.linear_attn.in_proj_b",
        f"{p}.3.self_attn.q_proj",
        f"{p}.3.self_attn.o_proj",
        f"{p}.5.mlp.gate",
        f"{p}.5.mlp.shared_expert.up_proj",
        f"{p}.5.mlp.shared_expert_gate",
        "model.language_model.embed_tokens",
        "lm_head",
        "model.visual.blocks.0.mlp.linear_fc1",
        f"{p}.0.mlp.experts",
        f"{p}.38.mlp.experts",
        f"{p}.39.mlp.experts",
    ):
        assert module in ignored, module
    assert {n for n in ignored if n.endswith(".experts")} == {f"{p}.{i}.mlp.experts" for i in (0, 38, 39)}
    assert not any("norm" in n.rsplit(".", 1)[-1] for n in ignored)
    assert {"mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.mlp.gate"} <= ignored  # a draft model's
    assert "mtp.layers.0.mlp.experts" not in ignored  # MTP experts are quantized (not counted by first/last)


def test_an_ignore_pattern_splitting_a_layer_is_refused():
    config = _small("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8", ignore_patterns=("*.experts.0.*",))
    with pytest.raises(ValueError, match="all in BF16 or all quantized"):
        av.vllm_engine_args(spec, config)


# --------------------------------------------------------------------------------------------------
# constraints (SPEC §2.4)


def test_block_fp8_needs_i_per_rank_aligned_to_128_or_refinable():
    """Qwen3-30B-A3B: I = 768 splits into 384 (tp=2, aligned), 192 (tp=4) and 96 (tp=8): vLLM 0.33.0
    refines the 128-block to gcd(128, I/tp, H) = 64 / 32 and loads them; 48 (tp=16) refines to 16,
    below the 32 vLLM accepts (Fp8MoEMethod.create_weights then raises)."""
    config = _config("qwen3_moe")
    quant = _quant(RefitSpec(model_type="qwen3_moe", fmt="block_fp8"), config)
    base = av.build_manifest(vllm_parameters(config, quant), config, quant)
    for tp, ok in ((2, True), (4, True), (8, True), (16, False)):
        manifest = _with_tp(base, tp)
        problems = av.check_vllm_constraints(manifest, config)
        assert (problems == []) is ok, problems
    assert "768/16 = 48" in av.check_vllm_constraints(_with_tp(base, 16), config)[0]


def test_block_fp8_tp2_with_i_128_attaches_and_a_ragged_i_is_refused():
    """Finding 6 (issue 25): vLLM 0.33.0 refines the block (oracle/fp8.py
    resolve_fp8_moe_weight_block_shape) and upsamples scales at load, so tp 2 with I = 128 loads
    (tests/test_engine_vllm_models.py runs it); the old rule refused it. A whole I that is not a
    multiple of 128 still fails inside vLLM: refused at every tp."""
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    small = make_hf_config("qwen3_moe", num_layers=1, num_experts=2, hidden=256, intermediate=128)
    base = _manifest(small, spec)
    assert av.check_vllm_constraints(_with_tp(base, 2), small) == []
    ragged = make_hf_config("qwen3_moe", num_layers=1, num_experts=2, hidden=256, intermediate=192)
    q = _quant(spec, ragged)
    ragged_manifest = av.build_manifest(vllm_parameters(ragged, q, unchecked=True), ragged, q)
    for tp in (1, 2):
        problems = av.check_vllm_constraints(_with_tp(ragged_manifest, tp), ragged)
        assert len(problems) == 1 and "moe_intermediate_size = 192" in problems[0], problems


def _with_tp(manifest, tp):
    from dataclasses import replace

    return replace(
        manifest,
        constraints=replace(manifest.constraints, moe_tp_size=tp),
        info={**manifest.info, "tp_size": tp, "moe_tp_size": tp},
    )


def test_mxfp8_needs_h_and_i_aligned_to_32():
    good = _small("qwen3_moe", unaligned=True)  # H=160, I=96: multiples of 32, not of 128
    spec = RefitSpec(model_type="qwen3_moe", fmt="mxfp8")
    manifest = _manifest(good, spec)
    assert av.check_vllm_constraints(manifest, plan_from_hf_config(good, spec)) == []
    bad = _small("qwen3_moe", hidden=144, intermediate=48)
    problems = av.check_vllm_constraints(manifest, bad)
    assert len(problems) == 2 and "hidden_size = 144" in problems[0] and "= 48" in problems[1]


def test_static_activation_scales_are_a_problem():
    config = _small("qwen3_moe", num_layers=1)
    quant = {
        **_quant(RefitSpec(model_type="qwen3_moe", fmt="fp8_per_tensor"), config),
        "activation_scheme": "static",
    }
    params = vllm_parameters(config, quant)
    params += [[f"model.layers.0.mlp.experts.{w}_input_scale", F32, [2]] for w in ("w13", "w2")]
    manifest = av.build_manifest(params, config, quant)
    assert any("static activation scales" in p for p in av.check_vllm_constraints(manifest, config))


# --------------------------------------------------------------------------------------------------
# loading and the driver side, with stand-ins for vLLM's objects


def test_generation_goes_through_reload_weights_slabs_last():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: its layerwise reload would be used")
    seen = []
    runner = SimpleNamespace(
        model=None, reload_weights=lambda weights_iterator: seen.extend(n for n, _ in weights_iterator)
    )
    tensors = {
        "model.language_model.layers.0.mlp.experts.gate_up_proj": torch.zeros(1),
        "model.language_model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(1),
        "model.language_model.layers.0.mlp.experts.down_proj": torch.zeros(1),
        "lm_head.weight": torch.zeros(1),
    }
    av.load_generation(SimpleNamespace(model_runner=runner), tensors, Format.BLOCK_FP8)
    assert seen[-2:] == [
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.0.mlp.experts.down_proj",
    ]
    assert len(seen) == 4


def test_without_layerwise_reload_fp8_is_refused_and_bf16_loads():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    loaded = []
    model = SimpleNamespace(load_weights=lambda w: loaded.extend(n for n, _ in w))
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    with pytest.raises(RefitError, match="no layerwise reload"):
        av.load_generation(worker, {"a.weight": torch.zeros(1)}, Format.BLOCK_FP8)
    av.load_generation(worker, {"a.weight": torch.zeros(1)}, Format.BF16)
    assert loaded == ["a.weight"]


def test_deep_gemm_e8m0_is_reported_and_refused_for_block_fp8():
    """Defect 6: the manifest carries vLLM's is_deep_gemm_e8m0_used(); when it is on, block scales would
    be rounded to UE8M0, so the check refuses and names VLLM_USE_DEEP_GEMM_E8M0=0."""
    config = _small("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    params = vllm_parameters(config, quant)
    for flag, refused in ((True, True), (False, False), (None, False)):
        manifest = av.build_manifest(params, config, quant, deep_gemm_e8m0=flag)
        assert manifest.info["deep_gemm_e8m0"] is flag
        problems = av.check_vllm_constraints(manifest, config)
        assert bool(problems) is refused, problems
        if refused:
            assert "VLLM_USE_DEEP_GEMM_E8M0=0" in problems[0] and "is_deep_gemm_e8m0_used" in problems[0]
    per_tensor = RefitSpec(model_type="qwen3_moe", fmt="fp8_per_tensor")
    q = _quant(per_tensor, config)
    manifest = av.build_manifest(vllm_parameters(config, q), config, q, deep_gemm_e8m0=True)
    assert av.check_vllm_constraints(manifest, config) == []  # no block scales to round


def test_daemon_attach_check_reads_the_moe_tp_size_vllm_writes():
    """The daemon's constraint check read ``tp_size`` while the vLLM manifest writes ``moe_tp_size``:
    per-rank alignment was never checked for vLLM engines."""
    from dataclasses import replace

    from sidecar.plan.attach import check_manifest

    config = _config("qwen3_moe")  # I = 768: 48 per rank at moe_tp = 16 neither aligned nor refinable
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    base = _manifest(config, spec)
    assert base.constraints.moe_tp_size == 1
    plan = plan_from_hf_config(config, spec)
    assert check_manifest(plan.inputs, spec, base).ok
    sixteen = replace(base, constraints=replace(base.constraints, moe_tp_size=16))
    errors = check_manifest(plan.inputs, spec, sixteen).errors
    assert errors and all("768/16 = 48 to be a multiple of 128" in e for e in errors), errors


def test_tp16_qwen3_30b_a3b_vllm_worker_is_refused_in_block_fp8_by_adapter_and_daemon():
    """Issue 12's bug: a vLLM worker whose I/tp breaks the block rule attached in block-FP8. (Issue 12
    used TP=4, I/tp = 192; vLLM 0.33.0 refines that block to 64 and loads it, so this uses TP=16,
    I/tp = 48, which it cannot.) Built from the parameters vLLM creates at that tp, the
    manifest is refused by the adapter's check (what EngineWorker.attach runs, before any socket) and,
    were that skipped, by the daemon's attach check: both name the settings that would work."""
    from adapters.engine import EngineWorker
    from sidecar.plan.attach import check_manifest

    config = _config("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    params = vllm_parameters(config, quant, tp=16, unchecked=True)
    manifest = av.build_manifest(params, config, quant, tp_size=16)
    assert manifest.constraints.moe_tp_size == 16 and manifest.constraints.intermediate_size == 768

    adapter = av.check_vllm_constraints(manifest)  # what the manifest recorded, no config needed
    assert len(adapter) == 1 and "768/16 = 48 to be a multiple of 128" in adapter[0], adapter
    assert "tensor_parallel_size" in adapter[0] and "enable_expert_parallel=True" in adapter[0]
    worker = EngineWorker(
        "ipc:///nonexistent/refitd.sock",
        name="vllm-rank0",
        manifest=manifest,
        load=lambda gen: None,
        check=av.check_vllm_constraints,
    )
    with pytest.raises(RefitError, match="768/16 = 48") as info:
        worker.attach(timeout=1.0)
    assert info.value.kind is ErrorKind.ENGINE and worker.reader is None

    daemon = check_manifest(plan_from_hf_config(config, spec).inputs, spec, manifest)
    assert not daemon.ok and daemon.errors
    assert all("768/16 = 48 to be a multiple of 128" in e for e in daemon.errors), daemon.errors[:3]
    assert "enable_expert_parallel=True" in daemon.message("vllm-rank0")

    # the same engine with expert parallelism keeps I whole: accepted by both
    ep = av.build_manifest(vllm_parameters(config, quant, ep=4), config, quant, tp_size=4, ep_size=4)
    assert av.check_vllm_constraints(ep) == []
    assert check_manifest(plan_from_hf_config(config, spec).inputs, spec, ep).ok


def test_a_running_daemon_refuses_a_tp4_vllm_worker_that_skipped_its_own_check(daemons):
    """The daemon's half of the fix, over its control socket: a vLLM worker whose experts split I = 768
    sixteen ways (48 per rank) attaches to a block-FP8 daemon with the adapter's check bypassed; the
    daemon's attach check refuses it, naming the setting to change, and the worker is not attached."""
    from adapters.engine import EngineWorker

    config = make_hf_config("qwen3_moe", num_layers=1, num_experts=2, hidden=256, intermediate=768)
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    manifest = av.build_manifest(
        vllm_parameters(config, quant, tp=16, unchecked=True), config, quant, tp_size=16
    )
    d = daemons(hf_config=config, format="block_fp8")
    worker = EngineWorker(
        d.endpoint, name="vllm-rank0", manifest=manifest, load=lambda g: None, check=lambda m: []
    )
    with pytest.raises(RefitError) as info:
        worker.attach(timeout=30)
    text = str(info.value)
    assert "768/16 = 48 to be a multiple of 128" in text and "enable_expert_parallel=True" in text, text
    worker.detach()
    assert d.status()["readers"] == []  # the refused worker never counted as attached


def test_engine_worker_refuses_a_vllm_or_trtllm_manifest_without_its_adapters_check():
    """The adapter's own check is not optional: an EngineWorker for a vLLM manifest built without
    ``check=`` refuses to attach (a TypeError naming the check) instead of skipping the engine's rules."""
    from adapters.engine import EngineWorker

    config = _small("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    manifest = _manifest(config, spec)
    worker = EngineWorker("ipc:///nonexistent/refitd.sock", name="w", manifest=manifest, load=lambda g: None)
    with pytest.raises(TypeError, match="pass check=check_vllm_constraints"):
        worker.attach(timeout=1.0)
    assert worker.reader is None


def test_engine_worker_runs_the_shared_constraints_for_an_engine_without_its_own_check():
    """A reference-engine manifest carrying constraints is checked by EngineWorker.attach with the
    shared EngineConstraints rule, before any socket is opened."""
    from adapters.engine import EngineWorker
    from sidecar.protocol.manifest import EngineConstraints, EngineKind, Manifest

    constraints = EngineConstraints(
        engine=EngineKind.REFERENCE,
        expert_format=Format.BLOCK_FP8,
        intermediate_size=768,
        moe_tp_size=4,
        block_fp8_align=128,
    )
    manifest = Manifest(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format=Format.BLOCK_FP8,
        tensors=(),
        constraints=constraints,
    )
    worker = EngineWorker(
        "ipc:///nonexistent/refitd.sock", name="ref0", manifest=manifest, load=lambda g: None
    )
    with pytest.raises(RefitError, match=r"ref0: this reference engine cannot take (.|\n)*768/4 = 192"):
        worker.attach(timeout=1.0)
    assert worker.reader is None


def test_engine_worker_runs_the_adapters_check_before_contacting_the_daemon():
    """A refusal by the adapter's own check comes before any socket is opened, listing every problem."""
    from adapters.engine import EngineWorker

    config = _small("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    manifest = av.build_manifest(
        vllm_parameters(config, _quant(spec, config)), config, _quant(spec, config), deep_gemm_e8m0=True
    )
    worker = EngineWorker(
        "ipc:///nonexistent/refitd.sock",
        name="vllm-rank0",
        manifest=manifest,
        load=lambda gen: None,
        check=lambda m: av.check_vllm_constraints(m, config),
    )
    with pytest.raises(RefitError, match="vllm-rank0: this vllm engine cannot take") as info:
        worker.attach(timeout=1.0)
    assert "VLLM_USE_DEEP_GEMM_E8M0=0" in str(info.value) and worker.reader is None


def test_live_parameter_fallback_is_named_in_the_attach_refusal():
    """Defect 5: a manifest read from live (post-processing) parameters says so, and a refusal says
    the mismatch may be spurious."""
    config = _small("qwen3_moe")
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    live = av.build_manifest(vllm_parameters(config, quant), config, quant, param_source=av.PARAM_SOURCE_LIVE)
    assert "live, post-processing parameters" in av.fallback_note(live)
    recorded = av.build_manifest(
        vllm_parameters(config, quant), config, quant, param_source=av.PARAM_SOURCE_LAYERWISE
    )
    assert av.fallback_note(recorded) == ""


def test_docs_vllm_refusals_are_what_the_check_says():
    """docs/engines.md's vLLM refusal table, row by row: the condition refuses, and the refusal names
    every setting of the table's last column."""
    import re

    doc = (Path(__file__).parent.parent / "docs" / "engines.md").read_text()
    table = doc.split("<!-- vllm-refusals:begin -->", 1)[1].split("<!-- vllm-refusals:end -->", 1)[0]
    rows = [line.split(" | ") for line in table.strip().splitlines()[2:]]
    small, real = _small("qwen3_moe"), _config("qwen3_moe")
    block = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    q = _quant(block, small)
    static_quant = {
        **_quant(RefitSpec(model_type="qwen3_moe", fmt="fp8_per_tensor"), small),
        "activation_scheme": "static",
    }
    static_params = vllm_parameters(small, static_quant) + [
        [f"model.layers.0.mlp.experts.{w}_input_scale", F32, [2]] for w in ("w13", "w2")
    ]
    mxfp8 = RefitSpec(model_type="qwen3_moe", fmt="mxfp8")
    triggers = [
        lambda: av.check_vllm_constraints(
            av.build_manifest(vllm_parameters(small, q), small, q, deep_gemm_e8m0=True), small
        ),
        lambda: av.check_vllm_constraints(_with_tp(_manifest(real, block), 16), real),
        lambda: av.check_vllm_constraints(
            _manifest(small, block), make_hf_config("qwen3_moe", num_layers=1, hidden=256, intermediate=192)
        ),
        lambda: av.check_vllm_constraints(
            _manifest(_small("qwen3_moe", unaligned=True), mxfp8),
            _small("qwen3_moe", hidden=144, intermediate=48),
        ),
        lambda: av.check_vllm_constraints(av.build_manifest(static_params, small, static_quant), small),
    ]
    assert len(rows) == len(triggers)
    for row, trigger in zip(rows, triggers, strict=True):
        problems = trigger()
        assert problems, row
        settings = re.findall(r"`([^`]+)`", row[2])
        assert settings and all(any(x in p for p in problems) for x in settings), (settings, problems)


def _module_from(params: list) -> torch.nn.Module:
    """A module tree holding ``params`` (name, dtype, shape) as meta tensors."""
    root = torch.nn.Module()
    for name, dtype, shape in params:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        meta = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        m.register_parameter(leaf, torch.nn.Parameter(meta, requires_grad=False))
    return root


def test_refit_attach_refusal_names_the_live_parameter_fallback(monkeypatch):
    """Defect 5 end to end in the worker extension: a vLLM without layerwise-reload metadata gives a
    manifest read from live parameters; the refusal (here: static activation scales, refused by the
    adapter's own check before the daemon is contacted) says so."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: its metadata would be used")
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.0-test"))
    config = _small("qwen3_moe", num_layers=1)
    quant = {
        **_quant(RefitSpec(model_type="qwen3_moe", fmt="fp8_per_tensor"), config),
        "activation_scheme": "static",
    }
    params = vllm_parameters(config, quant)
    params += [[f"model.layers.0.mlp.experts.{w}_input_scale", F32, [2]] for w in ("w13", "w2")]
    model = _module_from(params)
    ext = av.RefitWorkerExtension()
    ext.rank = 0
    ext.model_runner = SimpleNamespace(get_model=lambda: model)
    ext.model_config = SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: config))
    parallel = SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False)
    ext.vllm_config = SimpleNamespace(parallel_config=parallel, quant_config=quant)
    manifest = ext.refit_manifest()
    assert manifest.info["param_source"] == av.PARAM_SOURCE_LIVE and manifest.info["deep_gemm_e8m0"] is None
    with pytest.raises(RefitError, match="static activation scales") as info:
        ext.refit_attach("ipc:///nonexistent/refitd.sock", timeout=1.0)
    assert "read from the live, post-processing parameters" in str(info.value)


class _FakeLLM:
    def __init__(self, results):
        self.results, self.calls, self.resets = results, [], 0

    def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        return self.results

    def reset_prefix_cache(self):
        self.resets += 1


def test_refit_engine_checks_every_worker():
    ok = [{"worker": f"vllm-rank{r}", "step": 3, "ok": True, "seconds": 0.1} for r in range(2)]
    llm = _FakeLLM(ok)
    assert [r.worker for r in av.refit_engine(llm, min_step=3)] == ["vllm-rank0", "vllm-rank1"]
    assert llm.calls == [("refit_load", (3, None))] and llm.resets == 1
    bad = _FakeLLM([ok[0], {"worker": "vllm-rank1", "step": None, "ok": False, "error": "TimeoutError: x"}])
    with pytest.raises(RefitError, match="vllm-rank1: TimeoutError"):
        av.refit_engine(bad, min_step=3)
    assert bad.resets == 0
    with pytest.raises(RefitError, match="no engine worker"):
        av.refit_engine(_FakeLLM([]))


if __name__ == "__main__":
    regenerate()


# --------------------------------------------------------------------------------------------------
# issue 25: where the adapter disagreed with vLLM 0.33.0's real model classes (each found by
# tests/test_engine_vllm_models.py, which runs them; these tests need no vLLM)


def _deepseek_config(**kw) -> dict[str, Any]:
    """A tiny DeepSeek-V3 config.json (MLA with q_lora_rank, as DeepSeek-V3's own)."""
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 256,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_attention_heads": 2,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "num_nextn_predict_layers": 1,
        "topk_method": "noaux_tc",
        **kw,
    }


def test_deepseek_fused_qkv_a_proj_maps_to_its_two_checkpoint_shards():
    """Finding 1: DeepseekV2ForCausalLM packs fused_qkv_a_proj <- q_a_proj, kv_a_proj_with_mqa when
    q_lora_rank is set (deepseek_v2.py packed_modules_mapping / load_weights)."""
    config = _deepseek_config()
    params = [
        ("model.layers.0.self_attn.fused_qkv_a_proj.weight", BF16, [128 + 128 + 64, 256]),
        ("model.layers.1.mlp.gate.e_score_correction_bias", F32, [4]),
    ]
    manifest = av.build_manifest(params, config, None)
    got = {t.name: (t.dtype, t.shape) for t in manifest.tensors}
    assert got == {
        "model.layers.0.self_attn.q_a_proj.weight": (torch.bfloat16, (128, 256)),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (torch.bfloat16, (192, 256)),
        "model.layers.1.mlp.gate.e_score_correction_bias": (torch.float32, (4,)),
    }


def test_a_qwen3_moe_config_written_by_transformers_5_attaches():
    """Finding 2: transformers 5.x writes num_local_experts (Qwen3MoeConfig.attribute_map maps
    num_experts to it); the manifest, the engine arguments and the constraint check read it."""
    config = _small("qwen3_moe")
    hf5 = {k: v for k, v in config.items() if k != "num_experts"} | {
        "num_local_experts": config["num_experts"]
    }
    spec = RefitSpec(model_type="qwen3_moe", fmt="block_fp8")
    quant = _quant(spec, hf5)
    assert quant == _quant(spec, config)
    manifest = av.build_manifest(vllm_parameters(config, quant), hf5, quant)
    assert manifest.by_name() == _manifest(config, spec).by_name()
    assert av.check_vllm_constraints(manifest, hf5) == []


def test_qwen3_5_a_log_held_fp32_takes_the_bf16_a_trainer_sends():
    """Finding 4: vLLM holds Qwen3.5's A_log in FP32 (QwenGatedDeltaNetAttention) and its default
    loader upcasts the BF16 checkpoint tensor on copy, exactly: the manifest asks for BF16, and the
    daemon's plan (BF16 from the trainer) attaches."""
    from sidecar.plan.attach import check_manifest

    config = _config("qwen3_5_moe")
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
    quant = _quant(spec, config)
    params = vllm_parameters(config, quant)
    assert {d for n, d, _ in params if n.endswith(".A_log")} == {F32}
    manifest = av.build_manifest(params, config, quant)
    a_log = [t for t in manifest.tensors if t.name.endswith(".A_log")]
    assert a_log and all(t.dtype == torch.bfloat16 for t in a_log)
    assert check_manifest(plan_from_hf_config(config, spec).inputs, spec, manifest).ok


def test_text_only_qwen3_5_engine_is_started_language_model_only():
    """Finding 5: vLLM builds Qwen3.5's vision tower unless language_model_only=True; a text-only
    trainer sends no model.visual.*, so vllm_engine_args(include_vision=False) sets it (and keeps the
    vision linears unquantized: vLLM still constructs them before dropping the tower)."""
    config = _config("qwen3_5_moe")
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
    text_only = av.vllm_engine_args(spec, config, include_vision=False)
    assert text_only["language_model_only"] is True
    ignored = text_only["hf_overrides"]["quantization_config"]["ignored_layers"]
    assert any(n.startswith("model.visual.") for n in ignored)
    assert "language_model_only" not in av.vllm_engine_args(spec, config)
    assert "language_model_only" not in av.vllm_engine_args(
        RefitSpec(model_type="qwen3_moe", fmt="bf16"), _small("qwen3_moe")
    )


def test_the_mtp_drafters_parameters_map_to_their_checkpoint_names():
    """Finding 7: the drafter (get_draft_model()) is in the manifest under the names its load_weights
    takes: DeepSeekMTP's model.layers.N.mtp_block.X <- model.layers.N.X, Qwen3_5MoeMTP's model.X <- mtp.X
    (embedding and head shared with the target's checkpoint names)."""
    config = _deepseek_config()
    draft = [
        ("model.embed_tokens.weight", BF16, [256, 256]),
        ("model.layers.2.eh_proj.weight", BF16, [256, 512]),
        ("model.layers.2.mtp_block.mlp.experts.routed_experts.w13_weight", BF16, [4, 256, 256]),
        ("model.layers.2.mtp_block.mlp.experts.routed_experts.w2_weight", BF16, [4, 256, 128]),
    ]
    names = {t.name for t in av.build_manifest([], config, None, draft_params=draft).tensors}
    assert {"model.embed_tokens.weight", "model.layers.2.eh_proj.weight"} <= names
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in names
    qwen = _config("qwen3_5_moe")
    h = qwen["text_config"]["hidden_size"]
    draft = [
        ("model.embed_tokens.weight", BF16, [qwen["text_config"]["vocab_size"], h]),
        ("model.fc.weight", BF16, [h, 2 * h]),
        ("model.pre_fc_norm_hidden.weight", BF16, [h]),
        ("lm_head.weight", BF16, [qwen["text_config"]["vocab_size"], h]),
    ]
    names = {t.name for t in av.build_manifest([], qwen, None, draft_params=draft).tensors}
    assert names == {
        "model.language_model.embed_tokens.weight",
        "mtp.fc.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "lm_head.weight",
    }


def test_deepseek_mtp_head_is_excluded_under_the_prefix_vllm_builds_it_with():
    """Found running DeepSeekMTP for real: its SharedHead builds ``shared_head.head`` under the prefix
    ``model.layers.{N}.head``, the name ModelOpt's exclusion is matched against; without it the MTP
    head of an MXFP8 engine is quantized (no kernel on CPU; an MXFP8 head the plan never publishes on
    a GPU)."""
    config = _deepseek_config()
    spec = RefitSpec(model_type="deepseek_v3", fmt="mxfp8", num_hidden_layers=2)
    ignore = av.vllm_engine_args(spec, config)["hf_overrides"]["quantization_config"]["ignore"]
    assert "model.layers.2.shared_head.head" in ignore and "model.layers.2.head" in ignore


def test_deepseek_mtp_experts_are_not_counted_as_last_layers():
    """Part of finding 7: DeepSeek's MTP layer is model.layers.{num_hidden_layers}; the plan does not
    count MTP layers among the first/last BF16 layers, so the engine (its drafter) must not either."""
    config = _deepseek_config()
    spec = RefitSpec(model_type="deepseek_v3", fmt="block_fp8", num_hidden_layers=2)
    ignored = av.bf16_modules(spec, config)
    assert "model.layers.2.mlp.experts" not in ignored and "model.layers.1.mlp.experts" not in ignored
    last = RefitSpec(
        model_type="deepseek_v3", fmt="block_fp8", num_hidden_layers=2, num_last_layers_in_bf16=1
    )
    kept = av.bf16_modules(last, config)
    assert "model.layers.1.mlp.experts" in kept and "model.layers.2.mlp.experts" not in kept


# --------------------------------------------------------------------------------------------------
# against vLLM's real reload code (``make test-engines``): a toy module through vLLM 0.33.0's own
# initialize_layerwise_reload / finalize_layerwise_reload, set_current_vllm_config, get_layerwise_info
# and is_deep_gemm_e8m0_used, on CPU. Nothing of vLLM is stubbed; VLLM_TARGET_DEVICE=cpu is vLLM's own
# switch to its CPU platform (VllmConfig() needs a device type).

ENGINE_SKIP = "needs vLLM's reload package (vllm.model_executor.model_loader.reload): run `make test-engines`"
E, H, I2 = 2, 256, 256  # experts, hidden, 2 * intermediate: one 128-block per scale row/column pair


@pytest.fixture(scope="module")
def real_vllm():
    """vLLM's modules, or a skip naming ``make test-engines`` (a failure under REFITD_REQUIRE_ENGINES=1,
    which ``make test-engines`` sets: there the engine must run, not be skipped)."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        from vllm.config import VllmConfig, get_current_vllm_config
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    except ImportError as exc:
        missing("vLLM's reload package does not import", ENGINE_SKIP, exc)
    return SimpleNamespace(
        version=vllm.__version__,
        VllmConfig=VllmConfig,
        get_current_vllm_config=get_current_vllm_config,
        QuantizeMethodBase=QuantizeMethodBase,
        record_metadata_for_reloading=record_metadata_for_reloading,
    )


def _toy_model(v) -> torch.nn.Module:
    """A vLLM-shaped model: one block-FP8 MoE layer whose quant method reads the current vLLM config and
    changes a scale's shape in process_weights_after_loading (as kernel repacking does), and a BF16
    lm_head with vLLM's default loader. Checkpoint names as refitd publishes them."""

    class ToyFp8MoEMethod(v.QuantizeMethodBase):
        processed = 0

        def create_weights(self, layer, *args, **kwargs):  # the layer creates its own (below)
            raise NotImplementedError

        def apply(self, layer, *args, **kwargs):
            raise NotImplementedError

        def process_weights_after_loading(self, layer):
            v.get_current_vllm_config()  # vLLM's methods read it; raises outside set_current_vllm_config
            type(self).processed += 1
            kernel = layer.w13_weight_scale_inv.data.transpose(1, 2).contiguous()
            layer.w13_weight_scale_inv = torch.nn.Parameter(kernel, requires_grad=False)

    def moe_loader(param, loaded_weight, shard_id, expert_id):
        rows = loaded_weight.shape[0]
        start = 0 if shard_id in ("w1", "w2") else rows
        param.data[expert_id].narrow(0, start, rows).copy_(loaded_weight)

    def default_loader(param, loaded_weight):
        param.data.copy_(loaded_weight)

    class ToyMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant_method = ToyFp8MoEMethod()
            for name, dtype, shape in (
                ("w13_weight", torch.float8_e4m3fn, (E, I2, H)),
                ("w13_weight_scale_inv", torch.float32, (E, I2 // 128, H // 128)),
            ):
                p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
                p.weight_loader = moe_loader
                self.register_parameter(name, p)

    class ToyModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.model.layers[0].mlp = torch.nn.Module()
            self.model.layers[0].mlp.experts = ToyMoE()
            self.lm_head = torch.nn.Module()
            self.lm_head.weight = torch.nn.Parameter(
                torch.zeros(4, H, dtype=torch.bfloat16), requires_grad=False
            )
            self.lm_head.weight.weight_loader = default_loader

        def load_weights(self, weights):
            """What a vLLM model's load_weights does: checkpoint name -> parameter + weight_loader."""
            experts = self.model.layers[0].mlp.experts
            for name, tensor in weights:
                if name == "lm_head.weight":
                    self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                    continue
                expert, proj, leaf = name.removeprefix("model.layers.0.mlp.experts.").split(".")
                param = getattr(experts, "w13_" + leaf)
                param.weight_loader(param, tensor, "w1" if proj == "gate_proj" else "w3", int(expert))

    return ToyModel()


def _toy_generation(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"lm_head.weight": torch.randn(4, H, generator=g).to(torch.bfloat16)}
    for e in range(E):
        for proj in ("gate_proj", "up_proj"):
            p = f"model.layers.0.mlp.experts.{e}.{proj}"
            out[f"{p}.weight"] = torch.randn(I2 // 2, H, generator=g).to(torch.float8_e4m3fn)
            out[f"{p}.weight_scale_inv"] = torch.rand(1, H // 128, generator=g) + 0.5
    return out


def _started_engine(v):
    """A toy engine as vLLM leaves it after start-up: metadata recorded at load-time shapes, then
    processed once (under the config, as vLLM's loader runs it)."""
    from vllm.config import set_current_vllm_config

    model, config = _toy_model(v), v.VllmConfig()
    v.record_metadata_for_reloading(model)
    with set_current_vllm_config(config):
        model.model.layers[0].mlp.experts.quant_method.process_weights_after_loading(
            model.model.layers[0].mlp.experts
        )
    runner = SimpleNamespace(get_model=lambda: model, model=None)  # .model unset: get_model() is the API
    worker = SimpleNamespace(
        model_runner=runner,
        device="cpu",
        vllm_config=config,
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    return model, worker


@pytest.mark.engine
def test_real_vllm_layerwise_reload_loads_every_generation(real_vllm):
    """Defect 1 against vLLM's code: load_generation runs initialize_layerwise_reload -> load_weights ->
    finalize_layerwise_reload under set_current_vllm_config, twice; each generation lands processed in
    the same kernel tensors (cudagraph references survive), processing once per layer per reload."""
    model, worker = _started_engine(real_vllm)
    experts = model.model.layers[0].mlp.experts
    kernel_w13, kernel_scale = experts.w13_weight, experts.w13_weight_scale_inv
    assert tuple(kernel_scale.shape) == (E, H // 128, I2 // 128)  # processed: transposed
    method = type(experts.quant_method)
    for seed in (1, 2):
        before = method.processed
        gen = _toy_generation(seed)
        av.load_generation(worker, gen, Format.BLOCK_FP8)
        assert method.processed == before + 1
        assert experts.w13_weight is kernel_w13 and experts.w13_weight_scale_inv is kernel_scale
        for e in range(E):
            gate = gen[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"].float()
            up = gen[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].float()
            assert torch.equal(kernel_w13[e].float(), torch.cat([gate, up]))
            scales = torch.cat(
                [
                    gen[f"model.layers.0.mlp.experts.{e}.{p}.weight_scale_inv"]
                    for p in ("gate_proj", "up_proj")
                ]
            )
            assert torch.equal(kernel_scale[e], scales.t())
        assert torch.equal(model.lm_head.weight, gen["lm_head.weight"])


@pytest.mark.engine
def test_real_vllm_reload_outside_the_config_context_fails(real_vllm, monkeypatch):
    """The regression defect 1 fixes: without set_current_vllm_config, vLLM's get_current_vllm_config()
    raises inside process_weights_after_loading (vLLM PR #31747)."""
    import contextlib

    _, worker = _started_engine(real_vllm)
    monkeypatch.setattr(avw, "_config_context", lambda worker: contextlib.nullcontext())
    with pytest.raises(AssertionError, match="Current vLLM config is not set"):
        av.load_generation(worker, _toy_generation(3), Format.BLOCK_FP8)


@pytest.mark.engine
def test_real_vllm_manifest_reads_load_time_shapes(real_vllm):
    """Defect 5 against vLLM's code: the parameter list comes from vLLM's recorded load-time metadata
    (get_layerwise_info), not from the processed (transposed) scale; a model vLLM recorded nothing
    for falls back to the live parameters and says so. Defect 6: is_deep_gemm_e8m0_used() is read."""
    model, _ = _started_engine(real_vllm)
    params, source = av.engine_parameters_and_source(model)
    shapes = {n: s for n, _, s in params}
    assert source == av.PARAM_SOURCE_LAYERWISE
    assert shapes["model.layers.0.mlp.experts.w13_weight_scale_inv"] == (E, I2 // 128, H // 128)
    live, live_source = av.engine_parameters_and_source(_toy_model(real_vllm))
    assert live_source == av.PARAM_SOURCE_LIVE and len(live) == len(params)
    assert avw._deep_gemm_e8m0() is False  # CPU: no DeepGEMM
    assert real_vllm.version == "0.33.0"
