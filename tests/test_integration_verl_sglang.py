"""refitd's verl backend with SGLang replicas, against SGLang 0.5.23's and verl 0.9.1's real code on CPU
(``make test-sglang``: ``.venv-sglang`` holds verl with --no-deps).

What runs for real: SGLang's model (``get_model``, dummy weights) and its scheduler-side weight-update
manager (``SchedulerWeightUpdaterManager``: the begin/end session rules) over its real
``WeightUpdater``, whose ``update_weights_from_tensor`` dispatches ``load_format=
adapters.sglang.loader.refit_loader`` into refitd's loader; the requests are SGLang's ``io_struct``
inputs serialized with its ``MultiprocessingSerializer`` and decoded with its
``normalize_serialized_named_tensor_payloads``; a real refitd daemon publishes what verl's actor ranks
push through the real ``RefitdCheckpointEngine`` (built by verl's registry from verl's config
dataclasses); ``RefitdCheckpointEngineManager`` drives a replica of verl's ``RolloutReplica`` class with
``rollout.name=sglang``. Every engine parameter ends byte-equal to SGLang's own load of ``refitd
convert``'s directory of the same weights, two steps (the ranks report over ipc:// in the first, over
TCP in the second, as for a replica on several nodes).

What is stood in for, and why: verl's ``SGLangHttpServer`` launches SGLang's tokenizer manager and
schedulers (processes that need a GPU) inside a Ray actor, and SGLang's FastAPI app needs its tokenizer
manager; so :class:`SGLangFront` is the HTTP hop: an HTTP server on loopback answering the three
endpoints refitd posts to as SGLang's ``http_server.py`` does (the request body into the ``io_struct``
input, ``{"success", "message"}`` with HTTP 400 on a refusal), handing each to the real scheduler-side
manager in one process (the tokenizer -> scheduler hop left out). verl's ``SGLangReplica`` class
itself does not import on CPU (its module imports SGLang's engine and HTTP server: uvloop, xgrammar,
transformers' processors), so the replica is verl's ``RolloutReplica`` base with ``rollout.name=sglang``,
whose ``servers`` record verl's abort / flush / resume calls instead of reaching SGLang's tokenizer
manager.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.engines import missing

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

WORLD = 2


@pytest.fixture(scope="module")
def sgl():
    try:
        from tests.support import sglang_cpu

        sglang_cpu.import_sglang()
        import verl.checkpoint_engine.base  # noqa: F401
    except ImportError as exc:
        missing(
            "SGLang or verl does not import",
            "SGLang and verl are not installed here: run make test-sglang",
            exc,
        )
    return sglang_cpu


class SGLangFront:
    """SGLang's HTTP weight-update endpoints in front of its real scheduler-side manager (see the
    module docstring); ``paths`` lists every request, ``missing`` endpoints answer 404 (an SGLang
    without them)."""

    def __init__(self, manager, events: list[str], missing: tuple[str, ...] = ()):
        from sglang.srt.managers import io_struct
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        routes = {
            "begin_weight_update": (io_struct.BeginWeightUpdateReqInput, manager.begin_weight_update),
            "end_weight_update": (io_struct.EndWeightUpdateReqInput, manager.end_weight_update),
            "update_weights_from_tensor": (
                io_struct.UpdateWeightsFromTensorReqInput,
                manager.update_weights_from_tensor,
            ),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                name = self.path.strip("/")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                events.append(f"http:{name}")
                if name not in routes or name in missing:
                    return self.answer(404, {"detail": "Not Found"})
                cls, call = routes[name]
                req = cls(**body)
                if name == "update_weights_from_tensor":  # what the tokenizer manager does first
                    req.serialized_named_tensors = normalize_serialized_named_tensor_payloads(
                        req.serialized_named_tensors
                    )
                out = call(req)
                self.answer(200 if out.success else 400, {"success": out.success, "message": out.message})

            def answer(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class ServerCalls:
    """``SGLangHttpServer``'s control methods as verl's ``RolloutReplica`` calls them
    (``server.abort_all_requests.remote(...)``), recorded."""

    def __init__(self, index: int, events: list[str]):
        def method(name):
            async def call(**_):
                events.append(f"{name}{index}")

            return type("Method", (), {"remote": staticmethod(call)})()

        self.abort_all_requests = method("abort")
        self.clear_kv_cache = method("clear")
        self.resume_generation = method("resume")


def sglang_rollout(hf_config_path: Path, endpoint: str, *, loader: bool = True, timeout: float = 120):
    from omegaconf import OmegaConf

    from adapters.sglang import LOADER
    from tests.test_integration_verl import rollout_config

    rollout = rollout_config(hf_config_path, endpoint=endpoint, timeout=timeout)
    rollout.name = "sglang"
    rollout.tensor_model_parallel_size = 1  # the one SGLang model (TP rank) built here
    if loader:
        OmegaConf.update(rollout, "engine_kwargs.sglang", {"custom_weight_loader": [LOADER]}, merge=True)
    return rollout


def make_replica(rollout, index: int, address: str, events: list[str]):
    """verl's ``RolloutReplica`` (its real constructor over the rollout config), launched at ``address``."""
    from verl.workers.rollout.replica import RolloutReplica

    class Replica(RolloutReplica):
        async def launch_servers(self):
            self.servers = [ServerCalls(index, events)]
            self._server_address = address

    replica = Replica(replica_rank=index, config=rollout, model_config=None, gpus_per_node=1)
    import asyncio

    asyncio.run(replica.launch_servers())
    return replica


def test_the_manager_loads_sglang_replicas_through_refitds_loader_byte_equal(sgl, tmp_path):
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    from integrations.verl import RefitdCheckpointEngineManager
    from integrations.verl_sglang import reply_address
    from sidecar.numerics.formats import Format
    from tests.support.daemons import RunningDaemon
    from tests.support.verl_actors import ActorGroup
    from tests.test_adapter_sglang import _assert_same_params, _checkpoint, _Engine, _qwen3_moe, _weights

    config = _qwen3_moe()
    weights = {s: _weights(config, 20 + s) for s in (1, 2)}
    dirs = {s: _checkpoint(tmp_path, f"step{s}", config, w, Format.BLOCK_FP8) for s, w in weights.items()}
    written = json.loads((dirs[1] / "config.json").read_text())
    (tmp_path / "daemon").mkdir()
    daemon = RunningDaemon(tmp_path / "daemon", hf_config=written, format="block_fp8", world_size=WORLD)
    events: list[str] = []
    engine = _Engine(sgl.weight_updater(sgl.build_model(dirs[1], load_format="dummy")))
    front = SGLangFront(engine.manager, events)
    rollout = sglang_rollout(tmp_path / "daemon" / "config.json", daemon.endpoint)
    ce = omega_conf_to_dataclass(rollout.checkpoint_engine)
    import_external_libs(ce.custom_backend_module)
    engines = [
        CheckpointEngineRegistry.new("refitd", bucket_size=1, **ce.engine_kwargs["refitd"])
        for _ in range(WORLD)
    ]
    try:
        replica = make_replica(rollout, 0, front.address, events)
        assert replica.config.name == "sglang" and replica.nnodes == 1
        manager = RefitdCheckpointEngineManager(
            ce, ActorGroup(engines, events, weights.__getitem__), [replica]
        )
        for step in (1, 2):
            events.clear()
            if step == 2:  # as a replica spanning two nodes: the TP ranks report over TCP, not ipc://
                replica.nnodes = 2
                assert reply_address(replica).startswith("tcp://") and reply_address(replica).endswith(":*")
            else:
                assert reply_address(replica) is None
            metrics = manager.update_weights(global_steps=step)
            assert metrics["refitd/step"] == step
            order = [e for e in events if not e.startswith(("prepare", "init_process_group"))]
            assert order == [
                "abort0",
                f"push:{step}",
                f"pushed:{step}",
                "http:begin_weight_update",
                "http:update_weights_from_tensor",
                "http:end_weight_update",
                "clear0",
                "resume0",
            ], events
            oracle = sgl.build_model(dirs[step], load_format="auto")
            _assert_same_params(engine.manager.tp_worker.model_runner.weight_updater.get_model(), oracle)
    finally:
        from adapters.sglang.loader import detach_all

        detach_all()
        for e in engines:
            e.close()
        front.close()
        daemon.close()


def test_a_misconfigured_sglang_replica_is_refused_naming_the_fix(sgl, tmp_path):
    """No refitd loader in ``engine_kwargs.sglang.custom_weight_loader``: refused before any request
    (SGLang's scheduler raises on an unlisted load_format); an SGLang without the weight-update
    session (HTTP 404): named, with what to upgrade to; either way no flush and no resume."""
    from integrations.verl import RefitdCheckpointEngineManager
    from sidecar.errors import RefitError
    from tests.test_adapter_sglang import _Engine, _qwen3_moe

    config = _qwen3_moe()
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    engine = _Engine(sgl.weight_updater(sgl.build_model(d, load_format="dummy")))
    events: list[str] = []
    front = SGLangFront(engine.manager, events, missing=("begin_weight_update",))
    try:
        from verl.utils.config import omega_conf_to_dataclass

        endpoint = f"ipc://{tmp_path}/nobody.sock"
        bare = sglang_rollout(d / "config.json", endpoint, loader=False)
        manager = RefitdCheckpointEngineManager(omega_conf_to_dataclass(bare.checkpoint_engine), None, [])
        replica = make_replica(bare, 0, front.address, events)
        import asyncio

        with pytest.raises(
            ValueError, match=r"engine_kwargs\.sglang\.custom_weight_loader=\[adapters\.sglang"
        ):
            asyncio.run(manager.load_replica(replica, 1))
        assert not events

        replica = make_replica(sglang_rollout(d / "config.json", endpoint), 1, front.address, events)
        with pytest.raises(RefitError, match=r"no /begin_weight_update \(HTTP 404\).*SGLang 0\.5\.23"):
            asyncio.run(manager.load_replica(replica, 1))
        assert events == ["http:begin_weight_update"]

        # verl's own settings that cannot work with refitd's load, refused the same way
        from adapters.sglang import LOADER
        from integrations.verl_sglang import check_sglang_replica

        for key, value, match in [
            ("data_parallel_size", 2, r"data_parallel_size=2.*dp_size > 1"),
            ("quantization", "fp8", r"quantization='fp8'.*quantize again"),
            ("engine_kwargs", {"sglang": {"custom_weight_loader": LOADER}}, r"is the string .*needs a list"),
        ]:
            bad = sglang_rollout(d / "config.json", endpoint)
            bad[key] = value
            with pytest.raises(ValueError, match=match):
                check_sglang_replica(omega_conf_to_dataclass(bad))
    finally:
        front.close()


def test_a_failed_sglang_load_names_the_rank(sgl, tmp_path):
    """A rank that cannot load (no daemon at the endpoint: its reader times out) reports through
    refitd's loader, which never raises inside SGLang's scheduler: the session still closes (begin ->
    update -> end), and the manager's load raises RefitError naming the rank, so verl's flush and resume
    never run (``update_weights`` leaves the replicas paused)."""
    import asyncio

    from verl.utils.config import omega_conf_to_dataclass

    from adapters.sglang.loader import detach_all
    from integrations.verl import RefitdCheckpointEngineManager
    from sidecar.errors import RefitError
    from tests.test_adapter_sglang import _Engine, _qwen3_moe

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_qwen3_moe()))
    engine = _Engine(sgl.weight_updater(sgl.build_model(d, load_format="dummy")))
    events: list[str] = []
    front = SGLangFront(engine.manager, events)
    rollout = sglang_rollout(d / "config.json", f"ipc://{tmp_path}/nobody.sock", timeout=2)
    manager = RefitdCheckpointEngineManager(omega_conf_to_dataclass(rollout.checkpoint_engine), None, [])
    try:
        replica = make_replica(rollout, 3, front.address, events)
        with pytest.raises(RefitError, match=r"verl-sglang3-\S+-pid\d+-tp0: RefitError: \[timeout\]"):
            asyncio.run(manager.load_replica(replica, 1))
        assert events == [
            f"http:{e}" for e in ("begin_weight_update", "update_weights_from_tensor", "end_weight_update")
        ]
    finally:
        detach_all()
        front.close()


def test_the_example_config_launches_sglang_with_refitds_loader(sgl, tmp_path):
    """examples/verl_refitd.yaml with ``rollout.name: sglang`` passes the SGLang checks as it stands."""
    import verl
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from integrations.verl_sglang import check_sglang_replica

    base = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    OmegaConf.set_struct(base, False)
    example = OmegaConf.load(Path(__file__).resolve().parent.parent / "examples/verl_refitd.yaml")
    rollout = OmegaConf.merge(base, example).actor_rollout_ref.rollout
    rollout.name = "sglang"
    config = omega_conf_to_dataclass(rollout)
    assert isinstance(config, RolloutConfig)
    check_sglang_replica(config)
