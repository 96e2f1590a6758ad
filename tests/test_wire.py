"""The wire protocol: header then raw frames, every limit checked before decoding, no pickle."""

from __future__ import annotations

import msgpack
import pytest
import torch

from transport.wire import (
    PROTOCOL_VERSION,
    Kind,
    Limits,
    Message,
    ProtocolError,
    decode,
    dtype_from_name,
    dtype_name,
    encode,
)


def test_round_trip_keeps_frames_untouched():
    data = memoryview(bytearray(b"\x01\x02\x03"))
    frames = encode(Message(Kind.SHARD, {"step": 3, "piece": 1, "offsets": [0, 4]}, [data]))
    assert frames[1] is data  # zero-copy: the data frame is handed to ZeroMQ as is
    msg = decode(frames, Limits())
    assert msg.kind is Kind.SHARD and msg.fields == {"step": 3, "piece": 1, "offsets": [0, 4]}
    assert bytes(msg.frames[0]) == b"\x01\x02\x03"


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([], "empty message"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "not a msgpack map"),
        ([msgpack.packb({"v": PROTOCOL_VERSION + 1, "k": 1, "n": 0, "f": {}})], "protocol version"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "k": 999, "n": 0, "f": {}})], "unknown message kind"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "k": 1, "n": 2, "f": {}}), b"x"], "announces 2 data frames"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "k": 1, "n": 0, "f": [1]})], "fields are not a map"),
        ([msgpack.packb({1: 2})], "not valid msgpack"),  # strict_map_key: only str keys
    ],
)
def test_malformed_messages_are_refused(frames, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        decode(frames, Limits())


def test_limits_are_checked_before_decoding():
    limits = Limits(max_header_bytes=64, max_frame_bytes=8, max_frames=2)
    with pytest.raises(ProtocolError, match="header of"):
        decode([b"\x00" * 65], limits)
    header = encode(Message(Kind.SHARD, {}, [b"x" * 9]))
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes=8"):
        decode(header, limits)
    with pytest.raises(ProtocolError, match="3 data frames exceed"):
        decode(encode(Message(Kind.SHARD, {}, [b"", b"", b""])), limits)


def test_pickle_never_decodes():
    """A pickled payload is just bytes that fail msgpack: no code path unpickles."""
    import pickle

    with pytest.raises(ProtocolError):
        decode([pickle.dumps({"v": 1})], Limits())


def test_require_checks_presence_and_type():
    msg = Message(Kind.BEGIN, {"step": True, "pieces": []})
    with pytest.raises(ProtocolError, match="lacks field 'rank'"):
        msg.require("rank", int)
    with pytest.raises(ProtocolError, match="field 'step' has type bool"):
        msg.require("step", int)
    assert msg.require("pieces", list) == []


def test_dtypes_travel_by_name_from_a_closed_list():
    for dt in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8):
        assert dtype_from_name(dtype_name(dt)) is dt
    with pytest.raises(ProtocolError, match="unknown dtype"):
        dtype_from_name("__import__('os')")
    with pytest.raises(ValueError, match="cannot travel"):
        dtype_name(torch.complex64)
