"""Formats and the numeric constants of ../shared/SPEC.md, in one place."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch loads on first use of a dtype (FP8_DTYPE, FLOAT_DTYPES, Format.scale_dtype), not on import:
# ``refitd status`` / ``--version`` / ``--help`` import this module and must not pay for torch.
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FLT_MIN = 2.0**-126  # smallest normal float32; floor of a block-FP8 / per-tensor scale
BLOCK = 128  # block-FP8 tile edge (128x128 tiles of the last two dims)
MX_BLOCK = 32  # MXFP8 block length along the last dim
E8M0_BIAS = 127
E8M0_MIN_BYTE = 1  # byte 0 is never emitted: some kernels reject it
E8M0_MAX_BYTE = 254  # byte 255 is NaN in E8M0


def _torch_constants() -> dict[str, Any]:
    import torch

    return {
        "FP8_DTYPE": torch.float8_e4m3fn,
        # the input dtypes a quantizer accepts; each upcasts to float32 exactly
        "FLOAT_DTYPES": (torch.bfloat16, torch.float16, torch.float32),
    }


_LAZY = ("FP8_DTYPE", "FLOAT_DTYPES")


def __getattr__(name: str) -> Any:
    """``FP8_DTYPE`` (``torch.float8_e4m3fn``) and ``FLOAT_DTYPES`` (bfloat16, float16, float32),
    made on first access (``from sidecar.numerics.formats import FP8_DTYPE`` included) and then kept."""
    if name in _LAZY:
        values = _torch_constants()
        globals().update(values)
        return values[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class Format(str, enum.Enum):
    """Target format of the routed experts. Strings are accepted at the edge via ``Format.parse``."""

    BLOCK_FP8 = "block_fp8"
    MXFP8 = "mxfp8"
    FP8_PER_TENSOR = "fp8_per_tensor"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: Format | str) -> Format:
        if isinstance(value, Format):
            return value
        try:
            return cls(str(value).strip().lower().replace("-", "_"))
        except ValueError:
            choices = ", ".join(f.value for f in cls)
            raise ValueError(f"unknown format {value!r}: choose one of {choices}") from None

    @property
    def quantized(self) -> bool:
        return self is not Format.BF16

    @property
    def scale_suffix(self) -> str | None:
        """Checkpoint suffix replacing ``weight`` for the scale tensor, or None for BF16."""
        return {
            Format.BLOCK_FP8: "weight_scale_inv",
            Format.MXFP8: "weight_scale",
            Format.FP8_PER_TENSOR: "weight_scale",
            Format.BF16: None,
        }[self]

    @property
    def scale_dtype(self) -> torch.dtype | None:
        import torch

        return {
            Format.BLOCK_FP8: torch.float32,
            Format.MXFP8: torch.uint8,
            Format.FP8_PER_TENSOR: torch.float32,
            Format.BF16: None,
        }[self]

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """Shape of the scale tensor for a weight of ``shape`` (``[..., N, K]``)."""
        if self is Format.BLOCK_FP8:
            *lead, n, k = shape
            return (*lead, -(-n // BLOCK), -(-k // BLOCK))
        if self is Format.MXFP8:
            *lead, k = shape
            return (*lead, k // MX_BLOCK)
        if self is Format.FP8_PER_TENSOR:
            return ()
        return None
