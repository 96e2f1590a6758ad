"""A streaming engine worker against a daemon that sends garbage STREAM / GROUP / STREAM_FAILED.

The daemon side of the streamed-refit messages is fuzzed in test_fuzz_wire.py (torn_streamed); here
the reader side is: a fake daemon (a real ZeroMQ ROUTER speaking the real wire format) attaches an
``EngineWorker`` with streaming on and answers its WAIT with malformed streamed-refit messages. The
worker must load nothing from them, never fail with anything but a ``RefitError`` (here: the
timeout, since no generation ever comes), and keep its engine untouched.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from adapters.engine import EngineWorker
from adapters.reference import ReferenceEngine
from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.errors import ErrorKind, RefitError
from transport.wire import STREAM_VERSION, Kind, Limits, Message, decode, encode

pytestmark = pytest.mark.timeout(120)

CONFIG = make_hf_config("qwen3_5_moe", num_layers=1, num_experts=2, mtp_layers=0)
INSTANCE = "f" * 16
LIVE = {"generation": 0, "step": 0, "arena": {"kind": "shm", "name": "refitd-nope", "size": 8, "layout": []}}
STREAM_OK = {
    "v": STREAM_VERSION,
    "step": 1,
    "generation": 1,
    "arena": {"kind": "shm", "name": "refitd-missing-segment", "size": 8, "layout": []},
    "epoch": 2,
    "epochs": {"kind": "shm", "name": "refitd-missing-epochs", "size": 16, "count": 2},
    "groups_key": 1,
    "groups": [["lm_head.weight"]],
    "live": LIVE,
}
HOSTILE: dict[str, list[tuple[Kind, dict]]] = {
    "stream of a segment that does not exist": [
        (Kind.STREAM, STREAM_OK),
        (Kind.GROUP, {"step": 1, "generation": 1, "ready": [0]}),
    ],
    "stream without fields": [(Kind.STREAM, {}), (Kind.GROUP, {"step": 1, "generation": 1, "ready": [0]})],
    "groups not lists of names": [(Kind.STREAM, {**STREAM_OK, "groups": [[1, 2], "x"]})],
    "groups never sent": [(Kind.STREAM, {**STREAM_OK, "groups_key": 9} | {"groups": None})],
    "live not a map": [(Kind.STREAM, {**STREAM_OK, "live": [1, 2]})],
    "arena garbage": [(Kind.STREAM, {**STREAM_OK, "arena": {"kind": "x" * 300}})],
    "group without a stream": [
        (Kind.GROUP, {"step": 1, "generation": 1, "ready": [0, -1, 2**63 - 1, "0", None]})
    ],
    "group garbage": [(Kind.GROUP, {"step": [], "generation": {}, "ready": {"a": 1}})],
    "failure without a stream": [(Kind.STREAM_FAILED, {"step": 1, "error": "not a map"})],
    "failure garbage": [(Kind.STREAM_FAILED, {"step": None, "error": {"message": ["x"]}, "live_step": "x"})],
}


class FakeDaemon:
    """ATTACHED with streaming on; every WAIT answered with ``script``; PINGs with PONG."""

    def __init__(self, endpoint: str, script: list[tuple[Kind, dict]]):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.script, self.stop = script, threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def send(self, identity: bytes, kind: Kind, fields: dict) -> None:
        self.sock.send_multipart([identity, *encode(Message(kind, {**fields, "instance": INSTANCE}))])

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames, Limits())
            if msg.kind is Kind.ATTACH:
                assert msg.get("stream") == STREAM_VERSION
                fields = {"stream": STREAM_VERSION, "reader_timeout_s": 30.0, "heartbeat_interval_s": 0.2}
                self.send(identity, Kind.ATTACHED, fields)
            elif msg.kind is Kind.PING:
                self.send(identity, Kind.PONG, {})
            elif msg.kind is Kind.WAIT and not msg.get("cancel"):
                for kind, fields in self.script:
                    self.send(identity, kind, fields)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_garbage_stream_messages_load_nothing_and_fail_cleanly(tmp_path, case):
    endpoint = f"ipc://{tmp_path}/fake.sock"
    daemon = FakeDaemon(endpoint, HOSTILE[case])
    engine = ReferenceEngine.from_config(CONFIG, expert_format="block_fp8")
    loads: list = []
    worker = EngineWorker(
        endpoint,
        name="victim",
        manifest=engine.manifest(),
        load=loads.append,
        load_group=lambda gen, names: loads.append(names),
        timeout=10,
    )
    try:
        assert worker.attach()["stream"] == STREAM_VERSION
        with pytest.raises(RefitError) as err:
            worker.load_next(min_step=1, timeout=1.5)
        assert err.value.kind is ErrorKind.TIMEOUT, err.value
        assert loads == []
    finally:
        worker.detach()
        daemon.close()
