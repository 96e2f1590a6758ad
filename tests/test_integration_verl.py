"""refitd's verl backend (integrations/verl.py) against verl 0.9.1's real code on CPU (make test-verl).

* verl's config dataclass (``omega_conf_to_dataclass`` of its generated trainer config with refitd's
  lines), ``import_external_libs`` of ``custom_backend_module`` and ``CheckpointEngineRegistry`` build
  the backend, as verl's actor worker does;
* two FSDP2 ranks (gloo) export a tiny Qwen3-MoE with verl's own ``FSDPEngine.get_per_tensor_param``
  into ``send_weights``; a ``refitd serve`` subprocess publishes each step, byte-equal to
  ``refitd convert`` of the same export;
* ``RefitdCheckpointEngineManager`` (verl's ``CheckpointEngineManager`` subclass, built from verl's
  config) orders abort -> push -> load -> prefix-cache reset -> resume over replicas that load through
  refitd's reference engine, and leaves them paused when a load fails.

``make test`` skips this file (no verl in .venv); ``make test-verl`` fails on an import error
(REFITD_REQUIRE_ENGINES=1).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.engines import missing
from support.verl_actors import ActorGroup

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
WORLD = 2


@pytest.fixture(scope="module")
def verl():
    try:
        import verl.checkpoint_engine.base as base
    except ImportError as exc:
        missing("verl does not import", "verl is not installed here: run make test-verl", exc)
    return base


def rollout_config(hf_config_path: Path, **refitd_kwargs):
    """verl's generated trainer config with refitd's lines, as Hydra overrides would set them."""
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    OmegaConf.update(
        cfg,
        "actor_rollout_ref.rollout.checkpoint_engine",
        {
            "backend": "refitd",
            "custom_backend_module": "integrations.verl",
            "engine_kwargs": {"refitd": {"hf_config": str(hf_config_path), **refitd_kwargs}},
        },
        merge=True,
    )
    OmegaConf.update(
        cfg,
        "actor_rollout_ref.rollout.checkpoint_manager_class",
        "integrations.verl.RefitdCheckpointEngineManager",
        force_add=True,
    )
    return cfg.actor_rollout_ref.rollout


def test_verls_config_and_registry_build_the_backend(verl, tmp_path):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn
    from verl.workers.config import CheckpointEngineConfig

    from sidecar.cli.demo.synthetic import make_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(make_hf_config("qwen3_5_moe", num_layers=2, num_experts=4)))
    rollout = rollout_config(path, endpoint="ipc:///nowhere/control.sock", wait="committed")
    config = omega_conf_to_dataclass(rollout.checkpoint_engine)
    assert isinstance(config, CheckpointEngineConfig)
    import_external_libs(config.custom_backend_module)
    engine = verl.CheckpointEngineRegistry.new(
        config.backend, is_master=True, bucket_size=config.update_weights_bucket_megabytes << 20,
        **config.engine_kwargs.get(config.backend, {}),
    )  # fmt: skip
    from integrations.verl import RefitdCheckpointEngine, RefitdCheckpointEngineManager

    assert isinstance(engine, RefitdCheckpointEngine) and isinstance(engine, verl.CheckpointEngine)
    assert engine.pusher.endpoint == "ipc:///nowhere/control.sock" and engine.pusher.wait == "committed"
    manager_cls = load_class_from_fqn(rollout.checkpoint_manager_class, "CheckpointEngineManager")
    assert manager_cls is RefitdCheckpointEngineManager and issubclass(
        manager_cls, verl.CheckpointEngineManager
    )
    # verl's manager asserts each topology list has one entry per worker
    actor, rollout_kw = RefitdCheckpointEngine.build_topology(3, 2, [engine.prepare()] * 5)
    assert actor == {"rank": [0, 1, 2], "world_size": [3, 3, 3]}
    assert all(len(v) == 2 for v in rollout_kw.values()) and rollout_kw["rank"] == [-1, -1]
    # a missing config names the setting
    with pytest.raises(ValueError, match=r"engine_kwargs\.refitd\.hf_config"):
        verl.CheckpointEngineRegistry.new("refitd", bucket_size=1)


# --------------------------------------------------------------------------------------------------
# verl's FSDP export -> send_weights -> refitd serve, byte-equal to refitd convert


def serve_env() -> dict[str, str]:
    """The daemon refuses REFITD_* variables it does not know (make test-verl sets one for pytest)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("REFITD_")}


class Serve:
    """``refitd serve`` in a subprocess; ready once it answers STATUS."""

    def __init__(self, tmp: Path, config: Path, fmt: str):
        self.run = tmp / "run"
        self.endpoint = f"ipc://{self.run / 'control.sock'}"
        self.log = tmp / "serve.log"
        argv = [
            sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(self.run),
            "--hf-config", str(config), "--world-size", str(WORLD), "--format", fmt,
            "--rank-timeout", "60",
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=serve_env()
            )
        from adapters.base import RefitReader
        from sidecar.errors import RefitError

        deadline = time.monotonic() + 120
        with RefitReader(self.endpoint, name="readiness") as probe:
            while True:
                assert self.proc.poll() is None, self.log.read_text()
                try:
                    probe.status(timeout=0.5)
                    return
                except RefitError:
                    assert time.monotonic() < deadline, self.log.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def converted(checkpoint: Path, out: Path, fmt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "convert", str(checkpoint), str(out), "--format", fmt],
        check=True, cwd=REPO, capture_output=True, env=serve_env(),
    )  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8"])
def test_verls_fsdp_export_publishes_byte_equal_to_refitd_convert(verl, tmp_path, fmt):
    import multiprocessing as mp

    from support import verl_fsdp

    from adapters.base import RefitReader

    hf = {**verl_fsdp.make_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(hf))
    serve = Serve(tmp_path, config_path, fmt)
    steps = [1, 2]
    try:
        job = {
            "init_file": str(tmp_path / "dist-init"),
            "checkpoint_engine": rollout_config(
                config_path, endpoint=serve.endpoint, timeout=120
            ).checkpoint_engine,
            "steps": steps,
            "out": str(tmp_path / "ckpt"),
            "hf_config": hf,
        }
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        checked = [ctx.Event() for _ in steps]
        procs = [
            ctx.Process(target=verl_fsdp.run_rank, args=(r, WORLD, job, results, checked))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        try:
            with RefitReader(serve.endpoint, name="check") as reader:
                for i, step in enumerate(steps):
                    ranks = [results.get(timeout=240) for _ in range(WORLD)]
                    assert not [r["error"] for r in ranks if "error" in r], [
                        r["error"] for r in ranks if "error" in r
                    ]
                    # verl hands FP32 masters (FSDP2 on CPU); every rank's metrics name the same generation
                    assert all(r["dtypes"] == ["torch.float32"] for r in ranks)
                    assert {r["metrics"]["refitd/step"] for r in ranks} == {step}
                    assert len({r["metrics"]["refitd/generation"] for r in ranks}) == 1
                    ratio = max(r["metrics"]["refitd/push_s"] for r in ranks) / max(
                        r["export_s"] for r in ranks
                    )
                    print(
                        f"{fmt} step {step}: send_weights {ratio:.2f}x verl's export alone"
                    )  # a figure, not a check
                    expected = converted(tmp_path / "ckpt" / f"step{step}", tmp_path / f"out{step}", fmt)
                    gen = reader.wait(min_step=step, timeout=60)
                    try:
                        assert gen.step == step
                        assert sorted(gen.tensors) == sorted(expected)
                        differ = [
                            n for n, want in expected.items()
                            if gen.tensors[n].dtype != want.dtype or gen.tensors[n].shape != want.shape
                            or not torch.equal(gen.tensors[n].view(torch.uint8), want.view(torch.uint8))
                        ]  # fmt: skip
                        assert not differ, differ[:10]
                    finally:
                        reader.release(gen)
                    checked[i].set()
            for _ in range(WORLD):
                item = results.get(timeout=60)
                assert item.get("done"), item
        finally:
            for e in checked:
                e.set()
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        assert all(p.exitcode == 0 for p in procs)
    finally:
        serve.stop()


# --------------------------------------------------------------------------------------------------
# the manager: abort -> push -> load -> prefix-cache reset -> resume


class ReferenceReplica:
    """A rollout replica with verl's replica calls, whose engine is refitd's reference engine loading
    through ``adapters.engine.EngineWorker`` (what the vLLM and SGLang adapters are built on)."""

    def __init__(self, index: int, events: list[str], config: dict, fmt: str, fail: bool = False):
        from adapters.reference import ReferenceEngine

        self.index, self.events, self.fail = index, events, fail
        self.engine = ReferenceEngine.from_config(config, expert_format=fmt)
        self.worker = None

    async def abort_all_requests(self, reject_request: bool = False):
        self.events.append(f"abort{self.index}")

    async def refitd_load(self, step: int, endpoint: str):
        from adapters.engine import EngineWorker, check_results

        def load(gen):
            if self.fail:
                raise RuntimeError("CUDA error: out of memory (injected)")
            self.engine.load(gen.tensors)

        if self.worker is None:
            self.worker = EngineWorker(
                endpoint, name=f"replica{self.index}", manifest=self.engine.manifest(), load=load, timeout=60
            )
            self.worker.attach()
        result = await asyncio.to_thread(self.worker.load_next, step, 60)
        self.events.append(f"load{self.index}:{result.step}")
        check_results([result], step=step)

    async def clear_kv_cache(self):
        self.events.append(f"clear{self.index}")

    async def resume_generation(self):
        self.events.append(f"resume{self.index}")


@pytest.fixture
def manager_setup(verl, daemons, tmp_path):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict

    model = dict(num_layers=2, num_experts=4, unaligned=True)
    config = make_hf_config("qwen3_5_moe", **model)
    d = daemons(hf_config=config, world_size=WORLD, format="block_fp8")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    ce = omega_conf_to_dataclass(rollout_config(path, endpoint=d.endpoint, timeout=60).checkpoint_engine)
    import_external_libs(ce.custom_backend_module)  # as verl's actor worker does before the registry
    engines = [
        verl.CheckpointEngineRegistry.new("refitd", bucket_size=1, **ce.engine_kwargs["refitd"])
        for _ in range(WORLD)
    ]
    weights = {}

    def weights_of(step):
        weights[step] = make_state_dict("qwen3_5_moe", seed=50 + step, **model)
        return weights[step]

    yield ce, engines, weights_of, weights, config
    for e in engines:
        e.close()


def test_the_manager_orders_abort_push_load_reset_resume(manager_setup):
    from adapters.reference import ReferenceEngine
    from integrations.verl import RefitdCheckpointEngineManager
    from sidecar.plan.build import RefitSpec
    from sidecar.plan.run import convert

    ce, engines, weights_of, weights, config = manager_setup
    events: list[str] = []
    replicas = [ReferenceReplica(i, events, config, "block_fp8") for i in range(2)]
    manager = RefitdCheckpointEngineManager(ce, ActorGroup(engines, events, weights_of), replicas)
    for step in (1, 2):
        events.clear()
        metrics = manager.update_weights(global_steps=step)  # verl's auto_await: callable without a loop
        assert metrics["refitd/step"] == step and "refitd/load_s" in metrics
        assert [(e.pusher.rank, e.pusher.world_size) for e in engines] == [(0, WORLD), (1, WORLD)]
        order = [e.split(":")[0].rstrip("0123456789") for e in events]
        if step == 1:  # the actor ranks are set up once, through verl's topology calls
            assert order[2:4] == ["prepare", "init_process_group"], events
            order = order[:2] + order[4:]
        assert order == [
            "abort",
            "abort",
            "push",
            "pushed",
            "load",
            "load",
            "clear",
            "clear",
            "resume",
            "resume",
        ], events
        assert sorted(e for e in events if e.startswith("load")) == [f"load0:{step}", f"load1:{step}"]
        expected = ReferenceEngine.from_config(config, expert_format="block_fp8")
        expected.load(convert(weights[step], RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")))
        for r in replicas:
            assert all(torch.equal(r.engine.params[n], p) for n, p in expected.params.items())


def test_a_failed_load_raises_and_leaves_the_replicas_paused(manager_setup):
    from integrations.verl import RefitdCheckpointEngineManager
    from sidecar.errors import RefitError

    ce, engines, weights_of, _, config = manager_setup
    events: list[str] = []
    replicas = [
        ReferenceReplica(0, events, config, "block_fp8"),
        ReferenceReplica(1, events, config, "block_fp8", True),
    ]
    manager = RefitdCheckpointEngineManager(ce, ActorGroup(engines, events, weights_of), replicas)
    with pytest.raises(RefitError, match=r"replica1.*out of memory"):
        manager.update_weights(global_steps=1)
    assert not [e for e in events if e.startswith(("clear", "resume"))], events


def test_the_manager_refuses_another_backend(verl, tmp_path):
    from verl.workers.config import CheckpointEngineConfig

    from integrations.verl import RefitdCheckpointEngineManager

    with pytest.raises(ValueError, match="drives the refitd backend"):
        RefitdCheckpointEngineManager(CheckpointEngineConfig(backend="naive"), None, [])


def test_the_backend_module_loads_no_daemon(verl):
    """What verl imports on every worker (custom_backend_module) brings refitd's client, not its daemon."""
    code = "import sys, integrations.verl; print(sorted(m for m in sys.modules if m.startswith('sidecar.daemon')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_example_config_builds_the_backend_and_the_manager_class(verl, tmp_path):
    """examples/verl_refitd.yaml merged over verl's generated trainer config, as a user would."""
    import verl as verl_pkg
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn

    from sidecar.cli.demo.synthetic import make_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(make_hf_config("qwen3_5_moe", num_layers=2, num_experts=4)))
    base = OmegaConf.load(Path(verl_pkg.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    OmegaConf.set_struct(base, False)
    cfg = OmegaConf.merge(base, OmegaConf.load(REPO / "examples/verl_refitd.yaml"))
    cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitd.hf_config = str(path)
    rollout = cfg.actor_rollout_ref.rollout
    ce = omega_conf_to_dataclass(rollout.checkpoint_engine)
    import_external_libs(ce.custom_backend_module)
    engine = verl.CheckpointEngineRegistry.new(ce.backend, bucket_size=1, **ce.engine_kwargs[ce.backend])
    assert type(engine).__name__ == "RefitdCheckpointEngine" and engine.pusher.wait == "published"
    assert load_class_from_fqn(rollout.checkpoint_manager_class, "CheckpointEngineManager").__name__ == (
        "RefitdCheckpointEngineManager"
    )
    assert (
        rollout.engine_kwargs.vllm.worker_extension_cls == "integrations.verl_vllm.RefitdVerlWorkerExtension"
    )
    assert rollout.quantization is None
