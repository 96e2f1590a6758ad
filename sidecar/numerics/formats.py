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
# 4-bit formats (SPEC §1.5-1.7)
E2M1_MAX = 6.0  # largest E2M1 magnitude; RNE_e2m1 saturates here
NVFP4_BLOCK = 16  # NVFP4 block length along the last dim (one float8_e4m3fn scale each)
NVFP4_GLOBAL_DIVISOR = 2688.0  # 6 * 448: gs = amax_t / 2688
NVFP4_SCALE_MIN = 2.0**-9  # smallest e4m3fn subnormal: the floor of an NVFP4 block scale
MXFP4_BLOCK = 32  # MXFP4 block length along the last dim (one E8M0 byte each)
INT4_GROUP = 32  # int4_w4a16 group length along K unless the engine says otherwise
INT4_MAX = 7  # the symmetric QAT grid [-7, 7] (slime's INT4 rollouts); nibble q + 8
INT4_PACK = 8  # int4 values per int32 word (compressed-tensors' pack-quantized)


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
    # the 4-bit formats (after BF16, so the FP8 formats' listing in messages stays as it was)
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    INT4_W4A16 = "int4_w4a16"

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
    def four_bit(self) -> bool:
        """NVFP4, MXFP4 or INT4 (SPEC §1.5-1.7): packed 4-bit values, not one float8 per element."""
        return self in (Format.NVFP4, Format.MXFP4, Format.INT4_W4A16)

    @property
    def scale_suffix(self) -> str | None:
        """Checkpoint suffix replacing ``weight`` for the (first) scale tensor, or None for BF16."""
        return {
            Format.BLOCK_FP8: "weight_scale_inv",
            Format.MXFP8: "weight_scale",
            Format.FP8_PER_TENSOR: "weight_scale",
            Format.NVFP4: "weight_scale",
            Format.MXFP4: "weight_scale",
            Format.INT4_W4A16: "weight_scale",
            Format.BF16: None,
        }[self]

    @property
    def weight_suffix(self) -> str:
        """Checkpoint suffix of the quantized values (SPEC §2.3): ``weight_packed`` for the
        compressed-tensors formats, ``weight`` otherwise."""
        return "weight_packed" if self in (Format.MXFP4, Format.INT4_W4A16) else "weight"

    @property
    def scale_dtype(self) -> torch.dtype | None:
        import torch

        return {
            Format.BLOCK_FP8: torch.float32,
            Format.MXFP8: torch.uint8,
            Format.FP8_PER_TENSOR: torch.float32,
            Format.NVFP4: torch.float8_e4m3fn,
            Format.MXFP4: torch.uint8,
            Format.INT4_W4A16: torch.bfloat16,  # float32 where the engine's manifest says so
            Format.BF16: None,
        }[self]

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """dtype of the quantized values (packed for the 4-bit formats)."""
        import torch

        if self is Format.BF16:
            return None
        if self is Format.INT4_W4A16:
            return torch.int32
        return torch.uint8 if self.four_bit else torch.float8_e4m3fn

    def weight_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the quantized values for a weight of ``shape``: two E2M1 codes per byte, eight
        int4 nibbles per int32 word, one float8 per element otherwise."""
        *lead, k = shape
        if self in (Format.NVFP4, Format.MXFP4):
            return (*lead, k // 2)
        if self is Format.INT4_W4A16:
            return (*lead, k // INT4_PACK)
        return tuple(shape)

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
        if self is Format.NVFP4:
            *lead, k = shape
            return (*lead, k // NVFP4_BLOCK)
        if self is Format.MXFP4:
            *lead, k = shape
            return (*lead, k // MXFP4_BLOCK)
        if self is Format.INT4_W4A16:
            *lead, k = shape
            return (*lead, k // INT4_GROUP)
        return None


#: what an engine adapter says for a 4-bit format it has no verified loader arguments and attach
#: checks for yet (the daemon, plans, forwarding and the reference engine handle them)
FOUR_BIT_ENGINE_REFUSAL = (
    "refitd publishes {fmt} (SPEC §1.5-1.7), but its {engine} adapter has no verified engine arguments, "
    "MoE-backend rules or attach checks for {fmt} yet: refit {engine} in block_fp8, mxfp8 or "
    "fp8_per_tensor, or load {fmt} generations with your own loader (the tensors follow SPEC §2.3)"
)

#: the FP8 formats (one float8 value per element, one scale tensor): the paths written for them
FP8_FORMATS = (Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR)
#: the 4-bit formats (SPEC §1.5-1.7)
FOUR_BIT_FORMATS = (Format.NVFP4, Format.MXFP4, Format.INT4_W4A16)
