"""A trainer node's forwarder against an inference node that answers with values it cannot use.

The inference node here is a fake: a real ZeroMQ ROUTER speaking the real wire format, standing for a
broken (or other-version) inference daemon. Its FORWARD_READY or CREDIT carries a frame size or a
credit count that is not a usable integer. The forwarder must fail that transfer with an error naming
the field, and go on: it retries (a second FORWARD_BEGIN arrives), rather than its thread dying with
an uncaught exception and the node never being sent a generation again.
"""

from __future__ import annotations

import threading

import pytest
import zmq
from support.daemons import RunningDaemon
from support.net import free_port
from support.waiting import wait_until

from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from transport.wire import Kind, Limits, Message, decode, encode

pytestmark = pytest.mark.timeout(120)

MODEL = dict(num_layers=1, num_experts=2, mtp_layers=0)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
INSTANCE = "e" * 16


class FakeInference:
    """Answers every FORWARD_BEGIN with FORWARD_READY (``ready`` over sane fields) and a CREDIT of
    ``frames``, and each FORWARD_DATA with another; PINGs with PONG. Counts the FORWARD_BEGINs."""

    def __init__(self, endpoint: str, ready: dict, frames):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.ready, self.frames = ready, frames
        self.begins = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def send(self, identity: bytes, kind: Kind, fields: dict) -> None:
        self.sock.send_multipart([identity, *encode(Message(kind, {**fields, "instance": INSTANCE}))])

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames, Limits(max_header_bytes=64 << 20, max_frame_bytes=1 << 30))
            if msg.kind is Kind.FORWARD_BEGIN:
                self.begins += 1
                fields = {"transfer": msg.get("transfer"), "step": msg.get("step"), "mover": "zmq"}
                fields |= {"credit_frames": 1, "max_frame_bytes": 1 << 20, **self.ready}
                self.send(identity, Kind.FORWARD_READY, fields)
                self.send(identity, Kind.CREDIT, {"transfer": msg.get("transfer"), "frames": self.frames})
            elif msg.kind is Kind.FORWARD_DATA:
                self.send(identity, Kind.CREDIT, {"transfer": msg.get("transfer"), "frames": self.frames})
            elif msg.kind is Kind.PING:
                self.send(identity, Kind.PONG, {})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize(
    "ready, frames, field",
    [
        ({"max_frame_bytes": 0}, 1, "max_frame_bytes"),  # range(0, n, 0)
        ({"max_frame_bytes": "64MiB"}, 1, "max_frame_bytes"),
        ({"credit_frames": None}, 1, "credit_frames"),
        ({"credit_frames": 0}, "many", "frames"),  # the first frame waits for a CREDIT: unusable
    ],
    ids=["zero-frame", "text-frame", "nil-credits", "text-credit"],
)
def test_unusable_ready_or_credit_fails_the_transfer_and_the_forwarder_retries(
    tmp_path, ready, frames, field
):
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # peers are tcp:// (loopback needs no CURVE)
    fake = FakeInference(endpoint, ready, frames)
    d = RunningDaemon(
        tmp_path,
        hf_config=CONFIG,
        role="trainer",
        layout="disaggregated",
        world_size=1,
        peers=[endpoint],
        forward_timeout_s=10.0,
        reader_timeout_s=30.0,
        format="block_fp8",
    )
    try:
        with RefitClient(d.endpoint, 0, 1, timeout=60) as client:
            client.push_step(0, make_state_dict("qwen3_5_moe", seed=5, **MODEL))
        wait_until("the forwarder to try step 0 again", lambda: fake.begins >= 2, timeout=60)
        error = d.status()["peers"][endpoint]["error"] or ""
        assert f"{field}=" in error and "expected an integer" in error, error
    finally:
        d.close()
        fake.close()
