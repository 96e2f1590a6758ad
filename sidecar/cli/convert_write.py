"""Where ``refitd convert`` writes: never a partial checkpoint, never outside OUT.

Everything (shards, index, ``config.json``) is written into a fresh directory beside OUT (in OUT's
parent, ``.OUT.refitd-convert-*``, so the final rename stays on one file system) and renamed into
place only once all of it is written. OUT must be new or an empty directory; one holding anything
(a checkpoint, a stray file, a symlink) is refused unless ``--force``, which replaces it whole
(the old one renamed aside, then removed: links in it are removed, never followed). OUT itself a
symlink is refused. A conversion that fails at any point (a NaN in a late tensor, a torn live
generation, an interrupt) removes its temporary directory: OUT is as it was.

Every passthrough tensor is checked finite before it is written (:func:`check_finite`, as the
daemon checks what it publishes); the quantizers refuse non-finite input themselves.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from sidecar.cli.convert_source import INDEX_NAME
from sidecar.daemon.copyout import finite
from sidecar.numerics.checks import NonFiniteError

__all__ = ["ShardWriter", "Staged", "check_finite", "check_out"]

#: dtypes whose NaN/Inf the daemon refuses in what it publishes (FP8 and packed codes come from
#: the quantizers, which refuse non-finite input)
CHECKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_out(out: Path, force: bool) -> None:
    """Refuse OUT unless it is new or an empty directory (or ``force`` replaces it)."""
    if out.is_symlink():
        raise ValueError(
            f"{out} is a symlink: give the path of a real directory (refitd convert writes nothing through links)"
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory: give a new or empty directory")
    entries = sorted(p.name for p in out.iterdir())
    if entries and not force:
        raise ValueError(
            f"{out} already holds a checkpoint or other files ({entries[:3]}): give a new or empty "
            "directory, or --force to replace it"
        )


class Staged:
    """The temporary directory a conversion writes into, renamed to OUT by :meth:`place`; removed,
    with all it holds, if the conversion ends any other way (a ``with`` block)."""

    def __init__(self, out: Path, force: bool) -> None:
        check_out(out, force)
        self.out, self.force = out, force
        out.parent.mkdir(parents=True, exist_ok=True)
        self.path = out.parent / f".{out.name}.refitd-convert-{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        self.placed = False

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.placed:
            shutil.rmtree(self.path, ignore_errors=True)

    def place(self) -> None:
        """Everything is written: rename it to OUT (OUT checked again: it may have changed meanwhile)."""
        check_out(self.out, self.force)
        old = None
        if self.out.exists() and any(self.out.iterdir()):  # --force: set the old one aside first
            old = self.out.parent / f".{self.out.name}.refitd-old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(self.out, old)
        os.rename(self.path, self.out)  # over an empty directory, or where nothing was
        self.placed = True
        if old is not None:
            shutil.rmtree(old)  # never follows a symlink in it


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """NonFiniteError if ``tensor`` (a passthrough, written as read) holds NaN or Inf: the daemon
    refuses to publish it, so convert refuses to write it. Quantized outputs need no check: every
    quantizer refuses non-finite input (SPEC §1.4) and makes finite scales from finite values."""
    if tensor.dtype in CHECKED_DTYPES and tensor.numel() and not finite(tensor):
        raise NonFiniteError(
            f"tensor {name!r} holds NaN or Inf; refusing to write it (the daemon refuses it too): fix "
            "the checkpoint, or convert the step before it"
        )


class ShardWriter:
    """Writes tensors into numbered safetensors shards of at most ``max_bytes`` (one tensor over it
    gets a shard of its own) in ``out`` (a :class:`Staged` directory), then the index.
    ``on_flush(shard file, bytes)`` after each shard is saved."""

    def __init__(self, out: Path, max_bytes: int, on_flush: Callable[[str, int], None] | None = None) -> None:
        self.out, self.max_bytes, self.on_flush = out, max_bytes, on_flush
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []
        self.total = 0
        self.written: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size
        self.written.append((name, tensor.dtype, tuple(tensor.shape)))

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        n = len(self.files)
        part = f"part-{n:05d}.tmp"
        save_file(self.pending, str(self.out / part), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        nbytes = self.pending_bytes
        self.pending, self.pending_bytes = {}, 0
        if self.on_flush is not None:
            self.on_flush(part, nbytes)

    def finish(self) -> list[str]:
        """Name the shards ``model-0000i-of-0000n.safetensors`` and write the index."""
        self.flush()
        count, names, weight_map = len(self.files), [], {}
        for i, tensors in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.out / f"part-{i:05d}.tmp").rename(self.out / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names

    def write_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)
        self.flush()
