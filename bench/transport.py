"""Cross-node transports between two processes: NIXL (UCX) and ZeroMQ, raw and as refitd uses them.

The same ``--mib`` bytes (one flat uint8 buffer in a POSIX-shm arena on each side, like the
daemon's arenas) move from this process to a spawned peer, in the same run, interleaved rep by rep
(the order of the paths reversed every other rep):
  nixl raw      ``nixl_agent`` calls directly: get_xfer_descs, initialize_xfer, transfer, poll
                check_xfer_state to DONE, release -- progress thread off, as in refitd;
  nixl refitd   ``transport.nixl.NixlEndpoint.write(...).wait(...)``: the same, plus validation
                of the local and remote ranges against the registrations and the peer's table;
  zmq raw       DEALER -> ROUTER over tcp://127.0.0.1, frames of at most ``--frame-mib``, the
                receiver ``recv_into`` a preallocated buffer, one ack at the end;
  zmq refitd    the same chunks as refitd's SHARD messages: ``transport.wire.encode`` header +
                one data frame per block of ``sidecar.client.pieces.blocks``, the receiver
                ``recv_multipart(copy=False)`` + ``wire.decode`` + ``copy_`` as the daemon does.
NIXL times run until the initiator sees DONE (the bytes are in the peer's memory); ZeroMQ times until
the receiver's ack. Every rep zeroes the destination first (untimed) and checks a CRC after.
Then the bytes one step puts on the wire for Qwen3.5-35B-A3B (planned from its config, not moved):
each FP8 generation against shipping the BF16 weights, and what that costs at the rates measured.

    python bench/transport.py [--mib 256] [--repeat 5] [--frame-mib 64] [--json PATH]

Loopback numbers: on one host UCX moves NIXL bytes with cma (process_vm_writev) and ZeroMQ goes
through the kernel's tcp stack, so the ratio is a lower bound for what RDMA NICs give NIXL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

# this file is named transport.py: run as a script, its folder comes first on sys.path and would
# shadow the ``transport`` package, so put the repository root first
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack
import torch
import zmq

from sidecar.client.pieces import blocks as frame_blocks
from sidecar.plan.build import RefitSpec, plan_from_hf_config
from transport.layout import Layout
from transport.nixl import NixlEndpoint, _api, available, backend_module
from transport.shm import ShmArena, segment_name
from transport.wire import Kind, Limits, Message, decode, encode

MiB, GiB = 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[1]
QWEN_CONFIG = ROOT / "tests" / "data" / "qwen3.5-35b-a3b.config.json"
FORMATS = ("bf16", "block_fp8", "mxfp8", "fp8_per_tensor")
WARMUP = 1
DEADLINE_S = 120.0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.numpy()))


def make_arena(role: str, nbytes: int) -> ShmArena:
    return ShmArena.create(
        segment_name("refitd-bench", role), Layout.build([("buf", torch.uint8, (nbytes,))])
    )


class Control:
    """A msgpack PAIR channel; while waiting it progresses the NIXL agents given (no progress thread)."""

    def __init__(self, sock: zmq.Socket, progress: list[Any]):
        self.sock, self.progress = sock, progress

    def send(self, **obj: Any) -> None:
        self.sock.send(msgpack.packb(obj, use_bin_type=True))

    def recv(self, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.sock.poll(1):
            for p in self.progress:
                p()
            if time.monotonic() > deadline:
                raise TimeoutError("the bench peer did not answer in time")
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def ask(self, **obj: Any) -> dict[str, Any]:
        self.send(**obj)
        return self.recv()


# --------------------------------------------------------------------------------------------------
# the peer process: owns the destination, progresses its agents, receives ZeroMQ on command


def peer_main(address: str, nbytes: int, frame: int) -> None:
    nixl_agent, nixl_agent_config = _api().nixl_agent, _api().nixl_agent_config
    arena = make_arena("dst", nbytes)
    dst = arena.tensor("buf")
    dst.zero_()  # touch every page before any rep
    raw = nixl_agent("bench-raw-dst", nixl_agent_config(enable_prog_thread=False))
    raw.register_memory([(dst.data_ptr(), nbytes, 0, "")], "DRAM")
    ep = NixlEndpoint("bench-dst")
    reg = ep.register(dst)
    ctx = zmq.Context()
    ctl = Control(ctx.socket(zmq.PAIR), [raw.get_new_notifs, ep.progress])
    ctl.sock.connect(address)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ctl.send(
        raw_md=raw.get_agent_metadata(),
        md=ep.metadata(),
        regions=ep.regions_table(reg),
        addr=dst.data_ptr(),
        port=port,
    )
    hello = ctl.recv()
    raw_peer = raw.add_remote_agent(hello["raw_md"])
    ep.add_peer(hello["md"])
    try:
        while True:
            cmd = ctl.recv()
            op = cmd["op"]
            if op == "zero":
                dst.zero_()
                ctl.send(ok=True)
            elif op == "crc":
                ctl.send(crc=crc(dst))
            elif op == "zmq_raw":
                ctl.send(ok=True)
                zmq_receive_raw(router, dst, frame)
            elif op == "zmq_refitd":
                ctl.send(ok=True)
                zmq_receive_refitd(router, dst, cmd["blocks"])
            elif op == "close":
                break
    finally:
        ep.close()
        raw.remove_remote_agent(raw_peer)
        arena.close()
        arena.unlink()
        ctl.send(closed=True)
        router.close(linger=0)
        ctl.sock.close(linger=1000)
        ctx.term()


def zmq_receive_raw(router: zmq.Socket, dst: torch.Tensor, frame: int) -> None:
    view, offset, ident = memoryview(dst.numpy()), 0, b""
    while offset < len(view):
        ident = router.recv()
        n = router.recv_into(view[offset : offset + frame])
        offset += n
    router.send_multipart([ident, b"ack"])


def zmq_receive_refitd(router: zmq.Socket, dst: torch.Tensor, blocks: int) -> None:
    limits, ident = Limits(), b""
    for _ in range(blocks):
        ident, *frames = router.recv_multipart(copy=False)
        msg = decode(frames, limits)
        offset = msg.require("offsets", list)[0]
        data = msg.frames[0].buffer
        dst[offset : offset + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))
    router.send_multipart([ident, b"ack"])


# --------------------------------------------------------------------------------------------------
# the initiator (this process)


def run_transfers(nbytes: int, repeat: int, frame: int) -> dict[str, Any]:
    nixl_agent, nixl_agent_config = _api().nixl_agent, _api().nixl_agent_config  # the wheel refitd uses
    arena = make_arena("src", nbytes)
    src = arena.tensor("buf")
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    want = crc(src)
    raw = nixl_agent("bench-raw-src", nixl_agent_config(enable_prog_thread=False))
    raw.register_memory([(src.data_ptr(), nbytes, 0, "")], "DRAM")
    ep = NixlEndpoint("bench-src")
    ep.register(src)
    blocks = list(frame_blocks((nbytes,), 1, frame))
    ctx = zmq.Context()
    ctl = Control(ctx.socket(zmq.PAIR), [raw.get_new_notifs, ep.progress])
    with tempfile.TemporaryDirectory(prefix="refitd-bench-transport-") as tmp:
        address = f"ipc://{tmp}/ctl.sock"
        ctl.sock.bind(address)
        peer = mp.get_context("spawn").Process(target=peer_main, args=(address, nbytes, frame), daemon=True)
        peer.start()
        try:
            hello = ctl.recv(timeout_s=DEADLINE_S + 60)
            raw_peer = raw.add_remote_agent(hello["raw_md"])
            peer_name = ep.add_peer(hello["md"], regions=hello["regions"])
            ctl.send(raw_md=raw.get_agent_metadata(), md=ep.metadata())
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.SNDHWM, 0)
            dealer.connect(f"tcp://127.0.0.1:{hello['port']}")
            dst = hello["addr"]

            def nixl_raw() -> None:
                local = raw.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
                remote = raw.get_xfer_descs([(dst, nbytes, 0)], "DRAM")
                h = raw.initialize_xfer("WRITE", local, remote, raw_peer, b"raw")
                state = raw.transfer(h)
                while state == "PROC":
                    state = raw.check_xfer_state(h)
                raw.release_xfer_handle(h)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL WRITE ended in {state}")

            def nixl_refitd() -> None:
                ep.write(peer_name, [(src.data_ptr(), nbytes)], [(dst, nbytes)], b"refitd").wait(
                    time.monotonic() + DEADLINE_S
                )

            def zmq_raw() -> None:
                ctl.ask(op="zmq_raw")
                view = memoryview(src.numpy())
                for off in range(0, nbytes, frame):
                    dealer.send(view[off : off + frame], copy=False)
                zmq_ack(dealer)

            def zmq_refitd() -> None:
                ctl.ask(op="zmq_refitd", blocks=len(blocks))
                for pid, (offsets, shape) in enumerate(blocks):
                    o, n = offsets[0], shape[0]
                    fields = {"step": 1, "piece": pid, "offsets": list(offsets), "shape": list(shape)}
                    dealer.send_multipart(
                        encode(Message(Kind.SHARD, fields, [src[o : o + n].numpy()])), copy=False
                    )
                zmq_ack(dealer)

            modes = {
                "nixl_raw": nixl_raw,
                "nixl_refitd": nixl_refitd,
                "zmq_raw": zmq_raw,
                "zmq_refitd": zmq_refitd,
            }
            times: dict[str, list[float]] = {k: [] for k in modes}
            for rep in range(WARMUP + repeat):
                order = list(modes) if rep % 2 == 0 else list(modes)[::-1]  # no seat is always first
                for name in order:
                    fn = modes[name]
                    ctl.ask(op="zero")
                    t0 = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - t0
                    got = ctl.ask(op="crc")["crc"]
                    if got != want:
                        raise RuntimeError(
                            f"{name}: the peer's bytes differ after rep {rep} (crc {got:#x} != {want:#x})"
                        )
                    if rep >= WARMUP:
                        times[name].append(elapsed)
                print(f"rep {rep + 1}/{WARMUP + repeat} done", flush=True)
            dealer.close(linger=0)
            ctl.send(op="close")
            ctl.recv()
        finally:
            peer.join(timeout=30)
            if peer.is_alive():
                peer.kill()
                peer.join()
            ep.close()
            arena.close()
            arena.unlink()
            ctl.sock.close(linger=0)
            ctx.term()
    return {"seconds": times, "frames": len(blocks)}


def zmq_ack(dealer: zmq.Socket) -> None:
    if not dealer.poll(int(DEADLINE_S * 1000)):
        raise TimeoutError("the ZeroMQ receiver did not ack")
    dealer.recv()


# --------------------------------------------------------------------------------------------------
# bytes on the wire per step (planned, not moved)


def wire_bytes() -> dict[str, dict[str, int]]:
    config = json.loads(QWEN_CONFIG.read_text())
    out = {}
    for fmt in FORMATS:
        plan = plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
        out[fmt] = {"bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out, "tensors_out": len(plan.outputs)}
    return out


# --------------------------------------------------------------------------------------------------
# reporting


def table(results: dict[str, Any]) -> str:
    meta, sec = results["meta"], results["transfers"]["seconds"]
    nbytes = meta["bytes"]
    med = {k: statistics.median(v) for k, v in sec.items()}
    labels = {
        "nixl_raw": "nixl raw (agent calls)",
        "nixl_refitd": "nixl refitd (transport.nixl)",
        "zmq_raw": "zmq tcp raw (recv_into)",
        "zmq_refitd": "zmq tcp refitd (wire framing)",
    }
    ratio = {
        "nixl_refitd": f"{med['nixl_raw'] / med['nixl_refitd']:.2f}x nixl raw",
        "zmq_raw": f"nixl raw is {med['zmq_raw'] / med['nixl_raw']:.2f}x this",
        "zmq_refitd": f"{med['zmq_raw'] / med['zmq_refitd']:.2f}x zmq raw; "
        f"nixl refitd is {med['zmq_refitd'] / med['nixl_refitd']:.2f}x this",
    }
    lines = [
        f"one WRITE of {nbytes / MiB:.0f} MiB between two processes (shm arenas), median of {meta['repeat']} "
        f"after {WARMUP} warm-up; zmq in {results['transfers']['frames']} frames of <= {meta['frame_bytes'] / MiB:.0f} MiB",
        f"{meta['cpus']} CPUs, load average {meta['loadavg_start'][0]:.1f} at the start, "
        f"{meta['loadavg_end'][0]:.1f} at the end; NIXL from {meta['nixl_backend']}",
        "",
        f"{'path':<34}{'ms':>9}{'GB/s':>8}{'best':>8}  ratio",
    ]
    for key, label in labels.items():
        best = min(sec[key])
        lines.append(
            f"{label:<34}{med[key] * 1e3:>9.1f}{gbps(nbytes, med[key]):>8.2f}{gbps(nbytes, best):>8.2f}  {ratio.get(key, '')}"
        )
    wire = results["wire"]
    bf16 = wire["bf16"]["bytes_out"]
    lines += [
        "",
        f"bytes on the wire per step, Qwen3.5-35B-A3B (text; planned from its config): "
        f"trainer BF16 input {wire['bf16']['bytes_in'] / GiB:.2f} GiB",
        f"{'shipped':<16}{'GiB':>8}{'vs bf16':>9}{'tensors':>9}{'s @ nixl':>10}{'s @ zmq':>9}",
    ]
    rates = {k: gbps(nbytes, med[k]) * 1e9 for k in ("nixl_refitd", "zmq_refitd")}
    for fmt, row in wire.items():
        b = row["bytes_out"]
        lines.append(
            f"{fmt:<16}{b / GiB:>8.2f}{b / bf16:>9.3f}{row['tensors_out']:>9}"
            f"{b / rates['nixl_refitd']:>10.1f}{b / rates['zmq_refitd']:>9.1f}"
        )
    lines.append("(s @: one step's bytes at this run's loopback rates of the refitd paths)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per rep, in MiB (default 256)")
    ap.add_argument("--repeat", type=int, default=5, help="timed reps per path (median)")
    ap.add_argument(
        "--frame-mib", type=int, default=Limits().max_frame_bytes // MiB, help="ZeroMQ frame limit"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.mib < 1 or args.frame_mib < 1:
        ap.error("--repeat, --mib and --frame-mib must be at least 1")
    ok, why = available()
    if not ok:
        print(f"NIXL unavailable: {why}", file=sys.stderr)
        return 2
    nbytes, frame = args.mib * MiB, args.frame_mib * MiB
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "bytes": nbytes,
            "frame_bytes": frame,
            "repeat": args.repeat,
            "warmup": WARMUP,
            "nixl_backend": backend_module(),
            "ucx_tls": os.environ.get("UCX_TLS"),
            "torch": torch.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "loadavg_start": os.getloadavg(),
        },
        "transfers": run_transfers(nbytes, args.repeat, frame),
        "wire": wire_bytes(),
    }
    results["meta"]["wall_s"] = time.perf_counter() - t0
    results["meta"]["loadavg_end"] = os.getloadavg()
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
