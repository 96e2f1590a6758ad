"""The SGLang adapter and ``refitd convert`` against SGLang 0.5.23's real classes on CPU (make test-sglang).

Tiny Qwen3-MoE and DeepSeek-V3 configs are written by transformers' own config classes. For each,
block-FP8: a BF16 checkpoint directory is converted by ``refitd convert`` (``convert_directory``);
SGLang's real ``DefaultModelLoader`` loads that directory (``load_format="auto"``): the oracle of what
every engine parameter must hold. A second SGLang model is built with ``load_format="dummy"``; a real
daemon (in a thread) publishes the same BF16 weights, and SGLang's real ``WeightUpdater`` runs
``begin_weight_update`` -> ``update_weights_from_tensor(control payload, load_format=LOADER)`` ->
``end_weight_update``: refitd's custom loader attaches with the manifest built from SGLang's own
parameters, waits for the generation and loads it. Every parameter is compared byte for byte with
the oracle's, twice (two steps), and every parameter object is kept. transformers 5.x loads the
converted directory too (``FineGrainedFP8Config(dequantize=True)``), and its dequantized weights are
checked against refitd's reference dequantization of the same bytes.

The only stand-ins are the two import shims of ``tests/support/sglang_cpu.py`` (nothing they
provide runs). ``make test`` skips these (no SGLang in .venv); ``make test-sglang`` fails on an
import error (REFITD_REQUIRE_ENGINES=1).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from adapters.sglang import LOADER, check_sglang_constraints, sglang_quantization_config
from adapters.sglang.driver import collect_results, cpu_tensor_pickling
from adapters.sglang.loader import control_tensors, detach_all, sglang_manifest
from sidecar.cli.convert import convert_directory
from sidecar.numerics.formats import Format
from sidecar.plan.models import get_model
from sidecar.plan.spec import RefitSpec
from tests.support.engines import missing
from tests.support.waiting import wait_until

SKIP = "SGLang is not installed here: run make test-sglang"


@pytest.fixture(scope="module")
def sgl():
    try:
        from tests.support import sglang_cpu

        sglang_cpu.import_sglang()
    except ImportError as exc:
        missing("SGLang does not import", SKIP, exc)
    return sglang_cpu


def _qwen3_moe() -> dict:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    return {**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}


ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


#: fields of DeepSeek-V3's own config.json that SGLang reads and transformers 5.x's to_dict() drops
DEEPSEEK_JSON = {
    "rope_scaling": ROPE,
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "ep_size": 1,
}


def _deepseek_v3() -> dict:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=256,
        num_nextn_predict_layers=0,
        rope_scaling=ROPE,
    )
    # DeepSeek-V3's own config.json spells YaRN as rope_scaling, which SGLang reads (transformers 5.x
    # writes rope_parameters); SGLang's non-CUDA rope supports only its deepseek_yarn
    return {**cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"], **DEEPSEEK_JSON}


CONFIGS = {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def _weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in get_model(config["model_type"]).parameters(config, include_mtp=False):
        out[name] = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    return out


def _checkpoint(
    tmp: Path, name: str, config: dict, weights: dict, fmt: Format, linears: bool = False
) -> Path:
    from safetensors.torch import save_file

    bf16 = tmp / f"{name}-bf16"
    bf16.mkdir()
    save_file(weights, str(bf16 / "model.safetensors"))
    (bf16 / "config.json").write_text(json.dumps(config))
    out = tmp / f"{name}-{fmt.value}"
    convert_directory(
        bf16, out, fmt, max_shard_bytes=1 << 20, quantize_linears=linears or None
    )  # several shards
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same_params(got: torch.nn.Module, want: torch.nn.Module) -> None:
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert sorted(g) == sorted(w)
    for name in w:
        assert (g[name].dtype, g[name].shape) == (w[name].dtype, w[name].shape), name
        assert torch.equal(_bytes(g[name]), _bytes(w[name])), f"{name} differs from SGLang's own load"


def _refit(updater, endpoint: str, step: int, reply: str, box: dict) -> None:
    """One SGLang weight-update session, as the scheduler runs it for the driver's three requests;
    the rank's load report lands in ``box`` (run in a thread: the loader waits for the step)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(reply)
    try:
        updater.begin_weight_update()
        control = control_tensors(endpoint, min_step=step, timeout=120, name="sglang-test", reply=reply)
        box["answer"] = updater.update_weights_from_tensor(named_tensors=control, load_format=LOADER)
        updater.end_weight_update(run_post_load=False)  # what the scheduler does after a loaded session
        (box["result"],) = collect_results(sock, 1, deadline=time.monotonic() + 60)
    finally:
        sock.close()


@pytest.mark.engine
@pytest.mark.parametrize(
    ("model_type", "fmt", "linears"),
    [
        ("qwen3_moe", Format.BLOCK_FP8, False),
        ("deepseek_v3", Format.BLOCK_FP8, False),
        ("deepseek_v3", Format.BLOCK_FP8, True),
    ],
)
def test_sglang_real_updater_loads_two_generations_byte_equal_to_sglangs_own_load(
    sgl, tmp_path, model_type, fmt, linears
):
    from sidecar.client.client import RefitClient
    from tests.support.daemons import RunningDaemon

    config = CONFIGS[model_type]()
    steps = {1: _weights(config, 1), 2: _weights(config, 2)}
    dirs = {s: _checkpoint(tmp_path, f"step{s}", config, w, fmt, linears) for s, w in steps.items()}
    written = json.loads((dirs[1] / "config.json").read_text())
    spec = RefitSpec(model_type=model_type, fmt=fmt, quantize_linears=linears or None)
    assert written["quantization_config"] == sglang_quantization_config(spec, config)

    engine = sgl.build_model(dirs[1], load_format="dummy")
    manifest = sglang_manifest(engine)
    assert manifest.expert_format is fmt and not check_sglang_constraints(manifest, config)
    names = {t.name for t in manifest.tensors}
    assert f"model.layers.1.mlp.experts.3.down_proj.{fmt.scale_suffix}" in names
    assert not any("routed_experts" in n for n in names)
    if model_type == "qwen3_moe":  # the router stays BF16 under Fp8Config
        gate = manifest.by_name()["model.layers.0.mlp.gate.weight"]
        assert gate.dtype == torch.bfloat16
    if linears:  # DeepSeek's fused q_a_proj + kv_a_proj_with_mqa held in block-FP8
        assert (
            manifest.by_name()["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype
            == torch.float8_e4m3fn
        )
        assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in names
    params = {n: id(p) for n, p in engine.named_parameters()}
    updater = sgl.weight_updater(engine)
    reply = f"ipc://{tmp_path}/reply.sock"
    (tmp_path / "daemon").mkdir()
    # the daemon runs on the converted checkpoint's config.json, as it would next to the engine
    daemon = RunningDaemon(tmp_path / "daemon", hf_config=written, format=fmt.value)
    client = RefitClient(daemon.endpoint, 0, 1, timeout=120)
    try:
        for step, weights in steps.items():
            # the real order: the engine's refit starts (it attaches on its first one, and the daemon may
            # re-plan for it), then the trainer pushes the step the loader waits for
            box: dict = {}
            refit = threading.Thread(target=_refit, args=(updater, daemon.endpoint, step, reply, box))
            refit.start()
            wait_until(
                "the engine attached",
                lambda t=refit: daemon.status()["engines"] or not t.is_alive(),
                timeout=120,
            )
            assert refit.is_alive(), box  # else the loader failed before waiting: its report says why
            client.push_step(step, weights)
            refit.join(timeout=180)
            assert box.get("answer") == (True, "Success") and not refit.is_alive()
            result = box["result"]
            assert result.ok and result.step == step, result
            oracle = sgl.build_model(dirs[step], load_format="auto")
            _assert_same_params(engine, oracle)
            assert {n: id(p) for n, p in engine.named_parameters()} == params
    finally:
        client.close()
        detach_all()
        daemon.close()


@pytest.mark.engine
def test_sglang_loader_reports_a_refused_attach_and_never_raises(sgl, tmp_path):
    """A payload without an endpoint the loader can use: SGLang's updater still answers (the loader
    must never raise inside a scheduler) and the driver's socket gets the failure, named."""
    import zmq

    config = _qwen3_moe()
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    engine = sgl.build_model(d, load_format="dummy")
    updater = sgl.weight_updater(engine)
    reply = f"ipc://{tmp_path}/reply.sock"
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(reply)
    try:
        bad = control_tensors(f"ipc://{tmp_path}/nobody.sock", min_step=1, timeout=1.0, reply=reply)
        updater.begin_weight_update()
        assert updater.update_weights_from_tensor(named_tensors=bad, load_format=LOADER) == (True, "Success")
        updater.end_weight_update(run_post_load=False)
        (result,) = collect_results(sock, 1, deadline=time.monotonic() + 30)
    finally:
        sock.close()
        detach_all()
    assert (not result.ok and "TIMEOUT" in (result.error or "").upper()) or "timeout" in (result.error or "")


@pytest.mark.engine
def test_transformers_loads_the_converted_block_fp8_directory(sgl, tmp_path):
    """transformers 5.x's FineGrainedFP8 loader reads ``refitd convert``'s directory
    (``FineGrainedFP8Config(dequantize=True)``): its fused experts (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``) equal refitd's dequantization of the written bytes (FP8 x the FP32 scale
    of each 128x128 block, rounded once to BF16), and the BF16 tensors equal the source. Aligned shapes
    only: transformers infers the block size from the scale grid, which is wrong for a ragged last
    block."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = _qwen3_moe()
    weights = _weights(config, 3)
    out = _checkpoint(tmp_path, "tf", config, weights, Format.BLOCK_FP8)
    model = AutoModelForCausalLM.from_pretrained(
        str(out), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    state = model.state_dict()
    written = _read_checkpoint(out)

    def dequant(name: str) -> torch.Tensor:
        q, scale = written[f"{name}.weight"].float(), written[f"{name}.weight_scale_inv"]
        blocks = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
        return (q * blocks).to(torch.bfloat16)

    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(4):
            gate_up = torch.cat([dequant(f"{p}.{e}.gate_proj"), dequant(f"{p}.{e}.up_proj")])
            assert torch.equal(_bytes(state[f"{p}.gate_up_proj"][e]), _bytes(gate_up)), (layer, e)
            assert torch.equal(_bytes(state[f"{p}.down_proj"][e]), _bytes(dequant(f"{p}.{e}.down_proj"))), (
                layer,
                e,
            )
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(_bytes(state[name]), _bytes(weights[name])), name


def _read_checkpoint(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


class _Engine:
    """The driver's view of ``sglang.Engine`` over SGLang's real scheduler-side weight-update manager
    (``SchedulerWeightUpdaterManager``: the session rules) and ``WeightUpdater``, with the requests
    built and serialized as ``Engine`` builds them (``io_struct`` inputs, ``MultiprocessingSerializer``
    per TP rank). Only the process hops (tokenizer manager -> scheduler) are left out; pause and
    continue are recorded."""

    def __init__(self, updater):
        from types import SimpleNamespace

        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        def deserialize_own_rank(payloads):  # TpModelWorker.deserialize_own_rank (its module needs uvicorn)
            monkey_patch_torch_reductions()
            return MultiprocessingSerializer.deserialize(payloads[0])

        runner = SimpleNamespace(weight_updater=updater)
        worker = SimpleNamespace(
            model_runner=runner,
            weight_update_runners=lambda: [("target", runner)],
            deserialize_own_rank=deserialize_own_rank,
        )
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=worker,
            draft_worker=None,
            memory_saver_adapter=None,
            flush_cache=lambda empty_cache=False: True,
            is_fully_idle=lambda **kw: True,
            scheduler=SimpleNamespace(record_weight_version_change=lambda new_version: None),
        )
        self.server_args = SimpleNamespace(tp_size=1, pp_size=1)
        self.calls: list[str] = []

    def pause_generation(self):
        self.calls.append("pause")

    def continue_generation(self):
        self.calls.append("continue")

    def begin_weight_update(self, selector: str = "all"):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self.calls.append("begin")
        return self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector))

    def end_weight_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self.calls.append("end")
        return self.manager.end_weight_update(EndWeightUpdateReqInput())

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        self.calls.append("update")
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named_tensors)],
            load_format=load_format,
            flush_cache=flush_cache,
        )
        return self.manager.update_weights_from_tensor(req)


@pytest.mark.engine
def test_refit_engine_drives_sglangs_session_and_leaves_a_failed_engine_paused(sgl, tmp_path):
    """``refit_engine``: pause -> begin -> update (refitd's loader) -> end -> continue through SGLang's
    real session manager; the control payload is all that crosses SGLang's request path. An update
    outside a session is refused by SGLang itself; a rank that fails is named, and the engine stays
    paused."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    from adapters.sglang import refit_engine
    from sidecar.client.client import RefitClient
    from sidecar.errors import RefitError
    from tests.support.daemons import RunningDaemon

    config = _qwen3_moe()
    weights = _weights(config, 6)
    out = _checkpoint(tmp_path, "drv", config, weights, Format.BLOCK_FP8)
    engine = _Engine(sgl.weight_updater(sgl.build_model(out, load_format="dummy")))
    control = control_tensors("ipc://unused", min_step=1)
    assert sum(t.numel() for _, t in control) < 1024
    with cpu_tensor_pickling():  # SGLang's reduction patch (installed by earlier updates) takes CUDA only
        payload = MultiprocessingSerializer.serialize(control)
    outside = engine.manager.update_weights_from_tensor(
        UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload], load_format=LOADER)
    )
    assert not outside.success and "begin_weight_update" in outside.message

    written = json.loads((out / "config.json").read_text())
    (tmp_path / "daemon").mkdir()
    daemon = RunningDaemon(tmp_path / "daemon", hf_config=written, format="block_fp8")
    client = RefitClient(daemon.endpoint, 0, 1, timeout=120)
    box: dict = {}

    def drive():
        try:
            box["results"] = refit_engine(engine, daemon.endpoint, min_step=1, timeout=120)
        except Exception as exc:  # the assertion below shows it
            box["error"] = exc

    try:
        thread = threading.Thread(target=drive)
        thread.start()
        wait_until(
            "the engine attached", lambda: daemon.status()["engines"] or not thread.is_alive(), timeout=120
        )
        client.push_step(1, weights)
        thread.join(timeout=180)
        assert "error" not in box, box
        (result,) = box["results"]
        assert result.ok and result.step == 1
        assert engine.calls == ["pause", "begin", "update", "end", "continue"]
        oracle = sgl.build_model(out, load_format="auto")
        _assert_same_params(engine.manager.tp_worker.model_runner.weight_updater.get_model(), oracle)
    finally:
        client.close()
        detach_all()
        daemon.close()

    engine.calls.clear()  # the daemon is gone: the rank reports a timeout, the engine stays paused
    with pytest.raises(RefitError, match=r"sglang-\S+-pid\d+-tp0: RefitError: \[timeout\]"):
        refit_engine(engine, daemon.endpoint, min_step=2, timeout=2)
    assert engine.calls == ["pause", "begin", "update", "end"]
    detach_all()
