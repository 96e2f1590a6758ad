"""What ``refitd convert`` reads, checked before anything is written.

A BF16 checkpoint directory is trusted for nothing: every safetensors header is parsed and bounded
here (its length against the file, each tensor's dtype, shape and byte range) before safetensors
maps it; the files are checked against ``model.safetensors.index.json`` (a listed shard missing, a
shard it does not list, a tensor listed twice or in another file than the index says); and the
tensors against what ``config.json`` describes (:func:`check_against_config`: the counts it claims
bounded by what the files hold before anything is listed, then the same names, shapes and dtypes as
the plan the daemon builds from that config). Every problem is a ValueError naming the file and
what to do.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sidecar.plan.models import get_model, model_type_of
from sidecar.plan.models.experts import ExpertForm

__all__ = ["INDEX_NAME", "CheckpointDir", "check_against_config"]

INDEX_NAME = "model.safetensors.index.json"
#: a safetensors header is JSON of a few hundred bytes a tensor: 100 MiB holds ~500k tensors
MAX_HEADER_BYTES = 100 << 20
#: limits above any released model (DeepSeek-V3: 61 layers x 256 experts; Kimi K2: 384 experts), far
#: below what would take the plan's listing of a checkpoint's tensors beyond memory
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_LAYER_EXPERTS = 1 << 20
#: config.json counts bounded by what the checkpoint holds
LAYER_KEYS = ("num_hidden_layers",)
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")

_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I64": torch.int64,
    "I32": torch.int32,
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\..*\.experts\.(\d+)\.")


def read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """``{name: (dtype, shape, begin, end)}`` of a safetensors file, every field checked against the
    file's size; ValueError naming the file and what is wrong with it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"{path}: {size} bytes, too short for a safetensors header; the file is truncated"
            )
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(
                f"{path}: its header claims {length} bytes but the file holds {size}: not a safetensors "
                "file, or a corrupt or truncated one; copy the shard again"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{path}: its safetensors header is not JSON ({exc}); copy the shard again"
        ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not a JSON object; copy the shard again")
    data = size - 8 - length
    out: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, entry, data)
    spans = sorted((b, e, n) for n, (_, _, b, e) in out.items() if e > b)
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"{path}: tensors {a!r} and {b!r} overlap in the file; copy the shard again")
    return out


def _entry(path: Path, name: str, entry: Any, data: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: its header entry is not an object; copy the shard again")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ST_DTYPES:
        raise ValueError(f"{where}: safetensors dtype {dtype!r} is not one a BF16 trainer checkpoint holds")
    ints = isinstance(shape, list) and all(type(d) is int and 0 <= d < 1 << 62 for d in shape)
    pair = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    if not (ints and pair):
        raise ValueError(f"{where}: its shape {shape!r} or data_offsets {offsets!r} are malformed")
    begin, end = offsets
    nbytes = _ST_DTYPES[dtype].itemsize
    for d in shape:
        nbytes *= d
    if not 0 <= begin <= end <= data or end - begin != nbytes:
        raise ValueError(
            f"{where}: data_offsets {offsets} do not hold its {dtype} {shape} ({nbytes} bytes) within the "
            f"file's {data} data bytes: a corrupt or truncated shard; copy it again"
        )
    return _ST_DTYPES[dtype], tuple(shape), begin, end


def _index(path: Path) -> dict[str, str]:
    """The index's weight_map; a name listed twice, or a file outside the directory, refused."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in items:
            if k in seen:
                raise ValueError(f"{path} lists {k!r} twice; give each tensor one shard")
            seen[k] = v
        return seen

    try:
        index = json.loads(path.read_text(), object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path} has no weight_map object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise ValueError(
                f"{path}: {name!r} is mapped to {file!r}, not a .safetensors file in its directory"
            )
    return weight_map


class CheckpointDir:
    """A safetensors checkpoint directory: which file holds each tensor, its dtype and shape, all
    checked (module docstring) before a byte of tensor data is read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        found = sorted(p.name for p in path.glob("*.safetensors"))
        index_path = path / INDEX_NAME
        weight_map = _index(index_path) if index_path.exists() else None
        if weight_map is not None:
            listed = sorted(set(weight_map.values()))
            missing = [f for f in listed if not (path / f).is_file()]
            if missing:
                lost = sum(1 for f in weight_map.values() if f in missing)
                raise ValueError(
                    f"{path}: {INDEX_NAME} lists {len(missing)} shard(s) that are not there ({missing[:5]}; "
                    f"{lost} tensors): copy the whole checkpoint"
                )
            extra = [f for f in found if f not in listed]
            if extra:
                raise ValueError(
                    f"{path} holds shard(s) {INDEX_NAME} does not list ({extra[:5]}): remove them, or give "
                    "the index that lists them"
                )
            found = listed
        if not found:
            raise ValueError(f"{path} holds no *.safetensors files: give a Hugging Face checkpoint directory")
        self.files = [path / f for f in found]
        self.where: dict[str, Path] = {}
        self.specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.bytes_of: dict[Path, int] = {}
        for f in self.files:
            header = read_header(f)
            self.bytes_of[f] = sum(e - b for _, _, b, e in header.values())
            for name, (dtype, shape, _, _) in header.items():
                if name in self.where:
                    raise ValueError(f"{name} is in both {self.where[name].name} and {f.name}")
                if weight_map is not None and weight_map.get(name) != f.name:
                    said = weight_map.get(name)
                    raise ValueError(
                        f"{f} holds {name!r}, which {INDEX_NAME} "
                        + (f"places in {said}" if said else "does not list")
                        + ": the index and the shards disagree; give the index saved with them"
                    )
                self.where[name] = f
                self.specs.append((name, shape, dtype))
        if weight_map is not None:
            absent = [n for n in weight_map if n not in self.where]
            if absent:
                raise ValueError(
                    f"{path}: {len(absent)} tensor(s) {INDEX_NAME} lists are in no shard ({absent[:5]}): "
                    "copy the whole checkpoint"
                )
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.where[name]
        try:
            if f not in self._open:
                self._open[f] = safe_open(str(f), framework="pt")
            return self._open[f].get_tensor(name)
        except Exception as exc:  # safetensors' own error types: one line, naming the file
            raise ValueError(f"{f}: reading {name!r} failed ({type(exc).__name__}: {exc})") from None


def _counts(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[int, int]:
    """(decoder layers, routed experts a layer) that the checkpoint's tensors hold."""
    layers = {int(m.group(1)) for n, _, _ in specs if (m := _LAYER_RE.search(n))}
    per_layer: dict[str, set[str]] = {}
    for n, _, _ in specs:
        m = _EXPERT_RE.search(n)
        if m:
            per_layer.setdefault(m.group(1), set()).add(m.group(2))
    experts = max((len(v) for v in per_layer.values()), default=0)
    slabs = [s[0] for n, s, _ in specs if ".experts." in n and len(s) == 3]
    return len(layers), max([experts, *slabs])


def check_against_config(
    specs: list[tuple[str, tuple[int, ...], torch.dtype]], hf_config: Mapping[str, Any], source: Path
) -> None:
    """The checkpoint's tensors against ``hf_config``: the counts it claims first (no more layers or
    experts than the tensors hold, within refitd's limits), then the names, shapes and dtypes of
    every parameter the config describes (MTP and vision ones optional, in either expert form)."""
    model = get_model(model_type_of(hf_config))
    text = model.text_config(hf_config)
    layers, experts = _counts(specs)
    claims = []
    for key, held, limit in [
        *((k, layers, MAX_LAYERS) for k in LAYER_KEYS),
        *((k, experts, MAX_EXPERTS) for k in EXPERT_KEYS),
    ]:
        value = text.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 0 or value > min(held, limit):
            raise ValueError(
                f"{source}/config.json: {key} = {value!r}, but the checkpoint's tensors hold {held}"
                + (f" (refitd takes at most {limit})" if isinstance(value, int) and value > limit else "")
                + ": give the config.json saved with these weights"
            )
        claims.append(value)
    if len(claims) > 1 and claims[0] * max(claims[1:]) > MAX_LAYER_EXPERTS:
        raise ValueError(
            f"{source}/config.json: {claims[0]} layers of {max(claims[1:])} experts is beyond refitd's limits"
        )
    have = {n: (tuple(s), d) for n, s, d in specs}
    best: list[str] = []  # the form whose problems are fewest (each form returns when it has none)
    for form in (None, ExpertForm.PER_EXPERT, ExpertForm.FUSED):
        try:  # a vision tower is optional: a text-only config describes none
            full = model.parameters(hf_config, include_mtp=True, include_vision=True, experts=form)
        except ValueError:
            full = model.parameters(hf_config, include_mtp=True, include_vision=False, experts=form)
        core = model.parameters(hf_config, include_mtp=False, include_vision=False, experts=form)
        want = {n: (tuple(s), d) for n, s, d in full}
        problems = [f"{n!r} is missing" for n, _, _ in core if n not in have]
        problems += [f"{n!r} is not a parameter of this model" for n in have if n not in want]
        problems += [
            f"{n!r} is {str(have[n][1]).removeprefix('torch.')} {list(have[n][0])}, the config says "
            f"{str(d).removeprefix('torch.')} {list(s)}"
            for n, (s, d) in want.items()
            if n in have and have[n] != (s, d)
        ]
        if not problems:
            return
        if not best or len(problems) < len(best):
            best = problems
    more = f"; and {len(best) - 8} more" if len(best) > 8 else ""
    raise ValueError(
        f"{source}: the checkpoint and its config.json disagree on {len(best)} tensor(s): "
        + "; ".join(best[:8])
        + more
        + ". Give the config.json saved with these weights, and every shard"
    )
