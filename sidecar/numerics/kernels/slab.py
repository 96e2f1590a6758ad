"""Host side of the slab kernels: geometry, tile configs, output checks and pointer tables.

Pure Python and torch, no Triton: everything here runs (and is tested) on a CPU-only machine.

A **slab** is one layer's grouped routed experts, ``[E, R, K]``, cut along its rows into ``P`` equal
**parts** per expert: ``P = 2`` for ``gate_up_proj`` (gate rows ``[0, R/2)``, up rows ``[R/2, R)``),
``P = 1`` for ``down_proj`` or one per-expert matrix viewed as ``[1, N, K]``. Each (expert, part) is
one checkpoint tensor with its own caller-provided values and scale tensors (``outs[e][p]``).

Why pointer tables rather than "outputs laid out one after another": the daemon's arena places each
output where its plan says, and nothing in docs/spec.md or the plan promises that one slab's 2E weights and
2E scales sit at a fixed stride from each other (they are interleaved weight, scale, weight, ...). A
table of base addresses (one int64 per output, 8 KiB for a 256-expert gate_up slab) costs one small
host-to-device copy, made once per set of output tensors (:func:`prepare_outputs`), because the
arena hands out the same views every step. The kernel loads its two base pointers once per program;
the rest of its addressing is the same as with offsets.
Each output must be contiguous (row-major); when every weight output is 16-byte aligned the kernel
is told so, which lets it store 16 bytes at a time (a pointer loaded from memory has unknown alignment).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sidecar.numerics.formats import BLOCK, FLOAT_DTYPES, FP8_DTYPE, MX_BLOCK, Format
from sidecar.numerics.kernels.lru import IdentityLru

__all__ = [
    "DEFAULT_CONFIGS",
    "FLAG_CLEAR",
    "Outs",
    "SlabGeometry",
    "TileConfig",
    "check_outputs",
    "check_slab",
    "is_aligned",
    "needs_wide_offsets",
    "pointer_table",
    "prepare_outputs",
]

#: outs[e][p] = (values, scales) of expert e, part p
Outs = Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]

#: the non-finite flag's value while no block held NaN/Inf (kernels atomic_min a tile id into it)
FLAG_CLEAR = 2**31 - 1
#: alignment (bytes) that lets the kernels store 16 bytes at a time
STORE_ALIGN = 16
#: most programs the per-tensor amax pass gives one expert (the second pass reads them all)
MAX_AMAX_CHUNKS = 128
_INT32_LIMIT = 2**31


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TileConfig:
    """What one program of a slab kernel covers, and how it is launched.

    ``block_rows x block_cols`` elements per program (block-FP8: 128 rows and a multiple of 128
    columns, one scale per 128x128 tile; MXFP8: a multiple of 32 columns; per-tensor: any powers of
    two). ``amax_chunks`` (per-tensor only) is how many programs the first pass gives each expert.
    """

    block_rows: int
    block_cols: int
    num_warps: int = 8
    num_stages: int = 2
    amax_chunks: int = 32

    def validate(self, fmt: Format) -> None:
        problems = []
        if not (_pow2(self.block_rows) and _pow2(self.block_cols)):
            problems.append(
                f"block_rows={self.block_rows} and block_cols={self.block_cols} must be powers of two"
            )
        if fmt is Format.BLOCK_FP8 and (self.block_rows != BLOCK or self.block_cols % BLOCK):
            problems.append(f"block_fp8 programs cover {BLOCK} rows and a multiple of {BLOCK} columns")
        if fmt is Format.MXFP8 and self.block_cols % MX_BLOCK:
            problems.append(f"mxfp8 programs cover a multiple of {MX_BLOCK} columns")
        if not _pow2(self.num_warps) or self.num_warps > 32:
            problems.append(f"num_warps={self.num_warps} must be a power of two <= 32")
        if not 1 <= self.amax_chunks <= MAX_AMAX_CHUNKS:
            problems.append(f"amax_chunks={self.amax_chunks} must be in [1, {MAX_AMAX_CHUNKS}]")
        if self.num_stages < 1:
            problems.append(f"num_stages={self.num_stages} must be >= 1")
        if problems:
            raise ValueError(f"tile config {self} for {fmt.value}: " + "; ".join(problems))


#: defaults, to be replaced by the best of bench/gpu_check.py's sweep on an H200
DEFAULT_CONFIGS: dict[Format, TileConfig] = {
    Format.BLOCK_FP8: TileConfig(block_rows=128, block_cols=128, num_warps=8),
    Format.MXFP8: TileConfig(block_rows=32, block_cols=256, num_warps=4),
    Format.FP8_PER_TENSOR: TileConfig(block_rows=32, block_cols=256, num_warps=4, amax_chunks=32),
}


@dataclass(frozen=True, slots=True)
class Tile:
    """One program's (or one scale block's) place: expert, part, row and column ranges in the part."""

    expert: int
    part: int
    rows: tuple[int, int]
    cols: tuple[int, int]


@dataclass(frozen=True, slots=True)
class SlabGeometry:
    """Shape of one launch: ``experts`` x ``parts`` matrices of ``rows x cols`` each."""

    experts: int
    parts: int
    rows: int  # per part
    cols: int
    #: the slab's element strides (0 for a dim of size 1 is fine: it is never stepped)
    strides: tuple[int, int, int] = (0, 0, 1)

    @classmethod
    def of(cls, slab: torch.Tensor, parts: int) -> SlabGeometry:
        e, r, k = slab.shape
        return cls(e, parts, r // parts, k, tuple(int(s) for s in slab.stride()))

    @classmethod
    def contiguous(cls, shape: Sequence[int], parts: int) -> SlabGeometry:
        """The geometry of a contiguous slab of ``shape`` [E, R, K] (what a plan's arena holds)."""
        e, r, k = shape
        return cls(e, parts, r // parts, k, (r * k, k, 1))

    @property
    def numel(self) -> int:
        return self.experts * self.parts * self.rows * self.cols

    def tiles(self, rows_per_tile: int, cols_per_tile: int) -> tuple[int, int]:
        """(row tiles, column tiles) of one part."""
        return -(-self.rows // rows_per_tile), -(-self.cols // cols_per_tile)

    def programs(self, rows_per_tile: int, cols_per_tile: int) -> int:
        n_rt, n_ct = self.tiles(rows_per_tile, cols_per_tile)
        return self.experts * self.parts * n_rt * n_ct

    def tile(self, tile_id: int, rows_per_tile: int, cols_per_tile: int) -> Tile:
        """Inverse of the kernels' ``((e * parts + p) * n_rt + rt) * n_ct + ct`` numbering."""
        n_rt, n_ct = self.tiles(rows_per_tile, cols_per_tile)
        if not 0 <= tile_id < self.experts * self.parts * n_rt * n_ct:
            raise ValueError(
                f"tile {tile_id} is outside this slab's {self.programs(rows_per_tile, cols_per_tile)}"
            )
        rest, ct = divmod(tile_id, n_ct)
        rest, rt = divmod(rest, n_rt)
        e, p = divmod(rest, self.parts)
        r0, c0 = rt * rows_per_tile, ct * cols_per_tile
        return Tile(e, p, (r0, min(self.rows, r0 + rows_per_tile)), (c0, min(self.cols, c0 + cols_per_tile)))

    def amax_chunks(self, cfg: TileConfig) -> tuple[int, int]:
        """Per-tensor first pass: (chunks per expert, rows of the expert's [parts*rows, cols] per chunk);
        every chunk but the last covers a whole number of ``block_rows``."""
        total = self.parts * self.rows
        row_blocks = max(1, -(-total // cfg.block_rows))
        per_chunk = -(-row_blocks // min(cfg.amax_chunks, row_blocks)) * cfg.block_rows
        return max(1, -(-total // per_chunk)), per_chunk

    def amax_rows(self, chunk: int, cfg: TileConfig) -> tuple[int, int]:
        """Rows of the expert's [parts*rows, cols] that per-tensor amax chunk ``chunk`` reads."""
        _, per_chunk = self.amax_chunks(cfg)
        r0 = chunk * per_chunk
        return r0, min(self.parts * self.rows, r0 + per_chunk)


# --------------------------------------------------------------------------------------------------
# validation


def check_slab(slab: torch.Tensor, fmt: Format, parts: int, name: str) -> None:
    """The input: a 3-D float tensor ``[E, R, K]`` whose rows split into ``parts`` equal parts."""
    if not isinstance(slab, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(slab).__name__}")
    if slab.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {slab.dtype}; {fmt.value} quantizes bfloat16, float16 or float32 weights only"
        )
    if slab.dim() != 3:
        raise ValueError(f"{name} has shape {tuple(slab.shape)}; a slab is 3-D [experts, rows, cols]")
    if parts not in (1, 2) or slab.shape[1] % parts:
        raise ValueError(
            f"{name} has {slab.shape[1]} rows, which do not split into {parts} equal parts "
            "(gate_up_proj needs an even 2I)"
        )
    if fmt is Format.MXFP8 and slab.shape[2] % MX_BLOCK:
        raise ValueError(
            f"{name} has shape {tuple(slab.shape)}: mxfp8 needs the last dim K to be a multiple of "
            f"{MX_BLOCK}; keep this tensor in bf16 (ignore_patterns) or choose block_fp8"
        )
    if not fmt.quantized:
        raise ValueError(f"format {fmt.value} is not a quantized format; nothing to quantize")


def _problems(slab: torch.Tensor, fmt: Format, outs: Outs, names: Sequence[Sequence[str]]) -> list[str]:
    e, r, k = slab.shape
    problems: list[str] = []
    if e == 0 and not outs:
        return problems
    if len(outs) != e or any(len(row) != len(outs[0]) for row in outs) or not outs or not outs[0]:
        return [f"outs must hold one row per expert ({e}), each with the same number of parts"]
    parts = len(outs[0])
    shape = (r // parts, k)
    scale_shape = fmt.scale_shape(shape)
    for ei, row in enumerate(outs):
        for pi, pair in enumerate(row):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                problems.append(f"{names[ei][pi]}: expected a (values, scales) pair")
                continue
            for what, t, want_shape, want_dtype in (
                ("values", pair[0], shape, FP8_DTYPE),
                ("scales", pair[1], scale_shape, fmt.scale_dtype),
            ):
                if not isinstance(t, torch.Tensor):
                    problems.append(f"{names[ei][pi]}: {what} is a {type(t).__name__}, not a tensor")
                elif tuple(t.shape) != want_shape or t.dtype != want_dtype or t.device != slab.device:
                    problems.append(
                        f"{names[ei][pi]}: {what} buffer is {t.dtype} {tuple(t.shape)} on {t.device}, "
                        f"expected {want_dtype} {want_shape} on {slab.device}"
                    )
                elif not t.is_contiguous():
                    problems.append(
                        f"{names[ei][pi]}: {what} buffer is not contiguous (the kernels need row-major)"
                    )
    return problems


def check_outputs(slab: torch.Tensor, fmt: Format, outs: Outs, names: Sequence[Sequence[str]]) -> None:
    """Raise a ValueError listing every output buffer that does not fit the slab and format."""
    problems = _problems(slab, fmt, outs, names)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"{len(problems)} output buffer problem(s); allocate outputs from the plan:\n{lines}{more}"
        )


def is_aligned(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.data_ptr() % STORE_ALIGN == 0 for t in tensors)


def needs_wide_offsets(slab: torch.Tensor) -> bool:
    """Whether an expert's element offsets (input or output) can reach 2^31: use int64 arithmetic."""
    _, r, k = slab.shape
    span = sum((d - 1) * abs(s) for d, s in zip(slab.shape[1:], slab.stride()[1:]) if d)
    return span + 1 >= _INT32_LIMIT or r * k >= _INT32_LIMIT  # the expert's base offset is always int64


# --------------------------------------------------------------------------------------------------
# prepared outputs: validation and pointer tables, once per set of output tensors


def pointer_table(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """int64 tensor of the tensors' base addresses, on ``device``."""
    device = torch.device(device)
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device)
    if device.type == "cuda":  # a pageable copy may still be in flight: whole before any stream reads it
        torch.cuda.current_stream(device).synchronize()
    return table


@dataclass(slots=True)
class PreparedOutputs:
    """One slab's output tensors, checked, with their pointer tables on the slab's device.

    Holds only weak references to the tensors, so a cached entry never keeps an arena's memory
    alive; :meth:`same` tells whether a call passes the very same tensor objects again.
    """

    key: tuple
    q_table: torch.Tensor
    s_table: torch.Tensor
    aligned: bool
    refs: list[weakref.ref]

    def same(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len(tensors) == len(self.refs) and all(r() is t for r, t in zip(self.refs, tensors))


#: prepared output sets (LRU, shared by the per-GPU threads: sidecar.numerics.kernels.lru)
_prepared: IdentityLru[PreparedOutputs] = IdentityLru()


def prepare_outputs(
    slab: torch.Tensor,
    fmt: Format,
    outs: Outs,
    names: Callable[[], Sequence[Sequence[str]]],
    *,
    strict: bool = True,
) -> PreparedOutputs | None:
    """Check ``outs`` against the slab and format and build their pointer tables, or return the
    entry made the last time these very tensor objects were passed.

    Checking 2E outputs costs milliseconds of Python for E = 256; the daemon's arena hands the same
    tensor views every step, so that cost is paid once per output set. A tensor resized in place
    (``resize_``, ``set_``) after its first use is not noticed: allocate new views instead.
    ``names`` is called only when a check fails or the entry is new. A failed check raises a
    ValueError listing every problem, or returns None when ``strict`` is False.
    """
    values, scales = flat_outputs(outs)
    tensors = values + scales
    key = (fmt, tuple(slab.shape), slab.device, len(outs[0]) if outs else 1, tuple(map(id, tensors)))
    hit = _prepared.get(key, tensors)
    if hit is not None:
        return hit
    if strict:
        check_outputs(slab, fmt, outs, names())
    elif _problems(slab, fmt, outs, names()):
        return None
    entry = PreparedOutputs(
        key=key,
        q_table=pointer_table(values, slab.device),
        s_table=pointer_table(scales, slab.device),
        aligned=is_aligned(values),
        refs=[weakref.ref(t) for t in tensors],
    )
    _prepared.put(key, entry)
    return entry


def clear_prepared() -> None:
    _prepared.clear()


def flat_outputs(outs: Outs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(values, scales) in table order: index ``e * parts + p``."""
    return [pair[0] for row in outs for pair in row], [pair[1] for row in outs for pair in row]


def default_names(experts: int, parts: int, base: str = "slab") -> list[list[str]]:
    return [[f"{base}[{e}] part {p}" for p in range(parts)] for e in range(experts)]


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))
