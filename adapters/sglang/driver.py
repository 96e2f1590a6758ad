"""The driver side: one refit of an SGLang engine, pause -> begin -> update -> end -> continue.

``engine`` is SGLang's ``sglang.Engine`` (or its HTTP client, ``HttpServerEngineAdapter``): anything
with ``pause_generation``, ``begin_weight_update``, ``update_weights_from_tensor``,
``end_weight_update`` and ``continue_generation``. Every TP scheduler process runs refitd's custom
loader, which reports its :class:`~adapters.engine.LoadResult` to a PULL socket this function binds;
a failure (or a rank that never reports) raises RefitError naming each worker, and the engine is left
paused: its weights may be part-loaded and must not serve until a later refit succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from adapters.engine import LoadResult, check_results
from adapters.sglang.loader import control_tensors
from adapters.sglang.quant import LOADER
from sidecar.errors import ErrorKind, RefitError


def _ok(answer: Any, what: str) -> None:
    """SGLang answers ``(success, message)``, an object with ``.success``, or a dict."""
    success, message = True, ""
    if isinstance(answer, tuple) and answer and isinstance(answer[0], bool):
        success, message = answer[0], str(answer[1] if len(answer) > 1 else "")
    elif isinstance(answer, dict) and "success" in answer:
        success, message = bool(answer["success"]), str(answer.get("message", ""))
    elif hasattr(answer, "success"):
        success, message = bool(answer.success), str(getattr(answer, "message", ""))
    if not success:
        raise RefitError(f"SGLang refused {what}: {message}", kind=ErrorKind.ENGINE)


def _tp_size(engine: Any) -> int:
    args = getattr(engine, "server_args", None)
    return int(getattr(args, "tp_size", 1) or 1) * int(getattr(args, "pp_size", 1) or 1)


def refit_engine(
    engine: Any,
    endpoint: str,
    *,
    min_step: int | None = None,
    timeout: float = 600.0,
    name: str = "sglang",
    workers: int | None = None,
    reply: str | None = None,
    pause: bool = True,
) -> list[LoadResult]:
    """Load the next generation >= ``min_step`` into every TP rank of ``engine``.

    ``workers``: how many load results to wait for (default: ``engine.server_args.tp_size``).
    ``reply``: the address the ranks report to (default: an ipc:// socket in a fresh temporary
    directory; give a ``tcp://host:port`` this host binds, or ``tcp://host:*`` for a free port, when
    ranks run on other nodes).
    """
    expected = workers or _tp_size(engine)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    tmp = None
    if reply is None:
        tmp = tempfile.mkdtemp(prefix="refitd-sglang-")
        reply = f"ipc://{os.path.join(tmp, 'reply.sock')}"
    sock.bind(reply)
    reply = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the port a ``tcp://host:*`` bind was given
    control = control_tensors(endpoint, min_step=min_step, timeout=timeout, name=name, reply=reply)
    ended = False
    try:
        if pause:
            engine.pause_generation()
        _ok(engine.begin_weight_update(), "begin_weight_update")
        try:
            with cpu_tensor_pickling():
                answer = engine.update_weights_from_tensor(
                    named_tensors=control, load_format=LOADER, flush_cache=True
                )
            _ok(
                answer,
                f"update_weights_from_tensor(load_format={LOADER!r}) (is it listed in --custom-weight-loader?)",
            )
        finally:
            _ok(engine.end_weight_update(), "end_weight_update")
            ended = True
        results = collect_results(sock, expected, deadline=time.monotonic() + timeout)
        checked = check_results(results, step=min_step)
    finally:
        sock.close()
        if tmp is not None:
            _remove(tmp)
    if pause and ended:
        engine.continue_generation()
    return checked


@contextlib.contextmanager
def cpu_tensor_pickling() -> Iterator[None]:
    """Torch's own tensor pickling while the control payload is serialized in this process.

    SGLang's ``monkey_patch_torch_reductions`` (installed in any process that ran its weight-sync
    helpers or its ``WeightUpdater``) rewrites argument 6 of every tensor's reduction, which only CUDA
    tensors have: pickling the CPU control tensor then fails with IndexError. Only this call's
    serialization runs unpatched; the patch is put back after it.
    """
    from torch.multiprocessing import reductions

    original = getattr(reductions, "_reduce_tensor_original", None)
    if original is None or reductions.reduce_tensor is original:
        yield
        return
    patched = reductions.reduce_tensor
    reductions.reduce_tensor = original
    reductions.init_reductions()
    try:
        yield
    finally:
        reductions.reduce_tensor = patched
        reductions.init_reductions()


def collect_results(sock: zmq.Socket, expected: int, *, deadline: float) -> list[LoadResult]:
    """``expected`` LoadResults from the ranks (JSON on ``sock``); a rank that never reported is a
    failure with that reason."""
    results: list[LoadResult] = []
    while len(results) < expected:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(min(left, 1.0) * 1000) + 1):
            if left <= 0:
                break
            continue
        try:
            results.append(LoadResult.from_any(json.loads(sock.recv(zmq.NOBLOCK))))
        except (ValueError, zmq.Again):
            results.append(LoadResult(worker="?", step=None, ok=False, error="an unreadable load report"))
    for _ in range(expected - len(results)):
        results.append(LoadResult(worker="?", step=None, ok=False, error="no load report within the timeout"))
    return results


def _remove(path: str, rm: Callable[[str], None] = os.rmdir) -> None:
    for entry in os.listdir(path):
        os.unlink(os.path.join(path, entry))
    rm(path)
