"""Who may forward a generation to an inference node.

A trainer node's daemon and an inference node's daemon run in threads of the test process (the real
serve loops, sockets and shared memory), the control channel between them over ``tcp://`` with
CURVE. The inference node takes FORWARD_* only from its trainer daemon's CURVE key
(``curve_trainer_keys``): an engine reader on its local ``ipc://`` socket, or a tcp client whose key
may connect but is not a trainer's, is refused with UNAUTHORIZED, its forged step (10**9, under the
real trainer's source instance) moves nothing, and the trainer's next step still lands.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import zmq
from support.daemons import RunningDaemon
from support.net import free_port

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.config.settings import ConfigError, DaemonConfig
from transport.curve import client_curve, set_client, write_keypair
from transport.wire import Kind, Limits, Message, decode, encode

pytestmark = pytest.mark.timeout(180)

MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
FORGED_STEP = 10**9


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=700 + step, **MODEL)


@pytest.fixture
def nodes(tmp_path):
    """(trainer daemon, inference daemon, the stranger's client CURVE triple)."""
    keys = tmp_path / "keys"
    allowed = keys / "allowed"
    allowed.mkdir(parents=True)
    trainer_key, _ = write_keypair(allowed, "trainer")
    stranger_key, _ = write_keypair(allowed, "stranger")  # may connect: in curve_allowed_keys
    inference_key, inference_pub = write_keypair(keys, "inference")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = dict(layout="disaggregated", reader_timeout_s=30.0, forward_timeout_s=10.0, format="block_fp8")
    inference = RunningDaemon(
        tmp_path,
        runtime_dir=tmp_path / "inference",
        role="inference",
        model_type="qwen3_5_moe",
        publish_bytes=4 << 20,
        listen=endpoint,
        curve_secret_key=inference_key,
        curve_allowed_keys=allowed,
        curve_trainer_keys=allowed / "trainer.key.pub",
        **common,
    )
    trainer = RunningDaemon(
        tmp_path,
        runtime_dir=tmp_path / "trainer",
        hf_config=CONFIG,
        role="trainer",
        world_size=1,
        peers=[endpoint],
        curve_secret_key=trainer_key,
        curve_server_key=inference_pub,
        **common,
    )
    yield trainer, inference, client_curve(inference_pub, stranger_key)
    trainer.close()
    inference.close()


def status(endpoint: str) -> dict:
    with RefitReader(endpoint, name="test-status") as probe:
        return probe.status(timeout=30)


def push_and_land(trainer: RunningDaemon, inference: RunningDaemon, step: int) -> None:
    """The trainer pushes ``step``; it is forwarded and goes live on the inference node."""
    with RefitClient(trainer.endpoint, 0, 1, timeout=60) as client:
        assert client.push_step(step, weights(step), timeout=60).step == step
    deadline = time.monotonic() + 60
    while status(inference.daemon.local_listen)["last_step"] != step:
        assert time.monotonic() < deadline, f"forwarded step {step} never went live on the inference node"


def forge(endpoint: str, source: str, curve=None, rows=(("w", "uint8", (4,)),)) -> list[Message]:
    """FORWARD_BEGIN (step 10**9 under ``source``, ``rows``), DATA and COMMIT from a raw socket; the replies."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_client(sock, curve)
    sock.connect(endpoint)
    begin = {"step": FORGED_STEP, "source": source, "transfer": "forged", "rows": [list(r) for r in rows]}
    replies = []
    try:
        for kind, fields, frames in (
            (Kind.FORWARD_BEGIN, {**begin, "bytes": 4, "movers": ["zmq"]}, []),
            (Kind.FORWARD_DATA, {"transfer": "forged", "tensor": 0, "offset": 0}, [b"\xff" * 4]),
            (Kind.FORWARD_COMMIT, {"transfer": "forged"}, []),
        ):
            sock.send_multipart(encode(Message(kind, fields, frames)))
            assert sock.poll(10_000), f"no answer to {kind.name}"
            replies.append(decode(sock.recv_multipart(), Limits()))
    finally:
        sock.close(0)
        ctx.term()
    return replies


def assert_refused(replies: list[Message], why: str) -> None:
    for reply in replies:
        assert reply.kind is Kind.ERROR, f"a forged message was answered {reply.kind.name}: {reply.fields}"
        assert reply.fields["kind"] == "unauthorized", reply.fields
        assert why in reply.fields["message"], reply.fields["message"]


def test_a_local_reader_cannot_forward_and_the_trainer_still_can(nodes):
    """Step 0 is forwarded and live. An engine reader on the inference node's ipc:// socket sends
    FORWARD_BEGIN/DATA/COMMIT for step 10**9 with the real trainer's source instance: each is refused
    (UNAUTHORIZED, "came without one"), the live generation stays step 0, and the trainer's step 1
    still lands (a forged step poisons no step-order check)."""
    trainer, inference, _ = nodes
    push_and_land(trainer, inference, 0)
    local = inference.daemon.local_listen
    before = status(local)
    source = before["history"][-1]["forwarded_from"]
    assert source == trainer.daemon.instance

    assert_refused(forge(local, source), "came without one")

    after = status(local)
    assert after["live"] == before["live"] and after["last_step"] == 0 and after["inbound"] is None
    push_and_land(trainer, inference, 1)


def test_a_tcp_client_with_an_allowed_but_non_trainer_key_cannot_forward(nodes):
    """A client whose CURVE key is in curve_allowed_keys but not curve_trainer_keys gets in, yet its
    FORWARD_* are refused naming its key; nothing moves, and the trainer's step 1 lands."""
    trainer, inference, stranger = nodes
    push_and_land(trainer, inference, 0)
    local = inference.daemon.local_listen
    before = status(local)

    assert_refused(
        forge(inference.endpoint, trainer.daemon.instance, curve=stranger), "not a trainer daemon's"
    )

    after = status(local)
    assert after["live"] == before["live"] and after["last_step"] == 0 and after["inbound"] is None
    push_and_land(trainer, inference, 1)
    assert Path(local.removeprefix("ipc://")).exists()


def test_an_inference_node_without_curve_is_a_configuration_error(tmp_path):
    """Without CURVE nobody can be identified as the trainer, so an inference node would refuse every
    forwarded step: refused at start instead, saying what to give. curve_trainer_keys elsewhere too."""
    base = dict(runtime_dir=tmp_path / "run", model_type="qwen3_5_moe", publish_bytes=4 << 20)
    with pytest.raises(ConfigError, match="CURVE key: listen on tcp://"):
        DaemonConfig(layout="disaggregated", role="inference", **base)
    key = tmp_path / "trainer.key.pub"
    key.write_text("")
    with pytest.raises(ConfigError, match="curve_trainer_keys is only for"):
        DaemonConfig(curve_trainer_keys=key, **base)


@pytest.mark.parametrize(
    "rows",
    [
        [["w", "uint8", [-4, 8]]],  # a negative dim: a negative size, under any capacity
        [["w", "int64", [1 << 62, 4]]],  # 2**67 bytes: wraps to 0 in int64 arithmetic
        [["w", "int32", [4]], ["w", "uint8", [4096]]],  # one name twice: two slots, one survives
        [["w", "uint8", [2.5]]],  # not an integer dim
    ],
    ids=["negative", "overflow", "duplicate", "fraction"],
)
def test_the_trainer_forwarding_an_impossible_layout_is_refused_and_nothing_changes(nodes, tmp_path, rows):
    """The trainer node's own forwarder (its key, over CURVE) sends FORWARD_BEGIN rows no tensor can
    have. The inference node refuses them as a protocol error naming the row, before it claims or
    carves a generation; engines would otherwise be handed a layout their views overrun. The live
    generation stays as it was, and the trainer's next step still lands."""
    trainer, inference, _ = nodes
    push_and_land(trainer, inference, 0)
    local = inference.daemon.local_listen
    before = status(local)
    source = before["history"][-1]["forwarded_from"]
    keys = tmp_path / "keys"
    curve = client_curve(keys / "inference.key.pub", keys / "allowed" / "trainer.key")
    begin = forge(inference.endpoint, source, curve, rows)[0]
    assert begin.kind is Kind.ERROR, begin.fields
    if begin.fields["kind"] == "capacity":  # a valid layout, only larger than any generation here
        assert "--publish-bytes" in begin.fields["message"], begin.fields
    else:
        assert begin.fields["kind"] == "protocol" and "rows" in begin.fields["message"], begin.fields
    after = status(local)
    assert after["live"] == before["live"] and after["last_step"] == 0 and after["inbound"] is None
    push_and_land(trainer, inference, 1)
