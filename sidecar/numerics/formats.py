"""Formats and the numeric constants of docs/spec.md, in one place."""

from __future__ import annotations

import enum
from dataclasses import dataclass
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


class Nvfp4Names(str, enum.Enum):
    """Whose names an NVFP4 weight is published under (SPEC §2.3): ModelOpt's (``.weight``,
    ``.weight_scale``, ``.weight_scale_2 = gs``), which vLLM's ``modelopt_fp4``, SGLang and TensorRT-LLM
    load, or compressed-tensors' ``nvfp4-pack-quantized`` (``.weight_packed``, ``.weight_scale``,
    ``.weight_global_scale = float32(1 / gs)``). Same bytes either way; the engine's manifest says."""

    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed_tensors"

    @classmethod
    def parse(cls, value: Nvfp4Names | str) -> Nvfp4Names:
        if isinstance(value, Nvfp4Names):
            return value
        try:
            return cls(str(value).strip().lower().replace("-", "_"))
        except ValueError:
            raise ValueError(
                f"unknown NVFP4 naming {value!r}: choose one of {', '.join(n.value for n in cls)}"
            ) from None


#: the scale dtypes an int4_w4a16 engine may hold (SPEC §1.7), by name
INT4_SCALE_DTYPE_NAMES = ("bfloat16", "float32")
#: the largest INT4 group accepted (a bound for values read off the wire; real ones are 32..128)
INT4_MAX_GROUP = 1 << 16


@dataclass(frozen=True, slots=True, kw_only=True)
class FormatParams:
    """The parameters of a format the engine decides (SPEC §1.7, §2.3), beside the format itself.

    ``int4_group`` (g of SPEC §1.7: 32 unless the engine says; any positive multiple of 8, every K a
    multiple of it) and ``int4_scale_dtype`` (``bfloat16`` or ``float32``: what the engine's
    ``.weight_scale`` parameter is) shape ``int4_w4a16`` outputs; ``nvfp4_names`` names ``nvfp4``
    outputs. The daemon takes them from the attached engine's manifest (the manifest decides) and
    plans with them; a plan made without an engine uses the defaults, the engines' usual choice.
    A parameter of a format other than the one published keeps its default (:meth:`check_for`).
    """

    int4_group: int = INT4_GROUP
    int4_scale_dtype: str = "bfloat16"
    nvfp4_names: Nvfp4Names = Nvfp4Names.MODELOPT

    def __post_init__(self) -> None:
        g = self.int4_group
        if type(g) is not int or not 0 < g <= INT4_MAX_GROUP or g % INT4_PACK:
            raise ValueError(
                f"int4_w4a16 group {g!r}: give a positive multiple of {INT4_PACK} (SPEC §1.7; the engines "
                "load 32, 64 or 128)"
            )
        dtype = str(self.int4_scale_dtype).removeprefix("torch.")
        if dtype not in INT4_SCALE_DTYPE_NAMES:
            raise ValueError(
                f"int4_w4a16 scale dtype {self.int4_scale_dtype!r}: give one of {', '.join(INT4_SCALE_DTYPE_NAMES)}"
            )
        object.__setattr__(self, "int4_scale_dtype", dtype)
        object.__setattr__(self, "nvfp4_names", Nvfp4Names.parse(self.nvfp4_names))

    def check_for(self, fmt: Format) -> None:
        """Refuse a parameter set away from its default for a format it does not apply to."""
        default = FormatParams()
        odd = []
        if fmt is not Format.INT4_W4A16:
            odd += [
                f"{k} = {getattr(self, k)}"
                for k in ("int4_group", "int4_scale_dtype")
                if getattr(self, k) != getattr(default, k)
            ]
        if fmt is not Format.NVFP4 and self.nvfp4_names is not default.nvfp4_names:
            odd.append(f"nvfp4_names = {self.nvfp4_names.value}")
        if odd:
            raise ValueError(
                f"{', '.join(odd)} applies to another format than {fmt.value}; leave it at its default "
                "(or publish that format)"
            )

    def for_format(self, fmt: Format) -> FormatParams:
        """These parameters with those of other formats than ``fmt`` at their defaults: what a plan
        in ``fmt`` uses of an engine's manifest."""
        default = FormatParams()
        return FormatParams(
            int4_group=self.int4_group if fmt is Format.INT4_W4A16 else default.int4_group,
            int4_scale_dtype=self.int4_scale_dtype if fmt is Format.INT4_W4A16 else default.int4_scale_dtype,
            nvfp4_names=self.nvfp4_names if fmt is Format.NVFP4 else default.nvfp4_names,
        )

    @property
    def int4_scale_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.int4_scale_dtype)

    # ---- what the format's outputs look like under these parameters (SPEC §2.3)

    def weight_suffix(self, fmt: Format) -> str:
        """``Format.weight_suffix``, with NVFP4 under compressed-tensors' names ``weight_packed``."""
        if fmt is Format.NVFP4 and self.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS:
            return "weight_packed"
        return fmt.weight_suffix

    def scale_dtype(self, fmt: Format) -> torch.dtype | None:
        """``Format.scale_dtype``, with INT4's the engine's."""
        return self.int4_scale_torch_dtype if fmt is Format.INT4_W4A16 else fmt.scale_dtype

    def scale_shape(self, fmt: Format, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """``Format.scale_shape``, with INT4's one scale per ``int4_group``."""
        if fmt is Format.INT4_W4A16:
            *lead, k = shape
            return (*lead, k // self.int4_group)
        return fmt.scale_shape(shape)

    def k_multiple(self, fmt: Format) -> int | None:
        """What every quantized weight's in dim K must be a multiple of (SPEC §1.2, §1.5-1.7)."""
        if fmt is Format.INT4_W4A16:
            return self.int4_group
        return {Format.MXFP8: MX_BLOCK, Format.NVFP4: NVFP4_BLOCK, Format.MXFP4: MXFP4_BLOCK}.get(fmt)

    def global_scale_leaf(self) -> str:
        """NVFP4's global-scale output leaf: ModelOpt's ``weight_scale_2`` (gs) or compressed-tensors'
        ``weight_global_scale`` (1 / gs)."""
        if self.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS:
            return "weight_global_scale"
        return "weight_scale_2"

    def describe(self, fmt: Format) -> str:
        """The parameters that apply to ``fmt``, for messages (``""`` when none do)."""
        if fmt is Format.INT4_W4A16:
            return f"group {self.int4_group}, {self.int4_scale_dtype} scales"
        if fmt is Format.NVFP4:
            return f"{self.nvfp4_names.value} names"
        return ""

    # ---- on the wire (a manifest's ``format_params`` map)

    def to_wire(self) -> dict[str, Any]:
        return {
            "int4_group": self.int4_group,
            "int4_scale_dtype": self.int4_scale_dtype,
            "nvfp4_names": self.nvfp4_names.value,
        }

    @classmethod
    def from_wire(cls, data: Any) -> FormatParams:
        """Parse a ``format_params`` map; ValueError naming the field (an unknown key is refused)."""
        if not isinstance(data, dict):
            raise ValueError(f"'format_params' must be a map, got {type(data).__name__}")
        known = ("int4_group", "int4_scale_dtype", "nvfp4_names")
        unknown = sorted(str(k)[:40] for k in data if k not in known)
        if unknown:
            raise ValueError(
                f"unknown format parameter(s) {unknown[:5]}; refitd knows {list(known)}: is the adapter from "
                "another refitd version than the daemon?"
            )
        for key in ("int4_scale_dtype", "nvfp4_names"):
            if key in data and not isinstance(data[key], str):
                raise ValueError(f"format parameter {key!r} must be a string, got {data[key]!r:.80}")
        return cls(**data)


#: the parameters a plan made without an engine uses (INT4 group 32 in bfloat16, ModelOpt NVFP4 names)
DEFAULT_FORMAT_PARAMS = FormatParams()

#: the FP8 formats (one float8 value per element, one scale tensor): the paths written for them
FP8_FORMATS = (Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR)
#: the 4-bit formats (SPEC §1.5-1.7)
FOUR_BIT_FORMATS = (Format.NVFP4, Format.MXFP4, Format.INT4_W4A16)
